"""Policy losses by name: the built-in ones (GRPO's, GSPO's, CISPO's and the REC / REP / RED family's), or your own by
import path.

``model.loss`` is a built-in name (:data:`BUILTIN_LOSSES`) or ``package.module:function`` (also
``package.module.function``), resolved and checked when the module is built, before any model loads.

The loss contract
-----------------
Every policy loss, built-in or yours, is a function called once per micro-batch with these keyword arguments::

    loss, stats = fn(logp=..., alpha_logp=..., advantages=..., weights=..., mask=..., config=...,
                     pik_logp=..., ref_logp=...)     # and correction=..., policy_mask=... when it names them

- ``logp`` ``[S, T]``: log pi_theta of each completion token (with gradient), S sequences x T completion tokens;
- ``alpha_logp`` ``[S, T]``: log alpha, the policy that sampled the rollouts (eq. 6's denominator);
- ``pik_logp`` ``[S, T]``: log pi_k, the policy before this batch's first optimizer step (detached);
- ``ref_logp`` ``[S, T]`` or None: log pi_ref, the frozen reference (None when ``model.beta`` is 0);
- ``advantages`` ``[S]``: one per completion (eq. 2), broadcast over its tokens;
- ``weights`` ``[S, T]``: the aggregation's per-token weights (``lit_grpo.math.aggregation``), zero outside the
  mask; they divide by totals over the whole batch (all micro-batches and ranks), so the loss is a plain
  weighted SUM: ``(per_token * weights).sum()``;
- ``mask`` ``[S, T]``: 1 on the completion's tokens, 0 on padding;
- ``config``: the loss's options (below);
- ``correction`` ``[S, T]`` or None, only for a loss that names a ``correction`` parameter (every built-in one
  does): the sampler correction's detached per-token weight (``model.correction``, :mod:`lit_grpo.math.corrections`),
  to multiply into the policy term and not into the KL term (:func:`lit_grpo.math.objective.with_kl_penalty`).
  None when no correction is on, or when the correction is a keep mask (below). A loss that does not name the
  parameter is refused when ``model.correction`` is set: a ``**kwargs`` catch-all does not count, since it could
  drop the weight unseen.
- ``policy_mask`` ``[S, T]`` or None, only for a loss that names a ``policy_mask`` parameter (every built-in one
  does): the detached 0/1 mask of the tokens whose policy term is kept, the top-entropy tokens
  (``model.entropy.top_entropy_quantile``) times the keep masks among the corrections
  (:data:`lit_grpo.math.corrections.MASK_MODES`), to multiply onto the policy term after the loss's own weighting
  and not into the KL term, as TRL applies its ``entropy_mask`` and off-policy mask. None when neither is on. A
  loss that names ``correction`` but not ``policy_mask`` (written before it existed) gets the mask multiplied into
  its ``correction``, the same for a loss that multiplies its correction onto the policy term; one that names
  neither is refused when the mask could be on. :func:`loss_inputs` builds the two.

It returns ``(loss, stats)``: ``loss`` a 0-d tensor to minimise (its gradient is the update), ``stats`` a dict of
detached 0-d tensors holding at least :data:`STAT_KEYS` (sums and extrema over the tokens of ``mask``, which
merge over micro-batches and ranks); :func:`lit_grpo.math.objective.token_stats` builds them. Extra keys are
merged by the same rule, by name (:func:`lit_grpo.training.stat_reduction.reduction`: ``*_min`` / ``*_max`` as extrema,
others as sums) and logged per iteration.

``config`` of a built-in loss is its options dataclass (the class its ``config`` parameter is annotated with,
a :class:`~lit_grpo.math.objective.LossConfig`): the loss's section of :class:`LossOptions`, with ``beta`` set
from ``model.beta``. Your own loss follows the same rule: its ``config`` is an instance of the dataclass its
``config`` parameter is annotated with, built from ``model.loss_options.custom`` (its ``beta`` field, if it has
one, from ``model.beta``); with no dataclass annotation it is a :class:`CustomLossConfig`.

A loss that shapes the batch itself (RED-Drop's balanced subset) declares it in its registry entry as a
``shape_batch`` hook: called once per rollout batch, before the weights, with the batch and the rank, it returns a
shaped copy of the batch (new advantages) and a ``[S]`` keep mask (or None); the batch it is given is not changed.
The module trains on the copy and folds the mask into the loss weights.
"""

