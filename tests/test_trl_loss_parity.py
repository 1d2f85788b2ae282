"""Our losses against TRL's own ``GRPOTrainer._compute_loss`` on identical inputs (float64, clipping active,
non-zero loss and gradient): ``grpo`` under three aggregations (TRL's ``grpo``, ``dapo``, ``dr_grpo``), ``gspo``
(TRL's ``importance_sampling_level="sequence"``) and ``cispo`` (TRL's ``loss_type="cispo"``), with and without
the KL term.

``_compute_loss`` is private: it is called unbound, on a stand-in for the trainer that holds the attributes it
reads, with the model's forward replaced by prepared log-probs. It was read for TRL 1.16; another version is
skipped with that reason, since its attributes or formulas may have moved.
"""

from __future__ import annotations

from collections import defaultdict
from types import SimpleNamespace

import pytest
import torch

from lit_grpo.math import token_weights
from lit_grpo.training.losses import build_loss

trl = pytest.importorskip("trl", reason="TRL is a dev extra (pip install -e '.[dev]')")
from packaging.version import Version  # noqa: E402  (after the skip: TRL brings it)

TRL_SERIES = (1, 16)  # the series whose GRPOTrainer._compute_loss this file was written against
if Version(trl.__version__).release[:2] != TRL_SERIES:
    pytest.skip(f"written for TRL 1.16.x's private GRPOTrainer._compute_loss; TRL {trl.__version__} is installed",
                allow_module_level=True)
from trl.trainer.grpo_trainer import GRPOTrainer  # noqa: E402

S, T = 6, 5  # sequences x completion tokens
MAX_COMPLETION_LENGTH = 7  # Dr.GRPO's constant: larger than the batch's width, so the two cannot be confused
BETA = 0.04
# Our aggregation weights are float32 (token_weights): 1/n is rounded to ~6e-8 relative, which bounds the
# difference with the project's weights; with the same weights in float64 the two sides agree to rounding.
TOLERANCE = {"float32 weights": 1e-7, "float64 weights": 1e-12}


def inputs() -> dict[str, torch.Tensor]:
    """Log-probs of pi, alpha and pi_ref on S x T tokens (float64), right padding, advantages of both signs. The
    padded positions hold finite garbage: both sides must ignore them."""
    gen = torch.Generator().manual_seed(7)
    lengths = torch.tensor([5, 3, 4, 1, 5, 2])
    mask = (torch.arange(T) < lengths.unsqueeze(1)).long()
    alpha = -torch.rand(S, T, generator=gen, dtype=torch.float64) * 3.0 - 0.1
    # per-token ratios from ~0.6 to ~1.6: PPO's band [0.8, 1.28] clips some tokens on both sides; the per-sequence
    # offsets spread the sequence ratios around GSPO's band too
    offset = torch.tensor([0.12, -0.09, 0.02, 0.3, -0.01, -0.2], dtype=torch.float64).unsqueeze(1)
    pi = alpha + offset + 0.25 * torch.randn(S, T, generator=gen, dtype=torch.float64)
    ref = pi + 0.3 * torch.randn(S, T, generator=gen, dtype=torch.float64)
    advantages = torch.tensor([1.3, -0.7, 0.4, -1.1, -0.2, 0.9], dtype=torch.float64)
    return dict(pi=pi, alpha=alpha, ref=ref, advantages=advantages, mask=mask)


def trl_loss(data: dict, loss_type: str, level: str, beta: float, eps_low: float, eps_high: float):
    """TRL's ``_compute_loss`` on ``data``: (loss, d loss / d log pi, the metrics it logged)."""
    logp = data["pi"].clone().requires_grad_(True)

    def per_token_logps_and_entropies(model, input_ids, attention_mask, logits_to_keep, **kwargs):
        assert logits_to_keep == T  # the completion's width, as TRL's model call would score
        return logp, torch.zeros_like(logp), None

    args = SimpleNamespace(use_bias_correction_kl=False, delta=None, steps_per_generation=1)
    accelerator = SimpleNamespace(num_processes=1, sync_gradients=True, reduce=lambda t, reduction: t,
                                  gather=lambda t: t, gather_for_metrics=lambda t: t)
    trainer = SimpleNamespace(
        _get_per_token_logps_and_entropies=per_token_logps_and_entropies, aux_loss_enabled=False,
        top_entropy_quantile=1.0, off_policy_mask_threshold=None, importance_sampling_level=level, beta=beta,
        args=args, loss_type=loss_type, epsilon_low=eps_low, epsilon_high=eps_high, use_vllm=False,
        vllm_importance_sampling_correction=False, model=SimpleNamespace(training=True),
        current_gradient_accumulation_steps=1, max_completion_length=MAX_COMPLETION_LENGTH, accelerator=accelerator,
        _entropy_bonus_enabled=False, _metrics={"train": defaultdict(list), "eval": defaultdict(list)})
    mask = data["mask"]
    batch = {
        "prompt_ids": torch.zeros(S, 2, dtype=torch.long), "prompt_mask": torch.ones(S, 2, dtype=torch.long),
        "completion_ids": torch.zeros(S, T, dtype=torch.long), "completion_mask": mask,
        "advantages": data["advantages"], "old_per_token_logps": data["alpha"],
        "ref_per_token_logps": data["ref"], "num_items_in_batch": mask.sum().to(torch.float64),
    }
    loss = GRPOTrainer._compute_loss(trainer, None, batch)
    loss.backward()
    return loss.detach(), logp.grad, trainer._metrics["train"]


