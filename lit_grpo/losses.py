"""Policy losses by name: the built-in ones (GRPO's and the REC / REP / RED family's), or your own by import path.

``model.loss`` is a built-in name (:data:`BUILTIN_LOSSES`) or ``package.module:function`` (also
``package.module.function``), resolved and checked when the module is built, before any model loads.

The loss contract
-----------------
Every policy loss, built-in or yours, is a function called once per micro-batch with these keyword arguments::

    loss, stats = fn(logp=..., alpha_logp=..., advantages=..., weights=..., mask=..., config=...,
                     pik_logp=..., ref_logp=...)

- ``logp`` ``[S, T]``: log pi_theta of each completion token (with gradient), S sequences x T completion tokens;
- ``alpha_logp`` ``[S, T]``: log alpha, the policy that sampled the rollouts (eq. 6's denominator);
- ``pik_logp`` ``[S, T]``: log pi_k, the policy before this batch's first optimizer step (detached);
- ``ref_logp`` ``[S, T]`` or None: log pi_ref, the frozen reference (None when ``model.beta`` is 0);
- ``advantages`` ``[S]``: one per completion (eq. 2), broadcast over its tokens;
- ``weights`` ``[S, T]``: the aggregation's per-token weights (``lit_grpo.math.aggregation``), zero outside the
  mask; they divide by totals over the whole batch (all micro-batches and ranks), so the loss is a plain
  weighted SUM: ``(per_token * weights).sum()``;
- ``mask`` ``[S, T]``: 1 on the completion's tokens, 0 on padding;
- ``config``: the loss's options (below).

It returns ``(loss, stats)``: ``loss`` a 0-d tensor to minimise (its gradient is the update), ``stats`` a dict of
detached 0-d tensors holding at least :data:`STAT_KEYS` (sums and extrema over the tokens of ``mask``, which
merge over micro-batches and ranks); :func:`lit_grpo.math.objective.token_stats` builds them. Extra keys are
merged the same way (``*_min`` / ``*_max`` as extrema, others as sums) and logged per iteration.

``config`` of a built-in loss is :class:`~lit_grpo.math.objective.GRPOLossConfig` (``grpo``) or
:class:`~lit_grpo.math.rec.RECLossConfig`, built from the loss's section of :class:`LossOptions` and ``model.beta``.
For your own loss it is an instance of the dataclass its ``config`` parameter is annotated with, built from
``model.loss_options.custom`` (its ``beta`` field, if it has one, from ``model.beta``); with no dataclass
annotation it is a :class:`CustomLossConfig`.

A loss that shapes the batch itself (RED-Drop's balanced subset) declares it in its registry entry as a
``shape_batch`` hook: called once per rollout batch, before the weights, it may rewrite ``batch.advantages`` and
returns a ``[S]`` keep mask (or None); the module folds the mask into the loss weights.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable, Mapping
from dataclasses import MISSING, dataclass, field, fields, is_dataclass
from typing import Any, get_type_hints

import torch

from lit_grpo.batch import RolloutBatch
from lit_grpo.import_paths import resolve_callable
from lit_grpo.math.objective import GRPOLossConfig
from lit_grpo.math.rec import POLICY_LOSSES, RECLossConfig, red_drop_advantages
from lit_grpo.option_groups import as_group

LossFn = Callable[..., tuple[torch.Tensor, dict[str, torch.Tensor]]]
BatchHook = Callable[[RolloutBatch, int], "torch.Tensor | None"]

# the keyword arguments every loss is called with (the contract above)
LOSS_ARGUMENTS = ("logp", "alpha_logp", "advantages", "weights", "mask", "config", "pik_logp", "ref_logp")
# the statistics the module logs (train/ratio_*, train/clip_*_fraction, train/kl), which every loss returns
STAT_KEYS = ("tokens", "ratio_sum", "ratio_min", "ratio_max", "clip_low", "clip_high", "kl_sum")


# ---------------------------------------------------------------------------------------------------------
# Options of the built-in losses: one typed group per loss


def _built(name: str, build: Callable[[], object]) -> object:
    """``build()``, with a bad value's ValueError prefixed by the options section it came from."""
    try:
        return build()
    except ValueError as err:
        raise ValueError(f"loss_options.{name}: {err}") from err


