"""The callbacks' protocol (``lit_grpo.callbacks.protocol``) is checked when the fit starts: each wrong name stops the
run with one line naming the attribute, in every callback that reads it; ``ref/swaps`` counts swaps made, apart from
``ref/stages``; a second ``RefModelSwap`` is refused; a tokenizer without a pad token works in ``GSM8KPassAtK``."""

import copy

import lightning as L
import pytest
import torch
from conftest import MetricsRecorder, tiny_trainer
from lit_grpo.callbacks import GSM8KPassAtK, HFExport, RefModelSwap, WeightSync
from lit_grpo.callbacks.protocol import layout_mismatch, misnamed
from torch.utils.data import DataLoader

from lit_grpo.engines import TransformersEngine
from lit_grpo.engines.base import SamplingConfig
from lit_grpo.evaluation.pass_at_k import PassAtKSettings, evaluate_pass_at_k
from lit_grpo.models.loading import pad_token_id, tiny_llama, tiny_tokenizer


class Foreign(L.LightningModule):
    """A module of one's own, holding whatever attributes it is given (models first: the first trains)."""

    def __init__(self, **attributes) -> None:
        super().__init__()
        for name, value in attributes.items():
            setattr(self, name, value)

    def training_step(self, batch, batch_idx):
        model = next(self.children())
        ids = torch.randint(4, 90, (2, 8), generator=torch.Generator().manual_seed(batch_idx))
        return model(input_ids=ids, labels=ids).loss

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.5)


def fit(tmp_path, module: L.LightningModule, callbacks, steps: int = 1) -> L.Trainer:
    trainer = tiny_trainer(tmp_path, max_steps=steps, callbacks=callbacks)
    trainer.fit(module, train_dataloaders=DataLoader(torch.zeros(16, 1), batch_size=None))
    return trainer


def one_line_error(tmp_path, module, callbacks, exc=TypeError) -> str:
    with pytest.raises(exc) as info:
        fit(tmp_path, module, callbacks)
    message = str(info.value)
    assert "\n" not in message, message
    return message


@pytest.fixture(scope="module")
def models():
    tokenizer = tiny_tokenizer()
    policy = tiny_llama(len(tokenizer))
    return policy, copy.deepcopy(policy), tokenizer


def every_callback(tmp_path, policy, tokenizer) -> dict[str, L.Callback]:
    engine = TransformersEngine(policy, [tokenizer.eos_token_id], tokenizer.pad_token_id)
    return {"WeightSync": WeightSync(engine=engine), "RefModelSwap": RefModelSwap(every_n_batches=1),
            "GSM8KPassAtK": GSM8KPassAtK(num_questions=1, num_samples=1, max_new_tokens=2, system_prompt=None),
            "HFExport": HFExport(tmp_path / "export")}


@pytest.mark.parametrize("name", ["WeightSync", "RefModelSwap", "GSM8KPassAtK", "HFExport"])
def test_policy_stored_as_model_fails_in_one_line_naming_policy(tmp_path, models, name):
    policy, reference, tokenizer = models
    module = Foreign(model=policy, ref_model=reference, tokenizer=tokenizer)
    callback = every_callback(tmp_path, policy, tokenizer)[name]
    message = one_line_error(tmp_path, module, [callback])
    assert message.startswith(f"{name}: Foreign has no attribute `policy`; expected `policy`: ")
    assert "found `model`, did you mean to name it `policy`?" in message  # not `ref_model`


@pytest.mark.parametrize("name", ["WeightSync", "RefModelSwap", "GSM8KPassAtK", "HFExport"])
def test_module_itself_is_not_the_policy(tmp_path, models, name):
    """The documented fallback (no `policy`: the module is the policy) is gone: one line, whatever else it holds."""
    policy, _, tokenizer = models
    module = Foreign(head=torch.nn.Linear(2, 2), tokenizer=tokenizer)  # a parameter for the optimizer
    message = one_line_error(tmp_path, module, [every_callback(tmp_path, policy, tokenizer)[name]])
    assert message.startswith(f"{name}: Foreign has no attribute `policy`")


