"""The KV cache goes in and out of a transformers model under the name its forward declares
(lit_grpo/core/cache_argument.py): ``cache`` where the installed transformers has it (5.24 on), else
``past_key_values`` (4.56 on), through PEFT and ``torch.compile`` wrappers; and neither the prefix-shared scoring nor
the in-process engine's decoding uses the deprecated name."""

import dataclasses
import inspect
import warnings

import pytest
import torch
from torch import nn
from transformers import LlamaConfig, LlamaForCausalLM

from lit_grpo.core import cache_argument
from lit_grpo.core.cache_argument import cache_kwarg, output_cache


def tiny_llama() -> LlamaForCausalLM:
    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2)
    return LlamaForCausalLM(config).eval()


class OldStyle(nn.Module):
    """A forward of transformers before 5.24: only the old name."""

    def forward(self, input_ids=None, past_key_values=None, use_cache=None):  # noqa: ANN001, ANN201
        return input_ids


class PassThrough(nn.Module):
    """A wrapper in the manner of DDP: ``**kwargs`` passed on to ``self.module``."""

    def __init__(self, module: nn.Module) -> None:
        super().__init__()
        self.module = module

    def forward(self, *args, **kwargs):  # noqa: ANN002, ANN003, ANN201
        return self.module(*args, **kwargs)


@dataclasses.dataclass
class OldOutput:
    logits: object = None
    past_key_values: object = None


def test_the_installed_transformers_model_gets_the_name_its_forward_declares():
    model = tiny_llama()
    declared = inspect.signature(type(model).forward).parameters
    expected = "cache" if "cache" in declared else "past_key_values"
    assert cache_kwarg(model) == expected
    assert cache_kwarg(PassThrough(model)) == expected
    assert cache_kwarg(torch.compile(model)) == expected


def test_a_model_of_an_older_transformers_gets_past_key_values():
    assert cache_kwarg(OldStyle()) == "past_key_values"
    assert cache_kwarg(PassThrough(OldStyle())) == "past_key_values"
    assert cache_kwarg(PassThrough(PassThrough(nn.Identity()))) == "past_key_values"  # declares neither
    assert output_cache(OldOutput(past_key_values="kv")) == "kv"


def test_the_name_is_read_once_per_model(monkeypatch):
    model = OldStyle()
    assert cache_kwarg(model) == "past_key_values"
    monkeypatch.setattr(cache_argument, "_declared_name", lambda m: pytest.fail("the signature was read again"))
    assert cache_kwarg(model) == "past_key_values"


def test_a_peft_model_gets_its_base_model_s_name():
    peft = pytest.importorskip("peft")
    model = tiny_llama()
    expected = cache_kwarg(model)
    lora = peft.get_peft_model(model, peft.LoraConfig(r=2, target_modules=["q_proj"]))
    assert cache_kwarg(lora) == expected


def test_scoring_and_decoding_do_not_use_the_deprecated_name(monkeypatch):
    from transformers.utils.generic import ModelOutput

    from lit_grpo.core.batch import MicroBatch
    from lit_grpo.core.scoring import completion_logprobs
    from lit_grpo.engines.base import SamplingConfig
    from lit_grpo.engines.transformers_engine import TransformersEngine

    if isinstance(inspect.getattr_static(ModelOutput, "past_key_values", None), property):
        # transformers 5.24 on: reading the old name off an output is a deprecated alias (warned once per process,
        # so a warning would be no evidence); here it fails outright
        monkeypatch.setattr(ModelOutput, "past_key_values", property(lambda self: pytest.fail("output read by "
                                                                                             "past_key_values")))
    model = tiny_llama()
    gen = torch.Generator().manual_seed(0)
    mb = MicroBatch(prompt_ids=torch.randint(4, 64, (2, 5), generator=gen), prompt_mask=torch.ones(2, 5).long(),
                    prompt_index=torch.tensor([0, 0, 1, 1]),
                    completion_ids=torch.randint(4, 64, (4, 3), generator=gen),
                    completion_mask=torch.ones(4, 3).long(), rows=slice(0, 4))
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        logps, _ = completion_logprobs(model, mb, temperature=1.0)
        engine = TransformersEngine(model, eos_token_ids=[2], pad_token_id=0, decode="dynamic")
        groups = engine.generate([[1, 5, 6]], 2, SamplingConfig(max_new_tokens=3), seed=0)
    assert logps.shape == (4, 3) and len(groups[0]) == 2
    said = [str(w.message) for w in caught if "past_key_values" in str(w.message)]
    assert said == []
