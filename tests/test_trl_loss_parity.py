"""Our losses against TRL's own ``GRPOTrainer._compute_loss`` on identical inputs (float64, clipping active,
non-zero loss and gradient): ``grpo`` under three aggregations (TRL's ``grpo``, ``dapo``, ``dr_grpo``), ``gspo``
(TRL's ``importance_sampling_level="sequence"``) and ``cispo`` (TRL's ``loss_type="cispo"``), with and without
the KL term; ``sapo``, ``luspo``, ``vespo`` (with and without a token TIS ratio), ``delta``, the bias-corrected
KL (``use_bias_correction_kl``) and ``top_entropy_quantile`` (``get_high_entropy_mask``) with every loss TRL has;
``gmpo`` against TRL's experimental ``GMPOTrainer._compute_loss``.

``_compute_loss`` is private: it is called unbound, on a stand-in for the trainer that holds the attributes it
reads, with the model's forward replaced by prepared log-probs. It was read for TRL 1.16, and the dev extra pins
the series (pyproject.toml). The file runs on whatever TRL is installed: one whose compared attributes moved FAILS
(:func:`test_trl_has_what_this_file_compares` names what is missing), rather than skipping.
"""

from __future__ import annotations

import dataclasses
import math
import os
import re
from collections import defaultdict
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from lit_grpo.math import high_entropy_mask, token_weights
from lit_grpo.training.losses import build_loss

trl = pytest.importorskip("trl", reason="TRL is a dev extra (pip install -e '.[dev]')")
from packaging.specifiers import SpecifierSet  # noqa: E402  (after the skip: TRL brings packaging)
from trl import GRPOConfig  # noqa: E402
from trl.trainer.grpo_trainer import GRPOTrainer  # noqa: E402

PYPROJECT = Path(__file__).resolve().parents[1] / "pyproject.toml"
# GRPOConfig fields whose meaning this file compares; GRPOTrainer methods it calls
COMPARED_FIELDS = ("epsilon", "epsilon_high", "delta", "beta", "loss_type", "importance_sampling_level",
                   "use_bias_correction_kl", "sapo_temperature_pos", "sapo_temperature_neg", "vespo_k_pos",
                   "vespo_lambda_pos", "vespo_k_neg", "vespo_lambda_neg", "top_entropy_quantile")
COMPARED_METHODS = ("_compute_loss", "get_gamma_weights", "get_high_entropy_mask")

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
    # per-token entropies in float32, as a model's (TRL ranks them in float32); padding holds large garbage
    entropy = torch.where(mask.bool(), 3.0 * torch.rand(S, T, generator=gen), torch.tensor(50.0))
    return dict(pi=pi, alpha=alpha, ref=ref, advantages=advantages, mask=mask, entropy=entropy)


def trl_loss(data: dict, loss_type: str, level: str, beta: float, eps_low: float, eps_high: float, *,
             args: dict | None = None, top_entropy_quantile: float = 1.0, is_ratio: torch.Tensor | None = None,
             trainer_class: type = GRPOTrainer):
    """TRL's ``_compute_loss`` on ``data``: (loss, d loss / d log pi, the metrics it logged). ``args`` are
    ``GRPOConfig`` fields it reads from ``self.args`` (their TRL defaults otherwise); ``is_ratio`` is the batch's
    token-level vLLM importance-sampling ratio (TRL's TIS, then on)."""
    logp = data["pi"].clone().requires_grad_(True)

    def per_token_logps_and_entropies(model, input_ids, attention_mask, logits_to_keep, **kwargs):
        assert logits_to_keep == T  # the completion's width, as TRL's model call would score
        return logp, data["entropy"], None

    config_defaults = {f.name: f.default for f in dataclasses.fields(GRPOConfig) if f.name in COMPARED_FIELDS}
    trainer_args = SimpleNamespace(**{**config_defaults, "use_bias_correction_kl": False, "delta": None,
                                      "steps_per_generation": 1, **(args or {})})
    accelerator = SimpleNamespace(num_processes=1, sync_gradients=True, reduce=lambda t, reduction: t,
                                  gather=lambda t: t, gather_for_metrics=lambda t: t,
                                  pad_across_processes=lambda t, dim, pad_index: t)
    trainer = SimpleNamespace(
        _get_per_token_logps_and_entropies=per_token_logps_and_entropies, aux_loss_enabled=False,
        top_entropy_quantile=top_entropy_quantile, off_policy_mask_threshold=None, importance_sampling_level=level,
        beta=beta, args=trainer_args, loss_type=loss_type, epsilon_low=eps_low, epsilon_high=eps_high,
        use_vllm=is_ratio is not None, vllm_importance_sampling_correction=is_ratio is not None,
        model=SimpleNamespace(training=True), current_gradient_accumulation_steps=1,
        max_completion_length=MAX_COMPLETION_LENGTH, accelerator=accelerator, _entropy_bonus_enabled=False,
        _metrics={"train": defaultdict(list), "eval": defaultdict(list)},
        get_gamma_weights=GRPOTrainer.get_gamma_weights)
    trainer.get_high_entropy_mask = lambda *a: GRPOTrainer.get_high_entropy_mask(trainer, *a)
    mask = data["mask"]
    batch = {
        "prompt_ids": torch.zeros(S, 2, dtype=torch.long), "prompt_mask": torch.ones(S, 2, dtype=torch.long),
        "completion_ids": torch.zeros(S, T, dtype=torch.long), "completion_mask": mask,
        "advantages": data["advantages"], "old_per_token_logps": data["alpha"],
        "ref_per_token_logps": data["ref"], "num_items_in_batch": mask.sum().to(torch.float64),
    }
    if is_ratio is not None:
        batch["importance_sampling_ratio"] = is_ratio
    loss = trainer_class._compute_loss(trainer, None, batch)
    loss.backward()
    return loss.detach(), logp.grad, trainer._metrics["train"]


