"""Training in every precision a user can pick: alpha and pi in the same forward precision, gradient clipping
after the 16-mixed loss scale is divided out, 16-bit weights refused, and the trainer-sampler mismatch metric."""

import math

import pytest
import torch
from conftest import MetricsRecorder, tiny_data, tiny_module, tiny_trainer
from lightning.pytorch.plugins.precision import MixedPrecision
from lit_grpo.callbacks import WeightSync

from lit_grpo.math.tv import logprob_gap
from lit_grpo.training.module import GRPOModule
from lit_grpo.training.optim import OptimizerArgs


def test_bf16_mixed_frozen_policy_shows_no_drift_at_lagging_steps(tmp_path):
    """v = 4 with a policy that cannot move (lr 1e-12 is far below float32's resolution of the weights): the
    engine lags by 1-3 optimizer steps but holds the same weights, so in the trainer's own precision the
    first-iteration ratio pi_k/alpha is 1 and TV(pi_k, alpha) is 0. With alpha scored outside autocast (float32)
    and pi inside it (bfloat16 matrix products) the ratio spread to ~0.98-1.02 and the TV to ~3e-3."""
    recorder = MetricsRecorder()
    trainer = tiny_trainer(tmp_path, max_steps=5, precision="bf16-mixed",
                           callbacks=[WeightSync(every_n_batches=4), recorder])
    trainer.fit(tiny_module(lr=1e-12, max_completion_length=16),
                datamodule=tiny_data(max_new_tokens=16, micro_batch_size=3))
    lagging = [s for s in recorder.steps if s["train/staleness"] > 0]
    assert len(lagging) == 3  # staleness 0, 1, 2, 3, 0
    for step in lagging:
        assert abs(step["train/ratio_first_iteration_min"] - 1.0) <= 1e-3
        assert abs(step["train/ratio_first_iteration_max"] - 1.0) <= 1e-3
        assert step["tv/pik_alpha"] < 1e-4


def grad_norms(tmp_path, **trainer_options) -> list[float]:
    recorder = MetricsRecorder()
    trainer = tiny_trainer(tmp_path, max_steps=3, callbacks=[WeightSync(every_n_batches=1), recorder],
                           **trainer_options)
    trainer.fit(tiny_module(lr=1e-3, gradient_clip_val=1e-3), datamodule=tiny_data())
    return [s["train/grad_norm"] for s in recorder.steps], [s["train/nonfinite_grad_steps"] for s in recorder.steps]


def test_16_mixed_clips_and_reports_the_unscaled_gradient_norm(tmp_path):
    """Lightning allows 16-mixed on a CPU only through an explicit plugin; its GradScaler multiplies the loss by
    65,536. The logged norm must be the true one (within fp16 rounding of 32-true's) and the clip must act on
    unscaled gradients: clipping first gave norms 65,536 times too large and updates that much too small, so the
    later steps' norms would drift apart too."""
    reference, _ = grad_norms(tmp_path / "fp32")
    scaled, skipped = grad_norms(tmp_path / "fp16", plugins=[MixedPrecision("16-mixed", "cpu")])
    assert all(n == 0.0 for n in skipped)
    for got, want in zip(scaled, reference):
        assert math.isfinite(got)
        assert abs(got - want) <= 0.02 * want, (scaled, reference)


def test_16_bit_weights_are_refused_before_the_model_loads(monkeypatch):
    def no_loading(*args, **kwargs):
        raise AssertionError("the model was loaded")

    monkeypatch.setattr("lit_grpo.training.module.load_model_and_tokenizer", no_loading)
    for dtype in ("bfloat16", "float16"):
        with pytest.raises(ValueError, match=f"dtype '{dtype}'.*bf16-mixed"):
            GRPOModule(model_name="tiny-random-llama", dtype=dtype, optimizer=OptimizerArgs(lr=5e-6))


@pytest.mark.parametrize("precision, fix", [("bf16-true", "bf16-mixed"), ("16-true", "16-mixed")])
def test_16_bit_trainer_precision_is_refused_before_training(tmp_path, precision, fix):
    module = tiny_module()
    before = [p.detach().clone() for p in module.policy.parameters()]
    trainer = tiny_trainer(tmp_path, max_steps=1, precision=precision, callbacks=[WeightSync()])
    with pytest.raises(ValueError, match=f"precision '{precision}'.*use precision {fix}"):
        trainer.fit(module, datamodule=tiny_data())
    assert all(torch.equal(a, b.to(a.dtype)) for a, b in zip(before, module.policy.parameters()))


def test_logprob_gap_by_hand():
    a = torch.tensor([[-1.0, -2.0, -3.0], [-0.5, -0.25, 0.0]])
    b = torch.tensor([[-1.5, -2.0, -1.0], [-0.5, -1.25, -9.0]])
    mask = torch.tensor([[1, 1, 1], [1, 1, 0]])
    gap = logprob_gap(a, b, mask)
    # |diffs| on the masked tokens: 0.5, 0, 2, 0, 1 -> sum 3.5 over 5 tokens
    assert float(gap.sum) == 3.5 and float(gap.count) == 5.0
    with pytest.raises(ValueError, match="same shape"):
        logprob_gap(a, b[:, :2], mask)


def test_mismatch_metric_is_logged_at_synced_steps_only(tmp_path):
    """With the engine scoring itself (no reuse of pi_k), alpha and pi_k come from two forwards of equal
    weights: the gap is float noise at synced steps, and it is not logged at lagging ones."""
    recorder = MetricsRecorder()
    trainer = tiny_trainer(tmp_path, max_steps=3, callbacks=[WeightSync(every_n_batches=2), recorder])
    trainer.fit(tiny_module(), datamodule=tiny_data(reuse_policy_logprobs=False))
    synced = [s for s in recorder.steps if s["train/staleness"] == 0]
    assert len(synced) == 2
    for step in synced:
        assert 0.0 <= step["train/logp_gap_synced"] < 1e-5
    lagging = recorder.steps[1]
    assert lagging["train/staleness"] == 1
    # Lightning keeps the last logged value in callback_metrics: it must be the synced step's, not a new one
    assert lagging["train/logp_gap_synced"] == recorder.steps[0]["train/logp_gap_synced"]


@pytest.mark.parametrize("engine, options", [("vllm", {}), ("server", {"kind": "vllm"})])
def test_vllm_with_nucleus_sampling_is_refused(engine, options):
    with pytest.raises(ValueError, match="top_p 0.9 < 1 with vLLM"):
        tiny_data(engine=engine, engine_options=options, top_p=0.9)