@dataclass(frozen=True)
class GRPOOptions:
    """Options of ``grpo``, the clipped off-policy objective (eq. 6/7 of Mroueh et al.).

    Args:
        eps_low: lower clip half-width of eq. 6, the ratio's band is [r' - eps_low, r' + eps_high].
        eps_high: upper clip half-width (None: eps_low).
        exact_ref_ratio: use r' = pi_k / alpha in eq. 6 instead of the paper's practical r' = 1.
        ratio_cap: truncated importance sampling, pi / alpha <= ratio_cap (None: no cap).
    """

    eps_low: float = 0.2
    eps_high: float | None = None
    exact_ref_ratio: bool = False
    ratio_cap: float | None = None

    def config(self, beta: float) -> GRPOLossConfig:
        eps_high = self.eps_low if self.eps_high is None else self.eps_high
        return _built("grpo", lambda: GRPOLossConfig(eps_low=self.eps_low, eps_high=eps_high, beta=beta,
                                                     exact_ref_ratio=self.exact_ref_ratio, ratio_cap=self.ratio_cap))


@dataclass(frozen=True)
class ClipOptions:
    """Options of a REC clip-mask loss (``rec_oneside_nois``, ``rec_oneside_is``, ``rec_twoside_is``).

    Args:
        eps_low: the mask's lower edge is 1 - eps_low, in (0, 1].
        eps_high: the mask's upper edge is 1 + eps_high (None: eps_low).
    """

    eps_low: float = 0.2
    eps_high: float | None = None

    def config(self, beta: float, section: str = "rec") -> RECLossConfig:
        eps_high = self.eps_low if self.eps_high is None else self.eps_high
        return _built(section, lambda: RECLossConfig(eps_low=self.eps_low, eps_high=eps_high, beta=beta))


@dataclass(frozen=True)
class RingOptions:
    """Options of ``rec_ring``: the two-sided band plus the outer ring.

    Args:
        eps_low: the inner band's lower edge is 1 - eps_low, in (0, 1].
        eps_high: the inner band's upper edge is 1 + eps_high (None: eps_low).
        ring_eps_low: the ring's lower edge 1 - ring_eps_low, in (0, 1].
        ring_eps_high: the ring's upper edge 1 + ring_eps_high.
    """

    eps_low: float = 0.2
    eps_high: float | None = None
    ring_eps_low: float = 0.6
    ring_eps_high: float = 2.0

    def config(self, beta: float) -> RECLossConfig:
        eps_high = self.eps_low if self.eps_high is None else self.eps_high
        return _built("rec_ring", lambda: RECLossConfig(eps_low=self.eps_low, eps_high=eps_high, beta=beta,
                                                        ring_eps_low=self.ring_eps_low,
                                                        ring_eps_high=self.ring_eps_high))


@dataclass(frozen=True)
class TauOptions:
    """Options of a REP loss (``opmd``, ``asymre``).

    Args:
        tau: OPMD's weight of (log pi - log alpha)^2, AsymRE's lowering of the baseline (both 0.1 in the paper).
    """

    tau: float = 0.1

    def config(self, beta: float, section: str = "opmd") -> RECLossConfig:
        return _built(section, lambda: RECLossConfig(tau=self.tau, beta=beta))


@dataclass(frozen=True)
class REDWeightOptions:
    """Options of ``red_weight``.

    Args:
        temperature: each sample's REINFORCE term is weighted by exp(A / temperature), > 0.
    """

    temperature: float = 1.0

    def config(self, beta: float) -> RECLossConfig:
        return _built("red_weight", lambda: RECLossConfig(red_weight_temperature=self.temperature, beta=beta))


@dataclass(frozen=True)
class LossOptions:
    """The losses' options, one section per built-in loss; ``model.loss`` picks the section that is read, and
    setting another one (away from its defaults) is refused rather than ignored. ``red_drop`` has no options.

    Args:
        grpo: options of ``grpo`` (eq. 6/7).
        rec_oneside_nois: options of ``rec_oneside_nois``.
        rec_oneside_is: options of ``rec_oneside_is``.
        rec_twoside_is: options of ``rec_twoside_is``.
        rec_ring: options of ``rec_ring``.
        red_weight: options of ``red_weight``.
        opmd: options of ``opmd``.
        asymre: options of ``asymre``.
        custom: options of your own loss (``model.loss: package.module:function``), checked against the dataclass
            its ``config`` parameter is annotated with.
    """

    grpo: GRPOOptions = GRPOOptions()
    rec_oneside_nois: ClipOptions = ClipOptions()
    rec_oneside_is: ClipOptions = ClipOptions()
    rec_twoside_is: ClipOptions = ClipOptions()
    rec_ring: RingOptions = RingOptions()
    red_weight: REDWeightOptions = REDWeightOptions()
    opmd: TauOptions = TauOptions()
    asymre: TauOptions = TauOptions()
    custom: dict[str, Any] = field(default_factory=dict)


