"""The sampler correction, the entropy terms, the bias-corrected KL and ``mask_truncated_completions`` inside
``GRPOModule``: what reaches the loss, what is logged, what is refused, and the on-policy invariant."""

from __future__ import annotations

import pytest
import torch
from conftest import MetricsRecorder, tiny_data, tiny_module, tiny_trainer
from handmade import handmade_batch
from lightning.pytorch.callbacks import Callback
from lit_grpo.callbacks import WeightSync

from lit_grpo.math.corrections import CORRECTION_MODES, CorrectionOptions
from lit_grpo.math.entropy_terms import EntropyOptions

MODES = [m for m in CORRECTION_MODES if m != "none"]


def fit_parameters(tmp_path, recorder=None, steps: int = 2, data_overrides: dict | None = None, **module_overrides):
    torch.manual_seed(0)
    module = tiny_module(**module_overrides)
    callbacks = [WeightSync(every_n_batches=1)] + ([recorder] if recorder is not None else [])
    trainer = tiny_trainer(tmp_path, max_steps=steps, callbacks=callbacks)
    trainer.fit(module, datamodule=tiny_data(**(data_overrides or {})))
    return {name: p.detach().clone() for name, p in module.policy.named_parameters()}


class GradientRecorder(Callback):
    """Each optimizer step's gradients, before the step (after clipping)."""

    def __init__(self) -> None:
        self.steps: list[dict[str, torch.Tensor]] = []

    def on_before_optimizer_step(self, trainer, pl_module, optimizer) -> None:
        self.steps.append({n: p.grad.detach().clone() for n, p in pl_module.policy.named_parameters()
                           if p.grad is not None})


def fit_gradients(tmp_path, steps: int = 2, **module_overrides) -> list[dict[str, torch.Tensor]]:
    grads = GradientRecorder()
    fit_parameters(tmp_path, grads, steps=steps, **module_overrides)
    return grads.steps


@pytest.mark.parametrize("old_policy", ["proximal", "decoupled"])
def test_every_correction_leaves_an_exactly_on_policy_step_as_it_was(tmp_path, old_policy):
    """v = 1, i = 1, fp32, the in-process engine: pi_old = pi_k = alpha, and mu is the same function of the same
    weights (the engine's own pass while sampling, ~1e-6 apart from the trainer's by the KV cache's rounding), so
    every mode's weight is 1 to rounding and every optimizer step gets the gradient it gets without a correction.
    (Gradients, not parameters: AdamW's first step is ``lr * sign(g)`` where g ~ 0, so it would magnify rounding
    in components with no signal.)"""
    reference = fit_gradients(tmp_path / "none")
    scale = max(float(g.abs().max()) for step in reference for g in step.values())
    assert scale > 1e-3  # the steps had a signal to compare
    for mode in MODES:
        grads = fit_gradients(tmp_path / mode, correction=CorrectionOptions(mode=mode, old_policy=old_policy))
        assert len(grads) == len(reference) == 2
        worst = max(float((g[k] - r[k]).abs().max()) for g, r in zip(grads, reference) for k in r)
        assert worst <= 1e-5 * scale, (mode, old_policy, worst, scale)


def test_correction_and_mismatch_metrics_are_logged(tmp_path, recorder):
    fit_parameters(tmp_path, recorder, correction=CorrectionOptions(mode="token_truncate", high=3.0))
    step = recorder.steps[-1]
    for key in ("correction/masked_fraction", "correction/truncated_fraction", "correction/weight_mean",
                "mismatch/abs_mean", "mismatch/abs_max", "mismatch/k3_kl"):
        assert key in step, key
    # on-policy in fp32: the sampler's and the trainer's log-probs agree to rounding
    assert step["mismatch/abs_max"] < 1e-4
    assert step["correction/weight_mean"] == pytest.approx(1.0, abs=1e-5)
    assert step["correction/masked_fraction"] == 0.0