def exact_weights(mask: torch.Tensor, aggregation: str) -> torch.Tensor:
    """The aggregations' weights in float64, written out: a token's share of the loss in TRL's normalisations."""
    m = mask.to(torch.float64)
    if aggregation == "seq_mean_token_mean":  # TRL's grpo: mean over tokens, then over sequences
        return m / m.sum(-1, keepdim=True) / m.shape[0]
    if aggregation == "token_mean":  # TRL's dapo: over the batch's tokens
        return m / m.sum()
    return m / (m.shape[0] * MAX_COMPLETION_LENGTH)  # TRL's dr_grpo


def our_loss(data: dict, name: str, options: dict, aggregation: str, beta: float, weight_kind: str):
    """Our loss ``name`` through the registry, with the aggregation's weights (the project's float32 ones, or
    float64 ones written out): (loss, gradient, stats)."""
    loss_fn = build_loss(name, {name: options}, beta)
    logp = data["pi"].clone().requires_grad_(True)
    mask = data["mask"]
    weights = token_weights(mask, aggregation, MAX_COMPLETION_LENGTH)
    assert torch.allclose(weights.double(), exact_weights(mask, aggregation), rtol=1e-7, atol=0)
    if weight_kind == "float64 weights":
        weights = exact_weights(mask, aggregation)
    loss, stats = loss_fn.fn(logp=logp, alpha_logp=data["alpha"], advantages=data["advantages"], weights=weights,
                             mask=mask, config=loss_fn.config, pik_logp=data["alpha"], ref_logp=data["ref"])
    loss.backward()
    return loss.detach(), logp.grad, stats


# name: (TRL loss_type, TRL importance_sampling_level, TRL epsilon, epsilon_high, our loss, its options, aggregation)
CASES = {
    "grpo": ("grpo", "token", 0.2, 0.28, "grpo", {"eps_low": 0.2, "eps_high": 0.28}, "seq_mean_token_mean"),
    "dapo": ("dapo", "token", 0.2, 0.28, "grpo", {"eps_low": 0.2, "eps_high": 0.28}, "token_mean"),
    "dr_grpo": ("dr_grpo", "token", 0.2, 0.28, "grpo", {"eps_low": 0.2, "eps_high": 0.28}, "constant"),
    # GSPO as its paper (and TRL's docs) run it: TRL's "grpo" loss_type, one weight 1/G per sequence
    "gspo": ("grpo", "sequence", 0.05, 0.08, "gspo", {"eps_low": 0.05, "eps_high": 0.08}, "seq_mean_token_mean"),
    # TRL's "dapo" with sequence ratios weighs each sequence by its length: our gspo under token_mean
    "gspo_token_mean": ("dapo", "sequence", 0.05, 0.08, "gspo", {"eps_low": 0.05, "eps_high": 0.08}, "token_mean"),
    # TRL's epsilon_high for CISPO is the weight's edge itself (1.2); ours is its half-width (0.2)
    "cispo": ("cispo", "token", 0.2, 1.2, "cispo", {"eps_high": 0.2}, "token_mean"),
}


def max_differences(case: str, beta: float, weight_kind: str) -> tuple[float, float, dict, dict]:
    loss_type, level, eps_low, eps_high, name, options, aggregation = CASES[case]
    data = inputs()
    trl_value, trl_grad, metrics = trl_loss(data, loss_type, level, beta, eps_low, eps_high)
    value, grad, stats = our_loss(data, name, options, aggregation, beta, weight_kind)
    # the comparison means something only where both sides are non-zero and the clip bites
    assert abs(float(trl_value)) > 1e-3 and trl_grad.abs().max() > 1e-3, (case, trl_value)
    assert (trl_grad[data["mask"] == 0] == 0).all() and (grad[data["mask"] == 0] == 0).all()
    return float((value - trl_value).abs()), float((grad - trl_grad).abs().max()), stats, metrics


@pytest.mark.parametrize("weight_kind", list(TOLERANCE))
@pytest.mark.parametrize("beta", [0.0, BETA], ids=["beta0", "kl"])
@pytest.mark.parametrize("case", list(CASES))
def test_loss_and_gradient_equal_trls(case, beta, weight_kind):
    value_diff, grad_diff, stats, metrics = max_differences(case, beta, weight_kind)
    tolerance = TOLERANCE[weight_kind]
    assert value_diff <= tolerance and grad_diff <= tolerance, (case, beta, value_diff, grad_diff)
    tokens = float(stats["tokens"])
    clipped = float(stats["clip_low"] + stats["clip_high"])
    assert 0 < clipped < tokens, (case, stats)  # clipping is active on some tokens, not on all
    if CASES[case][1] == "token" and case != "cispo":
        # the clip fractions are TRL's too, token by token (TRL counts GSPO's per sequence, CISPO's on A > 0 only;
        # its fractions are float32)
        assert float(stats["clip_low"]) / tokens == pytest.approx(metrics["clip_ratio/low_mean"][0], rel=1e-6)
        assert float(stats["clip_high"]) / tokens == pytest.approx(metrics["clip_ratio/high_mean"][0], rel=1e-6)
    if beta > 0:
        assert float(stats["kl_sum"]) / tokens == pytest.approx(metrics["kl"][0], rel=1e-12)


def test_gspo_clips_some_sequences_and_not_others():
    # the sequence ratios of the inputs straddle GSPO's band, so the comparison covers both branches of the min
    data = inputs()
    m = data["mask"].to(torch.float64)
    s = torch.exp(((data["pi"] - data["alpha"]) * m).sum(-1) / m.sum(-1))
    a = data["advantages"]
    clipped = ((a > 0) & (s > 1.08)) | ((a < 0) & (s < 0.95))
    assert clipped.any() and not clipped.all(), s
