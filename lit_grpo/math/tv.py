"""Monitors for the terms of Theorem 1 (Mroueh et al., policy-improvement lower bound of off-policy GRPO):

    J(pi) - J(pi_k) >= L_alpha(pi) - 2 (1 - sigma_{alpha,r,eps}) / sigma_{alpha,r,eps} * TV(pi, alpha)
                                   - 2 TV(pi_k, alpha).

Estimators of the two total variations from tokens sampled from alpha, and of sigma_{alpha,r}.
"""

from __future__ import annotations

from typing import NamedTuple

import torch


class TVEstimate(NamedTuple):
    """A TV estimate with its parts: ``value = sum / count``. Add ``sum`` and ``count`` over micro-batches or
    ranks, then divide with :func:`tv_from_sum_count`, to get the estimate of the whole batch."""

    value: torch.Tensor
    sum: torch.Tensor
    count: torch.Tensor


def tv_from_sum_count(total: torch.Tensor, count: torch.Tensor) -> torch.Tensor:
    """``total / count``, and 0 (not NaN) when no token counted, so an empty micro-batch logs a finite value."""
    return torch.where(count > 0, total / count.clamp(min=1), torch.zeros_like(total))


def _check_same_shape(logp_a: torch.Tensor, logp_b: torch.Tensor, mask: torch.Tensor) -> None:
    if logp_a.shape != logp_b.shape or logp_a.shape != mask.shape:
        raise ValueError(
            f"logp_a, logp_b and mask must have the same shape, got {tuple(logp_a.shape)}, "
            f"{tuple(logp_b.shape)}, {tuple(mask.shape)}"
        )


def tv_estimate(logp_a: torch.Tensor, logp_b: torch.Tensor, mask: torch.Tensor) -> TVEstimate:
    """Token-level estimate of ``TV(a, b)`` from tokens sampled from ``b``: ``0.5 * mean |exp(logp_a - logp_b) - 1|``
    over the tokens of ``mask``.

    Why: ``TV(m1, m2) = 1/2 int |m1 - m2| = 1/2 E_{y ~ m2} |m1(y) / m2(y) - 1|`` (section 3's definition), so
    each sampled token gives a one-sample unbiased estimate of the TV between the two next-token
    distributions at its prefix; the mean over tokens is the average per-token TV. In Theorem 1, b is the
    rollout policy alpha (the tokens were sampled from it): ``logp_a = pi`` (current policy) estimates
    ``TV(pi, alpha)``, ``logp_a = pi_k`` (policy before this rollout batch) estimates ``TV(pi_k, alpha)``. The
    theorem's TV is over whole completions; the per-token TV summed along a completion bounds it from above
    in expectation (chain rule of TV), so this is a proxy, comparable across runs, not the theorem's quantity.

    Shapes ``[S, T]``; ``mask`` 1 on completion tokens. Returns float64 ``value``, ``sum`` (of
    ``0.5 |r - 1|``) and ``count``, on the inputs' device; nothing here needs or keeps a gradient, and nothing
    waits for the device (masked-out tokens are zeroed with ``torch.where``, not dropped with ``x[mask]``, so the
    trainer can call this on every micro-batch without a host sync).
    """
    _check_same_shape(logp_a, logp_b, mask)
    with torch.no_grad():
        m = mask.bool()
        diff = (logp_a.detach() - logp_b.detach()).to(torch.float64)
        half_abs = 0.5 * (torch.exp(diff) - 1.0).abs()
        total = torch.where(m, half_abs, 0.0).sum()
        count = m.sum().to(torch.float64)
        return TVEstimate(tv_from_sum_count(total, count), total, count)


class SumCount(NamedTuple):
    """A mean over tokens in parts, ``sum / count``, to add over micro-batches and ranks before dividing."""

    sum: torch.Tensor
    count: torch.Tensor


def logprob_gap(logp_a: torch.Tensor, logp_b: torch.Tensor, mask: torch.Tensor) -> SumCount:
    """Sum and count of ``|logp_a - logp_b|`` over the tokens of ``mask``: the trainer-sampler mismatch when
    ``logp_a`` is pi_k (the trainer's first forward) and ``logp_b`` alpha (the engine's log-probs) at a step where
    the engine holds the policy's weights.

    Why: there the paper's alpha is pi_k, so eq. 6's ratio pi/alpha starts at exactly 1 in exact arithmetic; any
    gap is the two engines' numerics (another precision, vLLM's kernels) or weights that did not arrive (the
    check that caught silently unsynced weights in TRL issue 5312). Float64, on the inputs' device; no gradient
    and no host sync (``torch.where`` rather than ``x[mask]``, as in :func:`tv_estimate`).
    """
    _check_same_shape(logp_a, logp_b, mask)
    with torch.no_grad():
        m = mask.bool()
        gap = (logp_a.detach().to(torch.float64) - logp_b.detach().to(torch.float64)).abs()
        return SumCount(torch.where(m, gap, 0.0).sum(), m.sum().to(torch.float64))


def group_reward_std(rewards: torch.Tensor) -> torch.Tensor:
    """Mean over groups of the population std of the G rewards: the plug-in estimate of
    ``E_x sigma_{alpha,r}(x)`` in Theorem 1 (no eps; add it inside the root for ``sigma_{alpha,r,eps}``).

    ``rewards`` ``[num_groups, G]`` sampled from alpha. The smaller sigma, the larger the theorem's weight
    ``(1 - sigma_eps) / sigma_eps`` on ``TV(pi, alpha)``; zero-variance groups push it to its maximum.
    """
    if rewards.dim() != 2:
        raise ValueError(f"rewards must have shape [num_groups, G], got {tuple(rewards.shape)}")
    return rewards.to(torch.float64).std(dim=1, correction=0).mean()