def exact_weights(mask: torch.Tensor, aggregation: str) -> torch.Tensor:
    """The aggregations' weights in float64, written out: a token's share of the loss in TRL's normalisations."""
    m = mask.to(torch.float64)
    if aggregation == "seq_mean_token_mean":  # TRL's grpo: mean over tokens, then over sequences
        return m / m.sum(-1, keepdim=True) / m.shape[0]
    if aggregation == "token_mean":  # TRL's dapo: over the batch's tokens
        return m / m.sum()
    if aggregation == "seq_mean_token_sum":  # TRL's luspo: summed over a sequence's tokens, then mean over sequences
        return m / m.shape[0]
    return m / (m.shape[0] * MAX_COMPLETION_LENGTH)  # TRL's dr_grpo


def our_loss(data: dict, name: str, options: dict, aggregation: str, beta: float, weight_kind: str,
             kl_bias_correction: bool = False, correction: torch.Tensor | None = None,
             policy_mask: torch.Tensor | None = None):
    """Our loss ``name`` through the registry, with the aggregation's weights (the project's float32 ones, or
    float64 ones written out), the sampler correction's weight and the top-entropy mask: (loss, gradient, stats)."""
    loss_fn = build_loss(name, {name: options}, beta, kl_bias_correction)
    logp = data["pi"].clone().requires_grad_(True)
    mask = data["mask"]
    weights = token_weights(mask, aggregation, MAX_COMPLETION_LENGTH)
    assert torch.allclose(weights.double(), exact_weights(mask, aggregation), rtol=1e-7, atol=0)
    if weight_kind == "float64 weights":
        weights = exact_weights(mask, aggregation)
    loss, stats = loss_fn.fn(logp=logp, alpha_logp=data["alpha"], advantages=data["advantages"], weights=weights,
                             mask=mask, config=loss_fn.config, pik_logp=data["alpha"], ref_logp=data["ref"],
                             correction=correction, policy_mask=policy_mask)
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


# ------------------------------------------------------------------------------------------------------------
# TRL's newer losses and options


def test_trl_has_what_this_file_compares():
    """Fails, naming them, when the installed TRL lacks a field or method compared here (or lies outside the dev
    extra's pin): the comparisons below would be against something else."""
    fields = {f.name for f in dataclasses.fields(GRPOConfig)}
    missing = [name for name in COMPARED_FIELDS if name not in fields]
    missing += [f"GRPOTrainer.{name}" for name in COMPARED_METHODS if not hasattr(GRPOTrainer, name)]
    assert not missing, f"TRL {trl.__version__} has no {missing}: re-read its GRPOTrainer._compute_loss"
    pin = re.search(r'"trl([^"]*)"', PYPROJECT.read_text()).group(1)
    assert trl.__version__ in SpecifierSet(pin), (f"TRL {trl.__version__} is outside the dev extra's trl{pin} "
                                                  "(pyproject.toml) that this file was checked against")
    defaults = {f.name: f.default for f in dataclasses.fields(GRPOConfig)}
    assert (defaults["sapo_temperature_pos"], defaults["sapo_temperature_neg"]) == (1.0, 1.05)
    assert tuple(defaults[f"vespo_{key}"] for key in ("k_pos", "lambda_pos", "k_neg", "lambda_neg")) == (2, 3, 3, 2)