def test_reference_stored_as_ref_model_fails_in_one_line_naming_reference(tmp_path, models):
    policy, reference, tokenizer = models
    module = Foreign(policy=policy, ref_model=reference, tokenizer=tokenizer)
    message = one_line_error(tmp_path, module, [RefModelSwap(every_n_batches=1)])
    assert message.startswith("RefModelSwap: Foreign has no attribute `reference`; expected `reference`: an "
                              "nn.Module with the policy's parameter layout, or None")
    assert message.endswith("found `ref_model`, did you mean to name it `reference`?")


def test_reference_of_another_layout_fails_naming_the_first_mismatch(tmp_path, models):
    policy, _, tokenizer = models
    other = tiny_llama(len(tokenizer) + 1)  # one more token: the embedding differs first
    message = one_line_error(tmp_path, Foreign(policy=policy, reference=other), [RefModelSwap(every_n_batches=1)])
    assert "RefModelSwap: Foreign.reference does not have the policy's parameter layout: parameter " in message
    assert f"`model.embed_tokens.weight` has shape [{len(tokenizer)}, 64] in the policy but [{len(tokenizer) + 1}, " \
           "64] in the reference" in message


def test_layout_mismatch_names_names_and_counts():
    a, b = torch.nn.Sequential(torch.nn.Linear(2, 2)), torch.nn.Sequential(torch.nn.Linear(2, 2, bias=False))
    assert layout_mismatch(a, a) is None
    assert layout_mismatch(a, b) == "the policy has 2 parameters and the reference 1 (the policy's `0.bias` has no " \
                                    "counterpart)"
    c = torch.nn.Module()
    c.layer = torch.nn.Linear(2, 2)
    assert layout_mismatch(a, c) == "parameter `0.weight` of the policy is `layer.weight` in the reference"


def test_misnamed_prefers_ref_names_for_the_reference_and_others_for_the_policy(models):
    policy, reference, tokenizer = models
    module = Foreign(net=policy, pi_ref=reference, tok=tokenizer)
    is_module = lambda v: isinstance(v, torch.nn.Module)  # noqa: E731
    assert misnamed(module, "reference", is_module) == "pi_ref"
    assert misnamed(module, "policy", is_module) == "net"
    assert misnamed(Foreign(), "policy", is_module) is None


def test_missing_tokenizer_fails_in_one_line_naming_tokenizer(tmp_path, models):
    policy, _, tokenizer = models
    module = Foreign(policy=policy, tok=tokenizer)
    evaluator = GSM8KPassAtK(num_questions=1, num_samples=1, max_new_tokens=2, system_prompt=None)
    message = one_line_error(tmp_path, module, [evaluator])
    assert message.startswith("GSM8KPassAtK: Foreign has no attribute `tokenizer`; expected `tokenizer`: a Hugging "
                              "Face tokenizer")
    assert message.endswith("found `tok`, did you mean to name it `tokenizer`?")


def test_policy_that_is_not_a_causal_lm_fails_in_pass_at_k_and_export(tmp_path, models):
    _, _, tokenizer = models
    module = Foreign(policy=torch.nn.Linear(2, 2), tokenizer=tokenizer)
    module.training_step = lambda batch, batch_idx: module.policy(torch.ones(1, 2)).sum()
    message = one_line_error(tmp_path, module, [GSM8KPassAtK(num_questions=1, num_samples=1, system_prompt=None)])
    assert message.startswith("GSM8KPassAtK: Foreign.policy is a Linear; expected `policy`: a Hugging Face causal LM")
    message = one_line_error(tmp_path, module, [HFExport(tmp_path / "export")])
    assert message.startswith("HFExport: Foreign.policy is a Linear; expected `policy`: a Hugging Face model with "
                              "`save_pretrained`")


def test_missing_or_wrong_engine_fails_in_one_line(tmp_path, models):
    policy, _, tokenizer = models
    message = one_line_error(tmp_path, Foreign(policy=policy), [WeightSync()])
    assert message.startswith("WeightSync: no rollout engine; expected a lit_grpo.engines.base.RolloutEngine")
    message = one_line_error(tmp_path, Foreign(policy=policy, rollout_engine=object()), [WeightSync()])
    assert message.startswith("WeightSync: Foreign.rollout_engine is a object; expected a "
                              "lit_grpo.engines.base.RolloutEngine")