from __future__ import annotations

import dataclasses
import inspect
from collections.abc import Callable, Mapping
from dataclasses import MISSING, dataclass, field, fields, is_dataclass
from typing import Any, get_type_hints

import torch

from lit_grpo.core.batch import RolloutBatch
from lit_grpo.core.import_paths import resolve_callable
from lit_grpo.core.option_groups import as_group
from lit_grpo.math import rec
from lit_grpo.math.cispo import CISPOOptions, cispo_loss
from lit_grpo.math.corrections import CORRECTION_MODES, MASK_MODES
from lit_grpo.math.dppo import DPPOKLOptions, DPPOOptions, dppo_kl_loss, dppo_tv_loss
from lit_grpo.math.gmpo import GMPOOptions, gmpo_loss
from lit_grpo.math.gspo import GSPOOptions, gspo_loss
from lit_grpo.math.luspo import LUSPOOptions, luspo_loss
from lit_grpo.math.objective import GRPOOptions, LossConfig, LossFn, grpo_loss
from lit_grpo.math.rec import ClipOptions, REDWeightOptions, RingOptions, TauOptions
from lit_grpo.math.sapo import SAPOOptions, sapo_loss
from lit_grpo.math.vespo import REFUSED_CORRECTIONS as VESPO_REFUSED_CORRECTIONS
from lit_grpo.math.vespo import VESPOOptions, vespo_loss

#: a loss's batch hook: ``(batch, rank) -> (shaped copy of batch, [S] keep mask or None)``
BatchHook = Callable[[RolloutBatch, int], tuple[RolloutBatch, "torch.Tensor | None"]]

# the keyword arguments every loss is called with (the contract above)
LOSS_ARGUMENTS = ("logp", "alpha_logp", "advantages", "weights", "mask", "config", "pik_logp", "ref_logp")
# the keywords a loss may take besides them: each is passed only to a loss that names it
OPTIONAL_ARGUMENTS = ("correction", "policy_mask")
# the statistics the module logs (train/ratio_*, train/clip_*_fraction, train/kl), which every loss returns
STAT_KEYS = ("tokens", "ratio_sum", "ratio_min", "ratio_max", "clip_low", "clip_high", "kl_sum")


# ---------------------------------------------------------------------------------------------------------
# Options of the built-in losses: one typed group per loss, which is also the config the loss is called with
# (GRPOOptions in lit_grpo.math.objective, GSPOOptions in lit_grpo.math.gspo, CISPOOptions in lit_grpo.math.cispo,
# the REC family's in lit_grpo.math.rec, next to their formulas)


@dataclass(frozen=True)
class LossOptions:
    """The losses' options, one section per built-in loss; ``model.loss`` picks the section that is read, and
    setting another one (away from its defaults) is refused rather than ignored. ``red_drop`` has no options.

    Args:
        grpo: options of ``grpo`` (eq. 6/7).
        gspo: options of ``gspo`` (GSPO: eq. 6's clip on one ratio per sequence).
        cispo: options of ``cispo`` (CISPO: REINFORCE with a clipped importance weight).
        sapo: options of ``sapo`` (SAPO: a sigmoid gate of the token ratio instead of the clip).
        luspo: options of ``luspo`` (LUSPO: GSPO's sequence clip; use loss_aggregation seq_mean_token_sum).
        vespo: options of ``vespo`` (VESPO: REINFORCE weighted by a Gamma-shaped function of the sequence ratio).
        gmpo: options of ``gmpo`` (GMPO: the geometric mean of the token ratios, clipped in log space).
        rec_oneside_nois: options of ``rec_oneside_nois``.
        rec_oneside_is: options of ``rec_oneside_is``.
        rec_twoside_is: options of ``rec_twoside_is``.
        rec_ring: options of ``rec_ring``.
        red_weight: options of ``red_weight``.
        opmd: options of ``opmd``.
        asymre: options of ``asymre``.
        dppo_tv: options of ``dppo_tv`` (DPPO's Binary-TV trust-region mask).
        dppo_kl: options of ``dppo_kl`` (DPPO's Binary-KL trust-region mask).
        custom: options of your own loss (``model.loss: package.module:function``), checked against the dataclass
            its ``config`` parameter is annotated with.
    """

    grpo: GRPOOptions = GRPOOptions()
    gspo: GSPOOptions = GSPOOptions()
    cispo: CISPOOptions = CISPOOptions()
    sapo: SAPOOptions = SAPOOptions()
    luspo: LUSPOOptions = LUSPOOptions()
    vespo: VESPOOptions = VESPOOptions()
    gmpo: GMPOOptions = GMPOOptions()
    rec_oneside_nois: ClipOptions = ClipOptions()
    rec_oneside_is: ClipOptions = ClipOptions()
    rec_twoside_is: ClipOptions = ClipOptions()
    rec_ring: RingOptions = RingOptions()
    red_weight: REDWeightOptions = REDWeightOptions()
    opmd: TauOptions = TauOptions()
    asymre: TauOptions = TauOptions()
    dppo_tv: DPPOOptions = DPPOOptions()
    dppo_kl: DPPOKLOptions = DPPOKLOptions()
    custom: dict[str, Any] = field(default_factory=dict)