def tis_ratio(data: dict) -> torch.Tensor:
    """A token-level truncated IS ratio alpha / mu (TRL's ``vllm_importance_sampling_mode="token_truncate"``,
    capped at 1.5), 1 on padding as TRL's is."""
    gen = torch.Generator().manual_seed(13)
    mu = data["alpha"] + 0.3 * torch.randn(S, T, generator=gen, dtype=torch.float64)
    return torch.where(data["mask"].bool(), torch.exp(data["alpha"] - mu).clamp(max=1.5), 1.0)


# name: TRL side (loss_type, importance_sampling_level, epsilon, epsilon_high, GRPOConfig fields), our side
# (loss, options, aggregation), and what else goes in: "tis" (the token TIS ratio), "entropy" (the quantile)
NEW_CASES = {
    "sapo": (("sapo", "token", 0.2, 0.28, {"sapo_temperature_pos": 1.0, "sapo_temperature_neg": 1.25}),
             ("sapo", {"tau_pos": 1.0, "tau_neg": 1.25}, "seq_mean_token_mean"), {}),
    # TRL's defaults: its torch.where rounds 1.05 to float32 (1.0499999523), hence sapo's looser tolerance below
    "sapo_defaults": (("sapo", "token", 0.2, 0.28, {}), ("sapo", {}, "seq_mean_token_mean"), {}),
    "luspo": (("luspo", "sequence", 0.05, 0.08, {}), ("luspo", {"eps_low": 0.05, "eps_high": 0.08},
                                                      "seq_mean_token_sum"), {}),
    "luspo_delta": (("luspo", "sequence", 0.05, 0.08, {"delta": 1.1}),
                    ("luspo", {"eps_low": 0.05, "eps_high": 0.08, "delta": 1.1}, "seq_mean_token_sum"), {}),
    "delta": (("dapo", "token", 0.2, 0.28, {"delta": 1.3}),
              ("grpo", {"eps_low": 0.2, "eps_high": 0.28, "delta": 1.3}, "token_mean"), {}),
    "vespo": (("vespo", "token", 0.2, 0.28, {}), ("vespo", {}, "token_mean"), {}),
    "vespo_tis": (("vespo", "token", 0.2, 0.28, {}), ("vespo", {}, "token_mean"), {"tis": True}),
    "dapo_tis": (("dapo", "token", 0.2, 0.28, {}), ("grpo", {"eps_low": 0.2, "eps_high": 0.28}, "token_mean"),
                 {"tis": True}),
    "sapo_tis": (("sapo", "token", 0.2, 0.28, {"sapo_temperature_neg": 1.25}),
                 ("sapo", {"tau_neg": 1.25}, "seq_mean_token_mean"), {"tis": True}),
    # the top-entropy mask with every loss TRL has: it multiplies the policy term after the loss's own weighting
    # (VESPO's phi, the TIS ratio), never the KL term
    "dapo_top_entropy": (("dapo", "token", 0.2, 0.28, {}),
                         ("grpo", {"eps_low": 0.2, "eps_high": 0.28}, "token_mean"), {"entropy": 0.4}),
    "grpo_top_entropy": (("grpo", "token", 0.2, 0.28, {}),
                         ("grpo", {"eps_low": 0.2, "eps_high": 0.28}, "seq_mean_token_mean"), {"entropy": 0.4}),
    "bnpo_top_entropy": (("bnpo", "token", 0.2, 0.28, {}),
                         ("grpo", {"eps_low": 0.2, "eps_high": 0.28}, "token_mean"), {"entropy": 0.4}),
    "dr_grpo_top_entropy": (("dr_grpo", "token", 0.2, 0.28, {}),
                            ("grpo", {"eps_low": 0.2, "eps_high": 0.28}, "constant"), {"entropy": 0.4}),
    "gspo_top_entropy": (("grpo", "sequence", 0.05, 0.08, {}),
                         ("gspo", {"eps_low": 0.05, "eps_high": 0.08}, "seq_mean_token_mean"), {"entropy": 0.4}),
    "cispo_top_entropy": (("cispo", "token", 0.2, 1.2, {}), ("cispo", {"eps_high": 0.2}, "token_mean"),
                          {"entropy": 0.4}),
    "sapo_top_entropy": (("sapo", "token", 0.2, 0.28, {"sapo_temperature_neg": 1.25}),
                         ("sapo", {"tau_neg": 1.25}, "seq_mean_token_mean"), {"entropy": 0.4}),
    "luspo_top_entropy": (("luspo", "sequence", 0.05, 0.08, {}),
                          ("luspo", {"eps_low": 0.05, "eps_high": 0.08}, "seq_mean_token_sum"), {"entropy": 0.4}),
    "vespo_top_entropy": (("vespo", "token", 0.2, 0.28, {}), ("vespo", {}, "token_mean"), {"entropy": 0.4}),
    "vespo_tis_top_entropy": (("vespo", "token", 0.2, 0.28, {}), ("vespo", {}, "token_mean"),
                              {"tis": True, "entropy": 0.4}),
    "sapo_tis_top_entropy": (("sapo", "token", 0.2, 0.28, {"sapo_temperature_neg": 1.25}),
                             ("sapo", {"tau_neg": 1.25}, "seq_mean_token_mean"), {"tis": True, "entropy": 0.4}),
    "cispo": (("cispo", "token", 0.2, 1.2, {}), ("cispo", {"eps_high": 0.2}, "token_mean"), {}),
    "gspo": (("grpo", "sequence", 0.05, 0.08, {}), ("gspo", {"eps_low": 0.05, "eps_high": 0.08},
                                                    "seq_mean_token_mean"), {}),
}
NEW_TOLERANCE = {"sapo_defaults": 1e-6}  # else 1e-12 (float64 weights on both sides)