# ---------------------------------------------------------------------------------------------------------
# Batch hooks


def red_drop_batch(batch: RolloutBatch, rank: int) -> torch.Tensor:
    """RED-Drop shapes the data (Yao et al. 2025, appendix RED): recompute the advantages on a balanced subset of
    each group (:func:`~lit_grpo.math.rec.red_drop_advantages`) and drop the rest from the loss. Seeded by batch
    and rank, so a resumed run drops the same samples. Rewrites ``batch.advantages``; returns the ``[S]`` keep
    mask (float, 1 = kept)."""
    generator = torch.Generator().manual_seed(batch.batch_index * 1_000_003 + rank)
    advantages, keep = red_drop_advantages(batch.rewards.view(-1, batch.group_size).cpu(), generator,
                                           eps=batch.advantage_eps, scale=batch.scale_rewards)
    batch.advantages = advantages.view(-1).to(batch.advantages.device)
    return keep.view(-1).to(batch.completion_mask.device, torch.float32)


# ---------------------------------------------------------------------------------------------------------
# The registry


@dataclass(frozen=True)
class LossEntry:
    """A built-in loss: its function, how its ``config`` is made from the options and ``model.beta``, the
    :class:`LossOptions` section it reads (None: no options) and its optional batch hook."""

    fn: LossFn
    make_config: Callable[[LossOptions, float], object]
    section: str | None
    shape_batch: BatchHook | None = None


BUILTIN_LOSSES: dict[str, LossEntry] = {
    "grpo": LossEntry(POLICY_LOSSES["grpo"], lambda o, beta: o.grpo.config(beta), "grpo"),
    "rec_oneside_nois": LossEntry(POLICY_LOSSES["rec_oneside_nois"],
                                  lambda o, beta: o.rec_oneside_nois.config(beta, "rec_oneside_nois"),
                                  "rec_oneside_nois"),
    "rec_oneside_is": LossEntry(POLICY_LOSSES["rec_oneside_is"],
                                lambda o, beta: o.rec_oneside_is.config(beta, "rec_oneside_is"), "rec_oneside_is"),
    "rec_twoside_is": LossEntry(POLICY_LOSSES["rec_twoside_is"],
                                lambda o, beta: o.rec_twoside_is.config(beta, "rec_twoside_is"), "rec_twoside_is"),
    "rec_ring": LossEntry(POLICY_LOSSES["rec_ring"], lambda o, beta: o.rec_ring.config(beta), "rec_ring"),
    "red_drop": LossEntry(POLICY_LOSSES["red_drop"], lambda o, beta: _built("red_drop", lambda: RECLossConfig(
        beta=beta)), None, shape_batch=red_drop_batch),
    "red_weight": LossEntry(POLICY_LOSSES["red_weight"], lambda o, beta: o.red_weight.config(beta), "red_weight"),
    "opmd": LossEntry(POLICY_LOSSES["opmd"], lambda o, beta: o.opmd.config(beta, "opmd"), "opmd"),
    "asymre": LossEntry(POLICY_LOSSES["asymre"], lambda o, beta: o.asymre.config(beta, "asymre"), "asymre"),
}


@dataclass(frozen=True)
class CustomLossConfig:
    """``config`` of your own loss when its ``config`` parameter names no dataclass: ``model.beta`` and
    ``model.loss_options.custom`` as given."""

    beta: float = 0.0
    options: Mapping[str, Any] = field(default_factory=dict)


@dataclass(frozen=True)
class PolicyLoss:
    """A resolved loss: what the module calls (``fn`` with ``config``) and its optional batch hook."""

    name: str
    fn: LossFn
    config: object
    shape_batch: BatchHook | None = None


_SPEC_HELP = (f"expected a built-in loss ({', '.join(BUILTIN_LOSSES)}) or 'package.module:function' naming "
              f"fn({', '.join(LOSS_ARGUMENTS)}) -> (loss, stats); see lit_grpo.losses")


def resolve_loss_function(spec: str) -> LossFn:
    """The function an import path names, checked to exist, be callable and take the contract's arguments."""
    if not isinstance(spec, str) or not spec.strip():
        raise ValueError(f"loss {spec!r}: {_SPEC_HELP}")
    spec = spec.strip()
    fn = resolve_callable(spec, "loss", _SPEC_HELP)
    check_loss_signature(fn, spec)
    return fn


