"""The in-process engine samples from the policy itself where a private copy would hold the same values
(``data.engine_options.weights``: ``auto`` / ``shared``): one copy of the weights less, the same fit."""

from __future__ import annotations

import pytest
import torch
from conftest import MetricsRecorder, tiny_data, tiny_module, tiny_trainer
from lightning.pytorch.strategies import DDPStrategy, FSDPStrategy
from lit_grpo.callbacks import RefModelSwap, WeightSync

from lit_grpo.data.engine_setup import why_not_shared
from lit_grpo.engines.transformers_engine import TransformersEngine
from lit_grpo.models.lora import LoraArgs

#: what the samples fix (equal to the bit), and what the updates compute from them: equal to float32's last bits,
#: which move with the kernels' paths (the copy's freshly allocated weights against the policy's own, inference
#: mode against no_grad: 5e-7 apart in a log-prob)
SAMPLED = ("rollout/reward_mean", "rollout/completion_length", "train/ratio_mean")
UPDATED = ("train/loss", "train/kl", "train/entropy", "train/grad_norm")


def fit(tmp_path, weights: str, every_n_batches: int = 1, lora: bool = False, steps: int = 4):
    torch.manual_seed(0)  # LoRA's initial A, and what else draws from the global generator in a fit
    module = tiny_module(lr=1e-2, beta=0.1, lora=LoraArgs(r=4) if lora else None)
    data = tiny_data(engine_options={"weights": weights})
    recorder = MetricsRecorder()
    callbacks = [WeightSync(every_n_batches=every_n_batches), RefModelSwap(every_n_batches=2), recorder]
    trainer = tiny_trainer(tmp_path / weights, max_steps=steps, callbacks=callbacks)
    trainer.fit(module, datamodule=data)
    return module, data.rollout_engine, recorder.steps


def picked(steps: list[dict[str, float]], keys: tuple[str, ...]) -> list[dict[str, float]]:
    return [{k: s[k] for k in keys} for s in steps]


@pytest.mark.parametrize("lora", [False, True], ids=["full", "lora"])
def test_at_v1_the_engine_samples_from_the_policy_and_the_fit_equals_the_copys(tmp_path, lora):
    module, shared, shared_steps = fit(tmp_path, "auto", lora=lora)
    _, copy, copy_steps = fit(tmp_path, "copy", lora=lora)
    assert shared.shares_policy and not shared.owns_weights and shared.model is module.policy
    assert copy.owns_weights and not copy.shares_policy and copy.model is not module.policy
    assert shared.synced_step == copy.synced_step == 4  # each push recorded, none copied
    assert len(shared_steps) == len(copy_steps) == 4
    assert picked(shared_steps, SAMPLED) == picked(copy_steps, SAMPLED)  # the same weights, the same seeds
    for mine, theirs in zip(picked(shared_steps, UPDATED), picked(copy_steps, UPDATED)):
        assert mine == pytest.approx(theirs, rel=1e-5, abs=1e-8)
    assert all(s["train/ratio_mean"] == 1.0 for s in shared_steps)  # v = 1, i = 1: alpha is pi_k exactly
    assert [s["sync/bytes"] for s in shared_steps] == [0.0] * 4 and copy_steps[0]["sync/bytes"] > 0
    assert shared_steps[0]["train/loss"] != shared_steps[-1]["train/loss"]  # the weights did move


def test_auto_keeps_a_copy_where_the_engine_lags(tmp_path):
    _, engine, _ = fit(tmp_path, "auto", every_n_batches=2, steps=2)
    assert engine.owns_weights and not engine.shares_policy


def test_shared_where_the_engine_would_lag_is_refused_in_one_line(tmp_path):
    with pytest.raises(ValueError, match=r"weights=shared .* WeightSync\(every_n_batches=2, delay_batches=0\) "
                                         r"lets the engine lag the policy; expected weights: copy"):
        fit(tmp_path, "shared", every_n_batches=2, steps=1)


def test_the_reasons_a_copy_is_kept():
    v1 = [WeightSync(every_n_batches=1)]
    assert why_not_shared(v1, object(), 0, None) is None
    assert why_not_shared(v1, object(), 0, DDPStrategy()) is None
    assert "max_staleness=1" in why_not_shared(v1, object(), 1, None)
    assert "no WeightSync" in why_not_shared([], object(), 0, None)
    assert "delay_batches=1" in why_not_shared([WeightSync(delay_batches=1)], object(), 0, None)
    assert "FSDPStrategy shards the policy" in why_not_shared(v1, object(), 0, FSDPStrategy())

    class OwnSync:  # a user's callback that loads the engine's weights: it would copy them into a shared engine
        syncs_rollout_engine = True

    assert why_not_shared([OwnSync()], object(), 0, None) == "OwnSync loads weights into the engine"
    assert why_not_shared(v1, OwnSync(), 0, None) == "OwnSync loads the engine's weights itself"


def test_weight_sync_refuses_to_lag_an_engine_that_shares_the_policy(tmp_path):
    module = tiny_module()
    engine = TransformersEngine(module.policy, [module.tokenizer.eos_token_id], 0, copy_weights=False,
                                shares_policy=True)
    trainer = tiny_trainer(tmp_path, max_steps=1, callbacks=[WeightSync(every_n_batches=3, engine=engine)])
    with pytest.raises(ValueError, match=r"WeightSync\(every_n_batches=3, delay_batches=0\) lets the rollout engine "
                                         r"lag the policy, but the engine samples from the policy itself"):
        trainer.fit(module, datamodule=tiny_data())


def test_an_unknown_weights_value_is_refused_in_one_line():
    from lit_grpo.engines.options import engine_options

    with pytest.raises(ValueError, match=r"^data.engine_options: weights must be one of "
                                         r"\('auto', 'copy', 'shared'\), got 'borrow'$"):
        engine_options("transformers", {"weights": "borrow"})


def test_shares_policy_needs_a_borrowed_model():
    model = torch.nn.Linear(2, 2)
    with pytest.raises(ValueError, match="expected copy_weights=False"):
        TransformersEngine(model, [0], 0, copy_weights=True, shares_policy=True)