def new_case_differences(case: str, beta: float, bias: bool):
    (loss_type, level, eps_low, eps_high, args), (name, options, aggregation), extra = NEW_CASES[case]
    data = inputs()
    ratio = tis_ratio(data) if extra.get("tis") else None
    rho = extra.get("entropy", 1.0)
    trl_value, trl_grad, metrics = trl_loss(data, loss_type, level, beta, eps_low, eps_high,
                                            args={**args, "use_bias_correction_kl": bias},
                                            top_entropy_quantile=rho, is_ratio=ratio)
    correction = keep = None
    if ratio is not None:  # garbage on padding: our side must not read it
        correction = torch.where(data["mask"].bool(), ratio, 123.0)
    if rho < 1.0:  # the entropy mask, apart from the correction: it multiplies the policy term after the loss's
        keep = high_entropy_mask(data["entropy"], data["mask"], rho).double()  # weighting, as TRL's
        counted = int(data["mask"].sum())
        assert 0 < int(keep.sum()) < counted and not keep[data["mask"] == 0].any()
        # the mask drops a token of some sequence but not all of that sequence's tokens: folded into VESPO's
        # sequence weight it would zero the whole sequence, which TRL does not
        kept_per_sequence = keep.sum(-1)
        assert ((kept_per_sequence > 0) & (kept_per_sequence < data["mask"].sum(-1))).any()
    value, grad, stats = our_loss(data, name, options, aggregation, beta, "float64 weights", bias, correction, keep)
    assert abs(float(trl_value)) > 1e-3 and trl_grad.abs().max() > 1e-3, (case, trl_value)
    assert (grad[data["mask"] == 0] == 0).all()
    return float((value - trl_value).abs()), float((grad - trl_grad).abs().max()), stats, metrics


# the bias correction weighs the KL term: it has a meaning at beta > 0 only
@pytest.mark.parametrize("beta, bias", [(0.0, False), (BETA, False), (BETA, True)],
                         ids=["beta0", "kl", "bias_corrected_kl"])
@pytest.mark.parametrize("case", list(NEW_CASES))
def test_new_losses_and_options_equal_trls(case, beta, bias):
    value_diff, grad_diff, stats, metrics = new_case_differences(case, beta, bias)
    tolerance = NEW_TOLERANCE.get(case, 1e-12)
    assert value_diff <= tolerance and grad_diff <= tolerance, (case, beta, bias, value_diff, grad_diff)
    if beta > 0:  # TRL's kl metric is of the KL it adds, weighted by the ratio under the bias correction
        assert float(stats["kl_sum"]) / float(stats["tokens"]) == pytest.approx(metrics["kl"][0], rel=1e-12)


def test_delta_and_the_sequence_clip_bite_on_these_inputs():
    data = inputs()
    m, a = data["mask"].bool(), data["advantages"].unsqueeze(-1)
    r = torch.exp(data["pi"] - data["alpha"])
    assert (m & (a < 0) & (r > 1.3)).any()  # "delta": tokens the cap changes
    s = torch.exp(((data["pi"] - data["alpha"]) * m).sum(-1) / m.sum(-1))
    assert ((data["advantages"] < 0) & (s > 1.1)).any()  # "luspo_delta": a sequence the cap changes
    # "vespo": sequence weights w spread on both sides of 1
    w = torch.exp(((data["pi"] - data["alpha"]) * m).sum(-1))
    assert (w < 0.9).any() and (w > 1.1).any()