def test_a_lagging_sampler_is_masked_and_its_mismatch_measured(tmp_path, recorder):
    """v = 4 at a high learning rate: pi_k drifts from mu, so a tight sequence mask drops sequences and the
    mismatch statistics grow with the lag."""
    module = tiny_module(lr=5e-2, correction=CorrectionOptions(mode="geometric_mask", low=0.999, high=1.001,
                                                                old_policy="proximal"))
    trainer = tiny_trainer(tmp_path, max_steps=4, callbacks=[WeightSync(every_n_batches=4), recorder])
    trainer.fit(module, datamodule=tiny_data())
    stale = [s for s in recorder.steps if s["train/staleness"] > 0]
    assert stale and max(s["correction/masked_fraction"] for s in stale) > 0.0
    assert max(s["mismatch/abs_mean"] for s in stale) > 1e-4


def plain_loss_without_correction(logp, alpha_logp, advantages, weights, mask, config, pik_logp, ref_logp):
    """A user's loss written before the ``correction`` keyword existed."""
    from lit_grpo.math.objective import grpo_loss

    return grpo_loss(logp, alpha_logp, advantages, weights, mask, config, pik_logp, ref_logp)


def test_a_loss_without_the_correction_keyword_is_refused_in_one_line():
    with pytest.raises(ValueError, match="correction") as info:
        tiny_module(loss="test_correction_module:plain_loss_without_correction",
                    correction=CorrectionOptions(mode="token_mask"))
    assert "\n" not in str(info.value)


def test_bad_correction_values_are_refused_before_a_model_loads():
    with pytest.raises(ValueError, match="mode"):
        tiny_module(correction={"mode": "token_clip"})
    with pytest.raises(ValueError, match="old_policy"):
        tiny_module(correction={"mode": "token_mask", "old_policy": "behaviour"})


def test_luspo_needs_its_length_scaled_aggregation():
    with pytest.raises(ValueError, match="seq_mean_token_sum") as info:
        tiny_module(loss="luspo")
    assert "\n" not in str(info.value)
    assert tiny_module(loss="luspo", loss_aggregation="seq_mean_token_sum").policy_loss.name == "luspo"


def test_mask_truncated_completions_removes_them_from_the_loss_and_its_denominator():
    module = tiny_module(mask_truncated_completions=True)
    batch = handmade_batch([[1.0, 0.0, 0.0, 1.0], [0.0, 1.0, 1.0, 0.0]], len(module.tokenizer))
    truncated = torch.tensor([True, False, False, False, False, True, False, False])
    batch = type(batch)(**{**batch.__dict__, "truncated": truncated})
    weights = module.loss_weights(batch)
    kept = batch.completion_mask.float() * (~truncated).float().unsqueeze(-1)
    assert torch.equal(weights[truncated], torch.zeros_like(weights[truncated]))
    assert torch.allclose(weights, kept / kept.sum())  # token_mean over the kept tokens only
    plain = tiny_module().loss_weights(batch)
    assert (plain[truncated] > 0).any()


def test_entropy_bonus_lowers_the_loss_by_coef_times_the_mean_entropy(tmp_path, recorder):
    fit_parameters(tmp_path / "plain", recorder, steps=1)
    plain = recorder.steps[-1]
    recorder.steps.clear()
    fit_parameters(tmp_path / "bonus", recorder, steps=1, entropy=EntropyOptions(coef=0.5))
    bonus = recorder.steps[-1]
    # the same batch (same seed, first step), so the difference is the bonus: 0.5 x the mean entropy
    assert bonus["train/entropy_bonus_entropy"] == pytest.approx(plain["train/entropy"], rel=1e-5)
    assert plain["train/loss"] - bonus["train/loss"] == pytest.approx(0.5 * plain["train/entropy"], rel=1e-4)
    assert bonus["train/entropy_coef"] == 0.5


def test_adaptive_entropy_coefficient_moves_and_survives_a_checkpoint(tmp_path, recorder):
    options = EntropyOptions(coef=0.01, adaptive=True, target=100.0, coef_delta=0.01, coef_max=1.0)
    module = tiny_module(entropy=options)
    trainer = tiny_trainer(tmp_path, max_steps=3, callbacks=[WeightSync(every_n_batches=1), recorder])
    trainer.fit(module, datamodule=tiny_data())
    # the tiny model's entropy is far below a target of 100 nats: the coefficient rises by coef_delta per step
    assert module.entropy_coef == pytest.approx(0.04)
    checkpoint: dict = {}
    module.on_save_checkpoint(checkpoint)
    fresh = tiny_module(entropy=options)
    fresh.on_load_checkpoint(checkpoint)
    assert fresh.entropy_coef == pytest.approx(0.04) and fresh._last_entropy == module._last_entropy


