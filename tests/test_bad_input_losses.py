"""Losses that could not honour the sampler correction or the top-entropy mask are refused in one line, before
any model loads.

VESPO adds each token's correction to its sequence's log-weight, so a per-sequence weight broadcast over the
sequence's tokens would count once per token (TRL refuses its sequence modes with VESPO too). Your own loss gets the
correction's weight and the top-entropy mask only through parameters it names: a ``**kwargs`` catch-all would
receive them and could drop them without a word.
"""

from __future__ import annotations

import pytest
from cli_runner import no_model, refusal_line
from conftest import tiny_module

from lit_grpo.math.corrections import CorrectionOptions
from lit_grpo.math.entropy_terms import EntropyOptions
from lit_grpo.math.objective import grpo_loss

HERE = "test_bad_input_losses"  # this file, importable by name: conftest puts tests/ on sys.path


def forwards_kwargs(logp, alpha_logp, advantages, weights, mask, config, pik_logp=None, ref_logp=None, **kwargs):
    """A loss that takes what it is given through ``**kwargs`` and names no correction."""
    return grpo_loss(logp, alpha_logp, advantages, weights, mask, config, pik_logp, ref_logp)


def only_kwargs(**kwargs):
    return grpo_loss(**kwargs)


def names_policy_mask(logp, alpha_logp, advantages, weights, mask, config, pik_logp=None, ref_logp=None,
                      policy_mask=None):
    return grpo_loss(logp, alpha_logp, advantages, weights, mask, config, pik_logp, ref_logp, policy_mask=policy_mask)


@pytest.mark.parametrize("mode", ["sequence_truncate", "sequence_mask"])
def test_vespo_refuses_a_per_sequence_correction(mode, monkeypatch):
    no_model(monkeypatch)
    with pytest.raises(ValueError) as err:
        tiny_module(loss="vespo", correction=CorrectionOptions(mode=mode))
    message = str(err.value)
    assert "\n" not in message
    for text in (f"model.correction.mode={mode!r}", "model.loss 'vespo'", "once per token", "token_truncate",
                 "token_mask"):
        assert text in message, (text, message)


def test_vespo_refuses_a_per_sequence_correction_on_the_command_line(tmp_path, monkeypatch, capsys):
    from test_cli_errors import TINY_RUN

    line = refusal_line(["fit", "--model.model_name", "tiny-random-llama", *TINY_RUN,
                         f"--trainer.default_root_dir={tmp_path}", "--model.loss", "vespo",
                         "--model.correction.mode", "sequence_truncate"], tmp_path, monkeypatch, capsys)
    assert "model.correction.mode='sequence_truncate'" in line and "model.loss 'vespo'" in line


@pytest.mark.parametrize("fn", ["forwards_kwargs", "only_kwargs"])
@pytest.mark.parametrize("setting, named", [
    ({"correction": CorrectionOptions(mode="token_truncate")}, "model.correction.mode='token_truncate'"),
    ({"entropy": EntropyOptions(top_entropy_quantile=0.5)}, "model.entropy.top_entropy_quantile=0.5"),
])
def test_a_loss_taking_kwargs_must_name_the_inputs_it_would_drop(fn, setting, named, monkeypatch):
    no_model(monkeypatch)
    with pytest.raises(ValueError) as err:
        tiny_module(loss=f"{HERE}:{fn}", **setting)
    message = str(err.value)
    assert "\n" not in message
    for text in (named, f"{HERE}:{fn}", "**kwargs"):
        assert text in message, (text, message)


def test_a_loss_naming_the_policy_mask_takes_the_top_entropy_mask_but_no_correction(monkeypatch):
    module = tiny_module(loss=f"{HERE}:names_policy_mask", entropy=EntropyOptions(top_entropy_quantile=0.5))
    assert module.loss_fn is names_policy_mask
    no_model(monkeypatch)
    with pytest.raises(ValueError, match="model.correction.mode='token_mask'.*`correction`") as err:
        tiny_module(loss=f"{HERE}:names_policy_mask", correction=CorrectionOptions(mode="token_mask"))
    assert "\n" not in str(err.value)


def test_vespo_takes_every_other_correction():
    """The token ratios enter its sequence weight as TRL's TIS ratio; the keep masks (``geometric_mask`` too: one
    0/1 value per sequence) multiply its term after phi, so only the per-sequence ratios are refused."""
    from lit_grpo.math.corrections import CORRECTION_MODES
    from lit_grpo.training.losses import build_loss, check_loss_inputs

    vespo = build_loss("vespo", None, 0.0)
    for mode in CORRECTION_MODES:
        if mode in ("sequence_truncate", "sequence_mask"):
            continue
        assert check_loss_inputs(vespo, mode, 0.5) == frozenset({"correction", "policy_mask"}), mode