# ---------------------------------------------------------------------------------------------------------
# Batch hooks


def red_drop_batch(batch: RolloutBatch, rank: int) -> tuple[RolloutBatch, torch.Tensor]:
    """RED-Drop shapes the data (Yao et al. 2025, appendix RED): recompute the advantages on a balanced subset of
    each group (:func:`~lit_grpo.math.rec.red_drop_advantages`) and drop the rest from the loss. Seeded by batch
    and rank, so a resumed run drops the same samples. Returns a copy of ``batch`` holding the new advantages
    (``batch`` itself is left as it was collated) and the ``[S]`` keep mask (float, 1 = kept)."""
    if batch.advantage_std != "population":
        # RED-Drop recomputes eq. 2 on the kept samples with the population std; it has no Bessel variant
        raise ValueError(f"loss red_drop recomputes eq. 2's advantages with the population std; "
                         f"data.advantage_std {batch.advantage_std!r} does not apply to it: use population")
    generator = torch.Generator().manual_seed(batch.batch_index * 1_000_003 + rank)
    advantages, keep = rec.red_drop_advantages(batch.rewards.view(-1, batch.group_size).cpu(), generator,
                                           eps=batch.advantage_eps, scale=batch.scale_rewards)
    shaped = dataclasses.replace(batch, advantages=advantages.view(-1).to(batch.advantages.device))
    return shaped, keep.view(-1).to(batch.completion_mask.device, torch.float32)


# ---------------------------------------------------------------------------------------------------------
# The registry


@dataclass(frozen=True)
class LossEntry:
    """A built-in loss: its function and its optional batch hook. Its options class is the one the function's
    ``config`` parameter is annotated with (:func:`config_class`), its :class:`LossOptions` section the field named
    as the loss (none for a loss without options)."""

    fn: LossFn
    shape_batch: BatchHook | None = None
    #: the sampler corrections (``model.correction.mode``) the loss cannot take, refused before a model loads
    refused_corrections: tuple[str, ...] = ()


#: the one registry of built-in losses: ``model.loss`` names one of these
BUILTIN_LOSSES: dict[str, LossEntry] = {
    "grpo": LossEntry(grpo_loss),
    "gspo": LossEntry(gspo_loss),
    "cispo": LossEntry(cispo_loss),
    "rec_oneside_nois": LossEntry(rec.rec_oneside_nois_loss),
    "rec_oneside_is": LossEntry(rec.rec_oneside_is_loss),
    "rec_twoside_is": LossEntry(rec.rec_twoside_is_loss),
    "rec_ring": LossEntry(rec.rec_ring_loss),
    "red_drop": LossEntry(rec.red_drop_loss, shape_batch=red_drop_batch),
    "red_weight": LossEntry(rec.red_weight_loss),
    "opmd": LossEntry(rec.opmd_loss),
    "asymre": LossEntry(rec.asymre_loss),
    "sapo": LossEntry(sapo_loss),
    "luspo": LossEntry(luspo_loss),
    "vespo": LossEntry(vespo_loss, refused_corrections=VESPO_REFUSED_CORRECTIONS),
    "gmpo": LossEntry(gmpo_loss),
    "dppo_tv": LossEntry(dppo_tv_loss),
    "dppo_kl": LossEntry(dppo_kl_loss),
}

# the built-in losses that have options: LossOptions' fields but ``custom``
_SECTIONS = tuple(f.name for f in fields(LossOptions) if f.name != "custom")


