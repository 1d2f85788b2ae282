"""The metrics of one training step: what ``GRPOModule`` logs after each rollout batch (no Lightning).

The step keeps its statistics on the device while it runs (0-d float64 tensors: sums, counts and extrema, merged
over micro-batches by :func:`lit_grpo.training.stat_reduction.merge_stats`). At its end :func:`step_statistics` names
one
rank's statistics for the reduction over ranks (``lit_grpo.training.stat_reduction.reduce_stats``, one host transfer),
and
:func:`step_metrics` turns the reduced numbers into the logged metrics, so that they mean what they mean in one
process. How every statistic merges, on every axis, is the one rule of :mod:`lit_grpo.training.stat_reduction`.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import torch

from lit_grpo.math.tv import logprob_gap, tv_estimate
from lit_grpo.training.flops import model_flops_utilisation, update_flops
from lit_grpo.training.stat_reduction import ROLLOUT_PREFIX, iteration_key, over_iterations

#: step metrics that only some steps measure: ``train/logp_gap_synced``, at the steps whose batch was sampled by the
#: policy's current weights (staleness 0). ``GRPOModule`` logs them with
# ``lit_grpo.core.measured_metrics.log_measured``,
#: so that the loggers get them at those steps only, never a stale value at the others.
MEASURED_AT_SOME_STEPS = ("train/logp_gap_synced",
                          # the first-push check (lit_grpo.data.sampler_check): the first batch of pushed weights only
                          "rollout/sampler_check_gap", "rollout/sampler_check_seconds")


@dataclass(frozen=True)
class UpdateCost:
    """What ``train/update_flops`` and ``train/mfu`` need besides the step's tokens and time
    (``lit_grpo.training.flops``).

    Args:
        parameters: N, the policy's parameter count, unsharded.
        reference_pass: pi_ref's no-grad pass ran on this trainer (beta > 0 and the rollout server did not
            score pi_ref for this batch): it counts where it ran.
        extra_no_grad_passes: other no-grad passes over the batch (the TV-after-update monitor's).
        devices: the ranks that ran the update (MFU is per device).
        peak_flops: one device's peak FLOP/s (``lit_grpo.training.flops.device_peak_flops``); None: no MFU is logged.
    """

    parameters: int
    reference_pass: bool
    extra_no_grad_passes: int
    devices: int
    peak_flops: float | None


def first_iteration_stats(pik_logp: torch.Tensor, alpha_logp: torch.Tensor, mask: torch.Tensor,
                          entropy: torch.Tensor | None) -> dict[str, torch.Tensor]:
    """Statistics of pi_k, the policy before this batch, taken at the first iteration's forward: the TV(pi_k,
    alpha) sum and token count, the trainer-sampler log-prob gap, and the entropy sum when it was computed."""
    tv = tv_estimate(pik_logp, alpha_logp, mask)
    stats = {"tv_pik_alpha_sum": tv.sum, "tv_tokens": tv.count,
             "logp_gap_sum": logprob_gap(pik_logp, alpha_logp, mask).sum}
    if entropy is not None:
        stats["entropy_sum"] = (entropy * mask).sum().to(torch.float64)
    return stats


def wait_for_device(device: torch.device) -> None:
    """Block until ``device`` has run what was queued on it. Kernels run asynchronously on a GPU, and the update no
    longer syncs per micro-batch, so without this the update's clock would stop before its work is done."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def grad_norm_key(step: int) -> str:
    """The name of the gradient norm of the update's optimizer step ``step``: the same number on every rank, so the
    ``_max`` suffix (its reduction over ranks) keeps it."""
    return f"grad_norm{step}_max"


def step_statistics(iteration_stats: list[dict[str, torch.Tensor]], grad_norms: list[torch.Tensor],
                    rollout_stats: Mapping[str, float], update_seconds: float) -> dict[str, torch.Tensor | float]:
    """One rank's statistics of the step in one flat dict, each named so that the rule reduces it over ranks as it
    should: every iteration's under its prefix (``it{i}/``), the optimizer steps' gradient norms, the rollout
    batch's statistics under ``rollout/`` and the update's time (``update_seconds``, the slowest rank's)."""
    local: dict[str, torch.Tensor | float] = {}
    for i, stats in enumerate(iteration_stats):
        for key, value in stats.items():
            local[iteration_key(i, key)] = value
    for i, norm in enumerate(grad_norms):
        local[grad_norm_key(i)] = norm
    for key, value in rollout_stats.items():
        local[ROLLOUT_PREFIX + key] = value
    local["update_seconds"] = update_seconds
    return local