def test_top_entropy_quantile_leaves_the_low_entropy_tokens_out(tmp_path, recorder):
    fit_parameters(tmp_path, recorder, steps=1, entropy=EntropyOptions(top_entropy_quantile=0.2))
    fraction = recorder.steps[-1]["train/entropy_masked_fraction"]
    assert 0.6 <= fraction <= 0.85, fraction  # about 80 % of the tokens are below the 0.8 quantile


def test_kl_bias_correction_reaches_the_loss_config():
    module = tiny_module(beta=0.1, kl_bias_correction=True)
    assert module.loss_config.kl_bias_correction is True and module.loss_config.beta == 0.1


def test_decoupled_refuses_an_engine_that_never_rescores_in_one_line(tmp_path):
    module = tiny_module(correction=CorrectionOptions(mode="token_truncate", old_policy="decoupled"))
    data = tiny_data(engine_options={"rescore": False})
    trainer = tiny_trainer(tmp_path, max_steps=1, callbacks=[WeightSync(every_n_batches=1)])
    with pytest.raises(ValueError, match="decoupled.*keep_pushed_weights") as info:
        trainer.fit(module, datamodule=data)
    assert "\n" not in str(info.value)


def test_corrections_and_entropy_terms_train_under_bf16_mixed(tmp_path, recorder):
    """bf16-mixed: the in-process engine samples in the trainer's autocast, so mu and pi_k differ by bf16's
    rounding (the cached decode against the full forward); the weights, masks and bonus stay finite and act."""
    band = CorrectionOptions(mode="token_mask", low=0.99999, high=1.00001, old_policy="proximal")
    module = tiny_module(correction=band,
                         entropy=EntropyOptions(coef=0.01, top_entropy_quantile=0.5))
    trainer = tiny_trainer(tmp_path, max_steps=2, precision="bf16-mixed",
                           callbacks=[WeightSync(every_n_batches=1), recorder])
    trainer.fit(module, datamodule=tiny_data())
    # the same fit in fp32, whose sampler and trainer agree to float32 rounding
    fp32 = MetricsRecorder()
    tiny_trainer(tmp_path / "fp32", max_steps=2, callbacks=[WeightSync(every_n_batches=1), fp32]).fit(
        tiny_module(correction=band, entropy=EntropyOptions(coef=0.01, top_entropy_quantile=0.5)),
        datamodule=tiny_data())
    for step, exact in zip(recorder.steps, fp32.steps, strict=True):
        assert all(torch.isfinite(torch.tensor(step[k])) for k in ("train/loss", "train/grad_norm", "mismatch/k3_kl"))
        assert step["mismatch/abs_max"] > 10 * exact["mismatch/abs_max"]  # bf16's gap, which fp32 does not have
        assert 0.0 < step["correction/masked_fraction"] < 0.5  # the tight band drops the tokens of that gap
        assert 0.4 <= step["train/entropy_masked_fraction"] <= 0.6


def test_the_module_hands_the_correction_weight_to_the_loss():
    """One micro-batch step's gradient is the loss's with the weight computed independently here, and not the
    uncorrected one: the module passes the weight through, with pi_k as the denominator (proximal)."""
    from lit_grpo.core.scoring import completion_logprobs
    from lit_grpo.math.objective import grpo_loss

    module = tiny_module(correction=CorrectionOptions(mode="token_truncate", low=0.9, high=1.1, old_policy="proximal"))
    batch, mb, pik, mu, _ = sampled_micro_batch(module)
    weights = module.loss_weights(batch)

    def gradients(correction):
        module.policy.zero_grad(set_to_none=True)
        if correction == "module":
            module.micro_batch_step(batch, mb, weights, None, None, 0)
        else:
            logp, _ = completion_logprobs(module.policy, mb, 1.0)
            loss, _ = grpo_loss(logp, pik, mb.take(batch.advantages), mb.take(weights), mb.completion_mask,
                                module.loss_config, pik_logp=pik, correction=correction)
            loss.backward()
        return torch.cat([p.grad.flatten() for p in module.policy.parameters() if p.grad is not None])

    expected = gradients(torch.exp(pik - mu).clamp(0.9, 1.1))  # TIS's weight, written out
    got = gradients("module")
    assert torch.allclose(got, expected, rtol=1e-5, atol=1e-9)
    assert not torch.allclose(got, gradients(None), rtol=1e-3, atol=1e-7)