def config_class(fn: LossFn, spec: str) -> type | None:
    """The class loss ``spec``'s ``config`` parameter is annotated with (None when it names no class)."""
    try:
        kind = get_type_hints(fn).get("config")
    except Exception as e:  # an annotation that does not resolve: a NameError, a bad forward reference
        raise ValueError(f"loss {spec!r}: cannot resolve its annotations ({e!r})") from e
    return kind if isinstance(kind, type) else None


def builtin_config(name: str, options: LossOptions, beta: float, kl_bias_correction: bool = False) -> LossConfig:
    """The config built-in loss ``name`` is called with: its section of ``options`` (for a loss without options,
    its options class's defaults), with ``beta`` = ``model.beta`` and ``kl_bias_correction``."""
    section = getattr(options, name) if name in _SECTIONS else config_class(BUILTIN_LOSSES[name].fn, name)()
    return section.with_beta(beta, kl_bias_correction)


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
    refused_corrections: tuple[str, ...] = ()


_SPEC_HELP = (f"expected a built-in loss ({', '.join(BUILTIN_LOSSES)}) or 'package.module:function' naming "
              f"fn({', '.join(LOSS_ARGUMENTS)}) -> (loss, stats); see lit_grpo.training.losses")


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
    extra = [p.name for p in params if p.name not in LOSS_ARGUMENTS + OPTIONAL_ARGUMENTS and p.default is p.empty
             and p.kind not in (p.VAR_POSITIONAL, p.VAR_KEYWORD)]
    if missing or extra:
        what = "; ".join(filter(None, [f"does not take {missing}" if missing else "",
                                       f"needs arguments the loss is not given: {extra}" if extra else ""]))
        raise TypeError(f"loss {spec!r} has the wrong signature {inspect.signature(fn)}: it {what}; {_SPEC_HELP}")


def named_optional_arguments(fn: LossFn) -> frozenset[str]:
    """The optional keywords (:data:`OPTIONAL_ARGUMENTS`) a loss names as parameters; ``**kwargs`` names none."""
    params = inspect.signature(fn).parameters.values()
    return frozenset(p.name for p in params if p.name in OPTIONAL_ARGUMENTS
                     and p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY))


def check_loss_inputs(loss: PolicyLoss, correction_mode: str, top_entropy_quantile: float) -> frozenset[str]:
    """The optional keywords ``loss`` names, once checked against what the module will hand it: a sampler
    correction needs a ``correction`` parameter and a loss that accepts that mode; the top-entropy mask needs
    ``policy_mask`` (or ``correction``, which then carries it). A ``**kwargs`` catch-all is no parameter: it
    would take the weight and could drop it unseen. Raises a one-line ValueError, before any model loads."""
    names = named_optional_arguments(loss.fn)
    if correction_mode in loss.refused_corrections:
        accepted = [m for m in CORRECTION_MODES if m != "none" and m not in loss.refused_corrections]
        raise ValueError(f"model.correction.mode={correction_mode!r} gives each sequence one weight on all its "
                         f"tokens, and model.loss {loss.name!r} adds each token's correction to the sequence's "
                         f"log-weight, so it would count that weight once per token; expected one of "
                         f"{', '.join(accepted)} with this loss, or another loss")
    catch_all = " (a **kwargs catch-all does not count: it could drop the weight)"
    if correction_mode != "none" and "correction" not in names:
        raise ValueError(f"model.correction.mode={correction_mode!r} needs a loss with a `correction` parameter (a "
                         f"per-token weight on the policy term); loss {loss.name!r} has none{catch_all}: add "
                         "`correction=None` to its signature")
    if top_entropy_quantile < 1.0 and not names:
        raise ValueError(f"model.entropy.top_entropy_quantile={top_entropy_quantile} needs a loss with a "
                         f"`policy_mask` parameter (the 0/1 mask of the tokens the policy term keeps); loss "
                         f"{loss.name!r} has none{catch_all}: add `policy_mask=None` to its signature")
    return names