def test_swaps_count_only_swaps_made_and_stages_apart(tmp_path, models):
    policy, _, tokenizer = models
    recorder = MetricsRecorder()
    swap = RefModelSwap(every_n_batches=1)
    fit(tmp_path, Foreign(policy=copy.deepcopy(policy), reference=None), [swap, recorder], steps=3)
    assert swap.swaps == 0 and swap.stages_done == 3 and swap.last_swap_step == -1
    assert [s["ref/swaps"] for s in recorder.steps] == [0.0, 0.0, 0.0]
    assert [s["ref/stages"] for s in recorder.steps] == [1.0, 2.0, 3.0]


def test_max_swaps_counts_swaps_while_stages_go_on(tmp_path, models):
    policy, reference, _ = models
    module = Foreign(policy=copy.deepcopy(policy), reference=copy.deepcopy(reference), reference_version=0)
    recorder = MetricsRecorder()
    swap = RefModelSwap(every_n_batches=1, max_swaps=1)
    fit(tmp_path, module, [swap, recorder], steps=3)
    assert swap.swaps == 1 and swap.stages_done == 3 and module.reference_version == 1
    assert [s["ref/swaps"] for s in recorder.steps] == [1.0, 1.0, 1.0]
    assert [s["ref/stages"] for s in recorder.steps] == [1.0, 2.0, 3.0]
    # the reference holds the policy of step 1, which has moved since
    assert not torch.equal(module.reference.lm_head.weight, module.policy.lm_head.weight)


def test_old_checkpoint_state_of_ref_swap_loads():
    swap = RefModelSwap(every_n_batches=2)
    swap.load_state_dict({"swaps": 2, "last_swap_step": 4, "stages_done": 2})  # written before batches_seen existed
    assert (swap.swaps, swap.last_swap_step, swap.stages_done, swap.batches_seen) == (2, 4, 2, 0)
    assert set(swap.state_dict()) == {"swaps", "last_swap_step", "stages_done", "batches_seen"}


def test_second_ref_model_swap_is_refused_in_one_line(tmp_path, models):
    policy, reference, _ = models
    module = Foreign(policy=policy, reference=reference)
    message = one_line_error(tmp_path, module, [RefModelSwap(every_n_batches=1), RefModelSwap(every_n_batches=2)],
                             exc=ValueError)
    assert message.startswith("RefModelSwap: the trainer has 2 RefModelSwap callbacks; expected one")


def without_pad(tokenizer):
    tokenizer = copy.deepcopy(tokenizer)
    tokenizer.pad_token = None
    assert tokenizer.pad_token_id is None and tokenizer.eos_token_id is not None
    return tokenizer


def test_pad_token_id_falls_back_to_eos_without_changing_the_tokenizer(models):
    _, _, tokenizer = models
    assert pad_token_id(tokenizer) == tokenizer.pad_token_id != tokenizer.eos_token_id
    padless = without_pad(tokenizer)
    assert pad_token_id(padless) == tokenizer.eos_token_id and padless.pad_token is None
    padless.eos_token = None
    with pytest.raises(ValueError, match="has neither a pad_token nor an eos_token"):
        pad_token_id(padless)


def test_pass_at_k_with_a_tokenizer_without_pad_token(tmp_path, models):
    policy, _, tokenizer = models
    padless = without_pad(tokenizer)
    settings = PassAtKSettings(num_samples=2, ks=(1, 2), sampling=SamplingConfig(max_new_tokens=4),
                               questions_per_chunk=2, system_prompt=None)
    rows = [{"question": "1 + 1?", "answer": "#### 2"}, {"question": "2 + 2?", "answer": "#### 4"},
            {"question": "3 + 3?", "answer": "#### 6"}]  # two chunks, the second of one row: padding in each
    results = evaluate_pass_at_k(policy, padless, rows, settings)
    assert set(results) == {1, 2} and padless.pad_token is None
    module = Foreign(policy=copy.deepcopy(policy), tokenizer=padless)
    evaluator = GSM8KPassAtK(num_questions=3, num_samples=2, max_new_tokens=4, system_prompt=None,
                             questions_per_chunk=2)
    fit(tmp_path, module, [evaluator], steps=1)
    assert [h["step"] for h in evaluator.history] == [1.0] and 0.0 <= evaluator.history[0]["pass@1"] <= 1.0
