"""``model.attn_implementation``: the attention kernel a long reasoning run asks for (flash attention on a GPU) is an
option; a name transformers does not know, or flash attention where its package is missing, is one line before any
weights load; a kernel that loads is the policy's and pi_ref's."""

from __future__ import annotations

import pytest
from cli_runner import refusal_line

import lit_grpo.models.loading as loading


def test_an_unknown_kernel_is_one_line_before_the_weights_load(tmp_path, monkeypatch, capsys):
    monkeypatch.setattr(loading, "alias_loader", lambda name: pytest.fail("the weights were loaded first"))
    line = refusal_line(["fit", "--model.model_name", "tiny-random-llama", "--model.attn_implementation", "flash2",
                         "--trainer.max_steps", "1"], tmp_path, monkeypatch, capsys, may_load=True)
    assert line.startswith("error: model.attn_implementation='flash2': expected one of sdpa, eager, flex_attention, "
                           "flash_attention_2, flash_attention_3, flash_attention_4, a Hub kernel (owner/repo), or "
                           "null"), line


def test_flash_attention_without_its_package_is_one_line(monkeypatch):
    from transformers.utils import is_flash_attn_2_available

    monkeypatch.setattr(loading, "alias_loader", lambda name: pytest.fail("the weights were loaded first"))
    if is_flash_attn_2_available():  # a GPU machine with flash-attn: the kernel name passes the check
        loading.check_attention_name("flash_attention_2")
        return
    with pytest.raises(ValueError, match=r"^model.attn_implementation='flash_attention_2' needs the flash-attn "
                                         r"package and a CUDA GPU"):
        loading.load_model_and_tokenizer("tiny-random-llama", attn_implementation="flash_attention_2")


@pytest.mark.parametrize("kernel", ["eager", "sdpa"])
def test_the_kernel_asked_for_is_the_policys_and_the_references(kernel):
    from lit_grpo.training.module import GRPOModule

    module = GRPOModule("tiny-random-llama", beta=0.1, attn_implementation=kernel)
    assert module.policy.config._attn_implementation == kernel
    assert module.reference.config._attn_implementation == kernel