def step_metrics(reduced: Mapping[str, torch.Tensor], iterations: int, optimizer_steps: int, staleness: int,
                 reference_served: bool, lr: float, cost: UpdateCost) -> dict[str, float]:
    """The logged metrics of a step from its statistics reduced over ranks (:func:`step_statistics`, then
    ``reduce_stats``): token means over the step's sampled tokens, ratio extrema, the Theorem 1 TV terms per
    sampled token, timings, FLOPs, the gradient norm and the rollout batch's statistics."""
    values = dict(zip(reduced, torch.stack(list(reduced.values())).tolist()))  # one read of the host copy

    def merged(name: str) -> float:
        return over_iterations(values, name, iterations)

    def first(name: str) -> float:
        return values[iteration_key(0, name)]

    tokens = first("tokens")
    denom = max(tokens, 1.0)
    all_tokens = max(merged("tokens"), 1.0)
    tv_tokens = max(first("tv_tokens"), 1.0)
    update_seconds = values["update_seconds"]
    metrics = {
        "train/loss": merged("loss") / iterations,
        "train/loss_first_iteration": first("loss"),
        "train/kl": first("kl_sum") / denom,
        "train/entropy": values.get(iteration_key(0, "entropy_sum"), 0.0) / denom,
        "train/clip_low_fraction": merged("clip_low") / all_tokens,
        "train/clip_high_fraction": merged("clip_high") / all_tokens,
        "train/ratio_mean": merged("ratio_sum") / all_tokens,
        "train/ratio_min": merged("ratio_min"),
        "train/ratio_max": merged("ratio_max"),
        "train/ratio_first_iteration_min": first("ratio_min"),
        "train/ratio_first_iteration_max": first("ratio_max"),
        "train/staleness": float(staleness),
        "train/reference_served": float(reference_served),
        "train/update_seconds": update_seconds,
        "train/update_tokens_per_second": tokens * iterations / max(update_seconds, 1e-9),
        "train/lr": lr,
        **grad_norm_metrics([values[grad_norm_key(i)] for i in range(optimizer_steps)]),
        **flops_metrics(first("processed_tokens"), iterations, update_seconds, cost),
        # the share of the update's forwards spent on padding (data.micro_batch_tokens lowers it)
        "train/padded_fraction": values.get(iteration_key(0, "padded_tokens"), 0.0) / max(
            values.get(iteration_key(0, "computed_tokens"), 0.0), 1.0),
        # Theorem 1: the two TV terms, per sampled token (sigma_alpha is rollout/reward_std)
        "tv/pik_alpha": first("tv_pik_alpha_sum") / tv_tokens,
        "tv/pi_alpha": values[iteration_key(iterations - 1, "tv_pi_alpha_sum")] / tv_tokens,
    }
    metrics.update(correction_metrics(values, merged, first, denom, all_tokens))
    if staleness == 0:
        # trainer-sampler mismatch: alpha should be pi_k when the engine holds the policy's weights; what is left
        # is the engines' numerics (vLLM's kernels, another precision), or weights that did not arrive
        metrics["train/logp_gap_synced"] = first("logp_gap_sum") / tv_tokens
    metrics.update({key: value for key, value in values.items() if key.startswith(ROLLOUT_PREFIX)})
    metrics["rollout/tokens_per_second"] = metrics.get("rollout/generated_tokens", 0.0) / max(
        metrics.get("rollout/generate_seconds", 0.0), 1e-9)
    return metrics


def correction_metrics(values: Mapping[str, float], merged: Any, first: Any, tokens: float,
                       all_tokens: float) -> dict[str, float]:
    """The sampler correction's and the entropy terms' metrics, for the statistics the step has: fractions of the
    tokens the correction masked or truncated and its mean weight (over every iteration's tokens), the mismatch
    between pi_k and the sampler's mu at the first iteration (mean and max |log pi_k - log mu|, k3 KL(mu || pi_k)
    per token: what peers log as their train-inference mismatch), the tokens the top-entropy mask left out, and
    the entropy bonus's measured entropy."""
    has = {key.split("/", 1)[1] for key in values if key.startswith("it0/")}
    metrics: dict[str, float] = {}
    if "correction_masked" in has:
        metrics["correction/masked_fraction"] = merged("correction_masked") / all_tokens
        metrics["correction/truncated_fraction"] = merged("correction_truncated") / all_tokens
        metrics["correction/weight_mean"] = merged("correction_weight_sum") / all_tokens
    if "correction_no_recompute" in has:
        metrics["correction/no_recompute_fraction"] = first("correction_no_recompute") / tokens
    if "mismatch_abs_sum" in has:
        counted = max(first("mismatch_tokens"), 1.0)
        metrics["mismatch/abs_mean"] = first("mismatch_abs_sum") / counted
        metrics["mismatch/abs_max"] = first("mismatch_abs_max")
        metrics["mismatch/k3_kl"] = first("mismatch_k3_sum") / counted
    if "entropy_masked" in has:
        metrics["train/entropy_masked_fraction"] = merged("entropy_masked") / all_tokens
    if "entropy_bonus_sum" in has:
        metrics["train/entropy_bonus_entropy"] = merged("entropy_bonus_sum") / max(merged("entropy_bonus_tokens"), 1.0)
    return metrics


def grad_norm_metrics(values: list[float]) -> dict[str, float]:
    """``train/grad_norm``: the mean over the step's optimizer steps of the global norm before clipping, over the
    finite ones (a 16-mixed step whose gradients overflowed is skipped by the scaler, and counted apart)."""
    finite = [v for v in values if math.isfinite(v)]
    metrics = {"train/grad_norm": sum(finite) / len(finite) if finite else float("nan")}
    metrics["train/nonfinite_grad_steps"] = float(len(values) - len(finite))
    return metrics


def flops_metrics(tokens: float, iterations: int, update_seconds: float, cost: UpdateCost) -> dict[str, float]:
    """``train/update_flops``: the update's model FLOPs over all ranks (``lit_grpo.training.flops``: 6 N per token for
    each policy forward + backward, 2 N for the reference's and the TV-after-update no-grad passes), and
    ``train/mfu``, achieved FLOP/s per device over the peak, when a peak is known."""
    flops = update_flops(cost.parameters, tokens, iterations, reference_pass=cost.reference_pass,
                         extra_no_grad_passes=cost.extra_no_grad_passes)
    metrics = {"train/update_flops": flops}
    if cost.peak_flops is not None and update_seconds > 0:
        metrics["train/mfu"] = model_flops_utilisation(flops, update_seconds, cost.devices, cost.peak_flops)
    return metrics