def check_loss_signature(fn: LossFn, spec: str) -> None:
    """Refuse a function that cannot be called with the contract's keyword arguments, or that needs others."""
    try:
        params = inspect.signature(fn).parameters.values()
    except (TypeError, ValueError) as e:
        raise ValueError(f"loss {spec!r}: cannot read its signature ({e}); {_SPEC_HELP}") from e
    keywords = {p.name for p in params if p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY)}
    takes_any = any(p.kind is p.VAR_KEYWORD for p in params)
    missing = [name for name in LOSS_ARGUMENTS if name not in keywords and not takes_any]
    extra = [p.name for p in params if p.name not in LOSS_ARGUMENTS and p.default is p.empty
             and p.kind not in (p.VAR_POSITIONAL, p.VAR_KEYWORD)]
    if missing or extra:
        what = "; ".join(filter(None, [f"does not take {missing}" if missing else "",
                                       f"needs arguments the loss is not given: {extra}" if extra else ""]))
        raise TypeError(f"loss {spec!r} has the wrong signature {inspect.signature(fn)}: it {what}; {_SPEC_HELP}")


def _custom_config(fn: LossFn, spec: str, options: Mapping[str, Any], beta: float) -> object:
    """``config`` of your own loss: its ``config`` annotation's dataclass built from the options (and beta)."""
    try:
        kind = get_type_hints(fn).get("config")
    except Exception as e:  # an annotation that does not resolve: a NameError, a bad forward reference
        raise ValueError(f"loss {spec!r}: cannot resolve its annotations ({e!r})") from e
    if not (isinstance(kind, type) and is_dataclass(kind)):
        return CustomLossConfig(beta=beta, options=dict(options))
    names = [f.name for f in fields(kind)]
    if "beta" in options:
        raise ValueError(f"loss_options.custom sets beta; the KL weight is model.beta (loss {spec!r})")
    unknown = sorted(set(options) - set(names))
    if unknown:
        raise ValueError(f"loss_options.custom has option(s) {unknown} that {kind.__name__} (the config of loss "
                         f"{spec!r}) does not have; expected among {names}")
    kwargs = dict(options)
    if "beta" in names:
        kwargs["beta"] = beta
    required = [f.name for f in fields(kind) if f.default is MISSING and f.default_factory is MISSING
                and f.name not in kwargs]
    if required:
        raise ValueError(f"loss_options.custom lacks {required}, which {kind.__name__} (the config of loss {spec!r}) "
                         "requires")
    try:
        return kind(**kwargs)
    except (TypeError, ValueError) as e:
        raise ValueError(f"loss_options.custom: {kind.__name__} (the config of loss {spec!r}) refuses them: {e}") from e


def build_loss(spec: str, options: LossOptions | Mapping[str, Any] | None, beta: float) -> PolicyLoss:
    """Resolve ``model.loss`` and make its config from ``options`` and ``beta``; every check runs here, before any
    model loads. A section of ``options`` that the chosen loss does not read must be at its defaults."""
    options = as_group(LossOptions, options, "loss_options")
    entry = BUILTIN_LOSSES.get(spec) if isinstance(spec, str) else None
    read = (entry.section if entry is not None else "custom")
    defaults = LossOptions()
    stray = [f.name for f in fields(LossOptions) if f.name != read
             and getattr(options, f.name) != getattr(defaults, f.name)]
    if stray:
        reads = f"reads loss_options.{read} only" if read else "has no options"
        raise ValueError(f"loss_options.{stray[0]} is set ({getattr(options, stray[0])}) but model.loss {spec!r} "
                         f"{reads}; remove it or pick that loss")
    if entry is not None:
        return PolicyLoss(spec, entry.fn, entry.make_config(options, beta), entry.shape_batch)
    fn = resolve_loss_function(spec)
    return PolicyLoss(spec, fn, _custom_config(fn, spec, options.custom, beta))


def check_loss_output(name: str, output: object) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """A loss's return value, checked against the contract (a 0-d tensor and the statistics the module logs)."""
    if not (isinstance(output, tuple) and len(output) == 2):
        raise TypeError(f"loss {name!r} returned {type(output).__name__}; expected a (loss, stats) tuple")
    loss, stats = output
    if not (isinstance(loss, torch.Tensor) and loss.dim() == 0):
        shape = tuple(loss.shape) if isinstance(loss, torch.Tensor) else type(loss).__name__
        raise TypeError(f"loss {name!r} returned a loss of {shape}; expected a 0-d tensor")
    missing = [key for key in STAT_KEYS if key not in stats] if isinstance(stats, dict) else list(STAT_KEYS)
    if missing:
        raise TypeError(f"loss {name!r} returned stats without {missing}; expected a dict with {STAT_KEYS} "
                        "(lit_grpo.math.objective.token_stats builds them)")
    return loss, stats