def loss_inputs(names: frozenset[str], correction_mode: str, weight: torch.Tensor | None,
                entropy_keep: torch.Tensor | None) -> dict[str, torch.Tensor | None]:
    """The optional keyword arguments of a loss that names ``names``: the correction's ``weight`` (None: no
    correction) goes as ``correction`` when it is an importance ratio and into ``policy_mask`` when
    ``correction_mode`` is a keep mask (:data:`~lit_grpo.math.corrections.MASK_MODES`), with the top-entropy mask
    ``entropy_keep``; a loss that names ``correction`` alone gets the mask multiplied into it (the contract before
    ``policy_mask``), so what it is given still scales the policy term alone."""
    correction, policy_mask = weight, None
    if weight is not None and correction_mode in MASK_MODES:
        correction, policy_mask = None, weight
    if entropy_keep is not None:
        policy_mask = entropy_keep if policy_mask is None else policy_mask * entropy_keep
    inputs: dict[str, torch.Tensor | None] = {}
    if "policy_mask" in names:
        inputs["policy_mask"] = policy_mask
    elif policy_mask is not None:
        correction = policy_mask if correction is None else correction * policy_mask
    if "correction" in names:
        inputs["correction"] = correction
    return inputs


def _custom_config(fn: LossFn, spec: str, options: Mapping[str, Any], beta: float,
                   kl_bias_correction: bool = False) -> object:
    """``config`` of your own loss: its ``config`` annotation's dataclass built from the options (and beta; a
    subclass of :class:`LossConfig`, as the built-in losses' options are, gets it by ``with_beta``)."""
    kind = config_class(fn, spec)
    if kl_bias_correction and not (isinstance(kind, type) and issubclass(kind, LossConfig)):
        raise ValueError(f"kl_bias_correction needs a loss whose config is a LossConfig (it reads "
                         f"config.kl_bias_correction); loss {spec!r} takes {getattr(kind, '__name__', kind)}")
    if kind is None or not is_dataclass(kind):
        return CustomLossConfig(beta=beta, options=dict(options))
    names = [f.name for f in fields(kind) if f.init]
    if "beta" in options:
        raise ValueError(f"loss_options.custom sets beta; the KL weight is model.beta (loss {spec!r})")
    unknown = sorted(set(options) - set(names))
    if unknown:
        raise ValueError(f"loss_options.custom has option(s) {unknown} that {kind.__name__} (the config of loss "
                         f"{spec!r}) does not have; expected among {names}")
    kwargs = dict(options)
    if "beta" in names:
        kwargs["beta"] = beta
    required = [f.name for f in fields(kind) if f.init and f.default is MISSING and f.default_factory is MISSING
                and f.name not in kwargs]
    if required:
        raise ValueError(f"loss_options.custom lacks {required}, which {kind.__name__} (the config of loss {spec!r}) "
                         "requires")
    try:
        config = kind(**kwargs)
        return config.with_beta(beta, kl_bias_correction) if isinstance(config, LossConfig) else config
    except (TypeError, ValueError) as e:
        raise ValueError(f"loss_options.custom: {kind.__name__} (the config of loss {spec!r}) refuses them: {e}") from e


def build_loss(spec: str, options: LossOptions | Mapping[str, Any] | None, beta: float,
               kl_bias_correction: bool = False) -> PolicyLoss:
    """Resolve ``model.loss`` and make its config from ``options``, ``beta`` and ``kl_bias_correction`` (the KL
    weighted by the importance ratio, :func:`lit_grpo.math.objective.with_kl_penalty`); every check runs here,
    before any model loads. A section of ``options`` that the chosen loss does not read must be at its defaults."""
    options = as_group(LossOptions, options, "loss_options")
    entry = BUILTIN_LOSSES.get(spec) if isinstance(spec, str) else None
    read = "custom" if entry is None else (spec if spec in _SECTIONS else None)
    defaults = LossOptions()
    stray = [f.name for f in fields(LossOptions) if f.name != read
             and getattr(options, f.name) != getattr(defaults, f.name)]
    if stray:
        reads = f"reads loss_options.{read} only" if read else "has no options"
        raise ValueError(f"loss_options.{stray[0]} is set ({getattr(options, stray[0])}) but model.loss {spec!r} "
                         f"{reads}; remove it or pick that loss")
    if entry is not None:
        return PolicyLoss(spec, entry.fn, builtin_config(spec, options, beta, kl_bias_correction), entry.shape_batch,
                          entry.refused_corrections)
    fn = resolve_loss_function(spec)
    return PolicyLoss(spec, fn, _custom_config(fn, spec, options.custom, beta, kl_bias_correction))


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