def test_gmpo_equals_trls_experimental_gmpo_trainer():
    os.environ.setdefault("TRL_EXPERIMENTAL_SILENCE", "1")
    from trl.experimental.gmpo import GMPOTrainer

    for beta in (0.0, BETA):
        data = inputs()
        trl_value, trl_grad, metrics = trl_loss(data, "grpo", "token", beta, 0.15, 0.3, trainer_class=GMPOTrainer)
        value, grad, stats = our_loss(data, "gmpo", {"eps_low": 0.15, "eps_high": 0.3}, "seq_mean_token_mean", beta,
                                      "float64 weights")
        assert abs(float(trl_value)) > 1e-3
        assert float((value - trl_value).abs()) <= 1e-12 and float((grad - trl_grad).abs().max()) <= 1e-12
        tokens = float(stats["tokens"])
        # both sides of the log-space clip bite, and the fractions are TRL's
        assert stats["clip_low"] > 0 and stats["clip_high"] > 0
        assert float(stats["clip_low"]) / tokens == pytest.approx(metrics["clip_ratio/low_mean"][0], rel=1e-6)
        assert float(stats["clip_high"]) / tokens == pytest.approx(metrics["clip_ratio/high_mean"][0], rel=1e-6)


def test_high_entropy_mask_equals_trls():
    data = inputs()
    trainer = SimpleNamespace(accelerator=SimpleNamespace(pad_across_processes=lambda t, dim, pad_index: t,
                                                          gather=lambda t: t))
    for rho in (0.0, 0.2, 0.4, 0.77, 1.0):
        theirs = GRPOTrainer.get_high_entropy_mask(trainer, data["entropy"], data["mask"], 1 - rho)
        ours = high_entropy_mask(data["entropy"], data["mask"], rho)
        assert torch.equal(ours, theirs), rho
    assert math.isfinite(float(data["entropy"][data["mask"].bool()].max()))


#: rewards of three groups of 8: a spread with ties, a zero-variance group, one outlier
PARITY_REWARDS = [0.0, 1.0, 1.0, 0.0, 0.5, 0.0, 1.0, 0.25] + [1.0] * 8 + [0.0] * 7 + [3.0]


def trl_advantages(tmp_path: Path, rewards: list[float], group: int) -> torch.Tensor:
    """The advantages TRL's own ``_generate_and_score_completions`` computes (``scale_rewards="group"``) for
    ``rewards``, given by a reward function in the completions' order (a tiny model samples the completions)."""
    from datasets import Dataset

    from lit_grpo.models.loading import load_model_and_tokenizer

    model, tokenizer = load_model_and_tokenizer("tiny-random-llama", "float32")
    model.save_pretrained(tmp_path / "policy")  # TRL's reference and its checks read the model's path
    tokenizer.save_pretrained(tmp_path / "policy")
    model.config._name_or_path = str(tmp_path / "policy")
    args = GRPOConfig(output_dir=str(tmp_path), use_cpu=True, bf16=False, fp16=False, report_to="none",
                      per_device_train_batch_size=len(rewards), num_generations=group, max_completion_length=4,
                      scale_rewards="group", beta=0.0, steps_per_generation=1, gradient_accumulation_steps=1,
                      log_completions=False)
    trainer = GRPOTrainer(model=model, reward_funcs=lambda completions, **_: rewards[: len(completions)], args=args,
                          train_dataset=Dataset.from_list([{"prompt": "ab"}]), processing_class=tokenizer)
    prompts = [{"prompt": p} for p in ("ab", "cd", "ef")[: len(rewards) // group] for _ in range(group)]
    return trainer._generate_and_score_completions(prompts)["advantages"].detach().cpu()


def test_advantages_equal_trls(tmp_path):
    """``data.advantage_std: bessel`` gives TRL's advantages (Bessel-corrected std, eps outside the square root);
    eq. 2's population std (the default) is sqrt(G / (G - 1)) larger on every group with a spread, and 0 on the
    zero-variance group alike."""
    from lit_grpo.math.advantages import group_advantages

    trl_values = trl_advantages(tmp_path, PARITY_REWARDS, 8)
    rewards = torch.tensor(PARITY_REWARDS).view(3, 8)
    bessel = group_advantages(rewards, std="bessel").view(-1)
    assert torch.allclose(bessel, trl_values, atol=1e-6, rtol=0)
    population = group_advantages(rewards).view(-1)
    spread = torch.tensor([True] * 8 + [False] * 8 + [True] * 8)
    assert torch.allclose(population[spread] / trl_values[spread], torch.full((16,), math.sqrt(8 / 7)), rtol=2e-4)
    assert not population[~spread].any() and not trl_values[~spread].any()