def sampled_micro_batch(module, noise: float = 0.2):
    """A handmade batch in one micro-batch whose sampler log-probs mu are pi_k's plus noise, and pi_k itself."""
    from dataclasses import replace

    from lit_grpo.core.scoring import completion_logprobs

    module.manual_backward = lambda loss: loss.backward()  # no trainer: a plain backward
    batch = handmade_batch([[1.0, 0.0, 0.0, 1.0], [0.0, 1.0, 1.0, 0.0]], len(module.tokenizer), micro_batch_size=8)
    (mb,) = list(batch.micro_batches())
    with torch.no_grad():
        pik, entropy = completion_logprobs(module.policy, mb, 1.0, with_entropy=True)
    mu = pik + noise * torch.randn(pik.shape, generator=torch.Generator().manual_seed(3))
    return replace(batch, sampler_logp=mu), mb, pik, mu, entropy


def test_vespo_keeps_the_entropy_mask_out_of_its_sequence_weight():
    """TRL's order: the sampler's TIS ratio enters VESPO's sequence weight w, and the top-entropy mask multiplies
    the per-token term after phi(w). Folded into w, one masked token would send its whole sequence's phi to ~0."""
    from lit_grpo.core.scoring import completion_logprobs
    from lit_grpo.math.entropy_terms import high_entropy_mask
    from lit_grpo.math.vespo import gamma_weight, sequence_log_weight

    module = tiny_module(loss="vespo", correction=CorrectionOptions(mode="token_truncate", low=0.5, high=2.0,
                                                                    old_policy="proximal"),
                         entropy=EntropyOptions(top_entropy_quantile=0.5))
    batch, mb, pik, mu, entropy = sampled_micro_batch(module)
    weights = module.loss_weights(batch)
    mask, adv = mb.loss_mask, mb.take(batch.advantages).unsqueeze(-1)
    tis = torch.exp(pik - mu).clamp(0.5, 2.0)  # the correction's weight, written out
    keep = high_entropy_mask(entropy, mask, 0.5).to(pik.dtype)
    assert 0 < keep.sum() < mask.sum()

    def gradients(how):
        module.policy.zero_grad(set_to_none=True)
        if how == "module":
            module.micro_batch_step(batch, mb, weights, None, None, 0)
        else:
            logp, _ = completion_logprobs(module.policy, mb, 1.0)
            folded = tis * keep if how == "folded" else tis
            phi = gamma_weight(sequence_log_weight(logp, pik, mask, folded), adv, module.loss_config)
            term = -(phi * adv) * logp * (keep if how == "trl" else 1.0)
            (term * mb.take(weights)).sum().backward()
        return torch.cat([p.grad.flatten() for p in module.policy.parameters() if p.grad is not None])

    got = gradients("module")
    assert torch.allclose(got, gradients("trl"), rtol=1e-5, atol=1e-9)
    assert not torch.allclose(got, gradients("folded"), rtol=1e-3, atol=1e-7)


@pytest.mark.parametrize("quantile", [1.0, 0.5])
def test_the_entropy_bonus_counts_the_tokens_the_correction_masked(quantile):
    """The bonus and its adaptive control act on the top-entropy tokens (all counted tokens at quantile 1), as
    TRL's ``effective_mask``: the tokens the sampler correction masks still count."""
    from lit_grpo.math.entropy_terms import high_entropy_mask

    module = tiny_module(correction=CorrectionOptions(mode="token_mask", low=0.9, high=1.1, old_policy="proximal"),
                         entropy=EntropyOptions(coef=0.1, top_entropy_quantile=quantile))
    batch, mb, pik, mu, entropy = sampled_micro_batch(module)
    stats, _ = module.micro_batch_step(batch, mb, module.loss_weights(batch), None, None, 0)
    assert stats["correction_masked"] > 0  # the band drops tokens
    keep = high_entropy_mask(entropy, mb.loss_mask, quantile)
    assert int(stats["entropy_bonus_tokens"]) == int(keep.sum())
    expected = torch.where(keep, entropy.double(), 0.0).sum()
    assert float(stats["entropy_bonus_sum"]) == pytest.approx(float(expected), rel=1e-5)
