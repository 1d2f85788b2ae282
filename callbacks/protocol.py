"""What the callbacks read of a LightningModule, written as ``typing.Protocol`` classes, and the checks that hold a
module to it when a fit starts, so that the callbacks work in any LightningModule that exposes these names.

- ``policy`` (all four): the model being trained, an ``nn.Module``; for ``GSM8KPassAtK`` a Hugging Face causal LM
  (:class:`CausalLM`), for ``HFExport`` one with ``save_pretrained`` (:class:`Exportable`).
- ``reference`` (``RefModelSwap``; ``WeightSync`` when the engine scores pi_ref): pi_ref, an ``nn.Module`` with the
  policy's parameter names and shapes, or ``None`` for no reference (beta = 0, or a LoRA policy whose pi_ref is the
  policy with its adapter off).
- ``reference_version`` (``RefModelSwap``, ``WeightSync``): optional ``int`` counting the swaps, so that a copy of
  pi_ref on a rollout server is pushed again after each.
- ``tokenizer`` (``GSM8KPassAtK``; ``HFExport`` saves it when present): a Hugging Face tokenizer with an
  ``eos_token``; one without a pad token pads with the eos token (``lit_grpo.models.loading.pad_token_id``).
- ``rollout_engine`` (``WeightSync``): a ``lit_grpo.engines.base.RolloutEngine``, passed to the callback, or found
  on the data module (``RolloutDataModule`` has one) or on the module.

There is no fallback: a module without ``policy`` is refused, since the LightningModule itself cannot stand for the
policy (its parameters include pi_ref's and its own, under prefixed names, and it is not a causal LM). A module with
no ``reference`` attribute at all is refused by ``RefModelSwap`` (``reference = None`` is the explicit "no
reference"), so a reference stored under another name cannot be a silent no-op.

Each callback calls its check (``check_weight_sync``, ``check_ref_swap``, ``check_pass_at_k``, ``check_hf_export``)
in ``on_fit_start``: after every ``setup`` and ``configure_model`` (the engine and a lazily built pi_ref exist by
then), before the first batch is sampled. A failure is a :class:`ProtocolError`, one line naming the callback, the
attribute, the module's class and what the attribute must be, and a similarly named attribute it may have meant.
"""

from __future__ import annotations

import difflib
from collections.abc import Callable, Iterable
from typing import Any, Protocol, runtime_checkable

import lightning as L
from torch import nn

from lit_grpo.core.distributed import FullParameters, full_named_parameters, strip_wrapper_prefixes
from lit_grpo.engines.base import RolloutEngine

#: what each attribute must be, as the error messages say it
POLICY_NEEDS = "the model being trained, an nn.Module (not the LightningModule itself)"
CAUSAL_LM_NEEDS = ("a Hugging Face causal LM: an nn.Module with `generate`, called with input_ids and attention_mask "
                   "and returning logits (a transformers PreTrainedModel, or a peft model of one)")
EXPORTABLE_NEEDS = ("a Hugging Face model with `save_pretrained` (a transformers PreTrainedModel, or a peft model "
                    "of one)")
REFERENCE_NEEDS = "an nn.Module with the policy's parameter layout, or None for no reference (beta = 0)"
TOKENIZER_NEEDS = "a Hugging Face tokenizer (callable on text, with `decode` and an eos_token)"
ENGINE_NEEDS = ("a lit_grpo.engines.base.RolloutEngine (subclass it: generate, load_weights, synced_step, "
                "state_dict, load_state_dict)")
#: the protocol's own names, never suggested as a misnaming of another
PROTOCOL_NAMES = ("policy", "reference", "reference_version", "tokenizer", "rollout_engine")
_MISSING = object()


class ProtocolError(TypeError):
    """A LightningModule (or trainer) lacks what a callback reads. The message is one line: the callback, the
    attribute, the module's class, what the attribute must be, and a similarly named attribute when there is one."""


@runtime_checkable
class HasPolicy(Protocol):
    """Every callback: ``policy``, the model being trained (:data:`POLICY_NEEDS`)."""

    policy: nn.Module


@runtime_checkable
class HasReference(Protocol):
    """``RefModelSwap``: ``reference``, pi_ref (:data:`REFERENCE_NEEDS`). An ``int`` ``reference_version``, when
    the module has one, counts the swaps."""

    reference: nn.Module | None


@runtime_checkable
class HasTokenizer(Protocol):
    """``GSM8KPassAtK``: ``tokenizer`` (:data:`TOKENIZER_NEEDS`)."""

    tokenizer: Any


@runtime_checkable
class CausalLM(Protocol):
    """The policy as ``GSM8KPassAtK`` samples from it (``lit_grpo.engines.TransformersEngine`` borrowing it): called
    with ``input_ids``, ``attention_mask`` and a KV cache, returning ``.logits``; ``generate`` on the static-cache
    path."""

    def __call__(self, *args: Any, **kwargs: Any) -> Any: ...

    def generate(self, *args: Any, **kwargs: Any) -> Any: ...


@runtime_checkable
class Exportable(Protocol):
    """The policy as ``HFExport`` writes it: ``save_pretrained(dirpath, state_dict=...)``."""

    def save_pretrained(self, *args: Any, **kwargs: Any) -> Any: ...


def _module_name(pl_module: object) -> str:
    return type(pl_module).__name__


def _attribute(owner: object, name: str) -> Any:
    """``owner.name``, or ``_MISSING`` when it has no such attribute."""
    return getattr(owner, name, _MISSING)


def _is_tokenizer(value: object) -> bool:
    return callable(value) and hasattr(value, "decode")


def misnamed(pl_module: object, expected: str, accept: Callable[[Any], bool]) -> str | None:
    """The attribute of ``pl_module`` that most likely holds what ``expected`` should (a value ``accept`` takes, not
    under a protocol name), or ``None``. A reference is looked for under names with "ref", a policy under names
    without it; then the name closest in spelling wins."""
    candidates = dict(getattr(pl_module, "_modules", {}) or {})
    candidates.update({k: v for k, v in vars(pl_module).items() if not k.startswith("_")})
    names = [n for n, v in candidates.items() if n not in PROTOCOL_NAMES and v is not None and accept(v)]
    if not names:
        return None

    def rank(name: str) -> tuple[bool, float]:
        has_ref = "ref" in name.lower()
        return (has_ref if expected == "reference" else not has_ref,
                difflib.SequenceMatcher(None, expected, name.lower()).ratio())

    return max(names, key=rank)


def missing_error(owner: str, pl_module: object, name: str, needs: str,
                  accept: Callable[[Any], bool]) -> ProtocolError:
    """The one-line error for a module without attribute ``name``, pointing at a likely misnaming."""
    message = f"{owner}: {_module_name(pl_module)} has no attribute `{name}`; expected `{name}`: {needs}"
    guess = misnamed(pl_module, name, accept)
    if guess is not None:
        message += f" -- found `{guess}`, did you mean to name it `{name}`?"
    return ProtocolError(message)


def wrong_type_error(owner: str, pl_module: object, name: str, value: object, needs: str) -> ProtocolError:
    return ProtocolError(f"{owner}: {_module_name(pl_module)}.{name} is a {type(value).__name__}; "
                         f"expected `{name}`: {needs}")


def require_policy(owner: str, pl_module: object, needs: str = POLICY_NEEDS,
                   protocol: type | None = None) -> nn.Module:
    """``pl_module.policy``, checked to be an ``nn.Module`` other than the module itself (and an instance of
    ``protocol``, when given); a :class:`ProtocolError` otherwise."""
    policy = _attribute(pl_module, "policy")
    if policy is _MISSING:
        raise missing_error(owner, pl_module, "policy", needs, lambda v: isinstance(v, nn.Module))
    if policy is pl_module:
        raise ProtocolError(f"{owner}: {_module_name(pl_module)}.policy is the LightningModule itself; expected "
                            f"`policy`: {needs}")
    if not isinstance(policy, nn.Module) or (protocol is not None and not isinstance(policy, protocol)):
        raise wrong_type_error(owner, pl_module, "policy", policy, needs)
    return policy


def policy_of(pl_module: object, owner: str = "lit_grpo.callbacks") -> nn.Module:
    """The module's ``policy`` (see :func:`require_policy`); there is no fallback to the module itself."""
    return require_policy(owner, pl_module)


def require_tokenizer(owner: str, pl_module: object) -> Any:
    """``pl_module.tokenizer``, checked to look like a Hugging Face tokenizer with an eos token."""
    tokenizer = _attribute(pl_module, "tokenizer")
    if tokenizer is _MISSING:
        raise missing_error(owner, pl_module, "tokenizer", TOKENIZER_NEEDS, _is_tokenizer)
    if not _is_tokenizer(tokenizer):
        raise wrong_type_error(owner, pl_module, "tokenizer", tokenizer, TOKENIZER_NEEDS)
    if getattr(tokenizer, "eos_token_id", None) is None:
        raise ProtocolError(f"{owner}: {_module_name(pl_module)}.tokenizer ({type(tokenizer).__name__}) has no "
                            f"eos_token; expected `tokenizer`: {TOKENIZER_NEEDS}, so that completions can end")
    return tokenizer


def layout_mismatch(policy: nn.Module, reference: nn.Module) -> str | None:
    """The first difference between the two modules' parameter names and shapes (wrapper prefixes removed), or
    ``None`` when they have the same layout, as ``RefModelSwap`` needs to copy one into the other."""
    ours = [(strip_wrapper_prefixes(n), tuple(p.shape)) for n, p in policy.named_parameters()]
    theirs = [(strip_wrapper_prefixes(n), tuple(p.shape)) for n, p in reference.named_parameters()]
    for (name, shape), (ref_name, ref_shape) in zip(ours, theirs):
        if name != ref_name:
            return f"parameter `{name}` of the policy is `{ref_name}` in the reference"
        if shape != ref_shape:
            return f"parameter `{name}` has shape {list(shape)} in the policy but {list(ref_shape)} in the reference"
    if len(ours) != len(theirs):
        longer, extra = ("policy", ours[len(theirs)][0]) if len(ours) > len(theirs) else \
            ("reference", theirs[len(ours)][0])
        return (f"the policy has {len(ours)} parameters and the reference {len(theirs)} "
                f"(the {longer}'s `{extra}` has no counterpart)")
    return None


def check_ref_swap(pl_module: object, owner: str = "RefModelSwap") -> nn.Module | None:
    """``RefModelSwap``'s protocol (:class:`HasPolicy`, :class:`HasReference`): the policy, and the reference,
    present as an attribute (``None`` is the explicit "no reference"), an ``nn.Module`` with the policy's layout.
    Returns the reference."""
    policy = require_policy(owner, pl_module)
    reference = _attribute(pl_module, "reference")
    if reference is _MISSING:
        raise missing_error(owner, pl_module, "reference", REFERENCE_NEEDS, lambda v: isinstance(v, nn.Module))
    version = _attribute(pl_module, "reference_version")
    if version is not _MISSING and (isinstance(version, bool) or not isinstance(version, int)):
        raise wrong_type_error(owner, pl_module, "reference_version", version,
                               "an int counting the swaps (or no such attribute)")
    if reference is None:
        return None
    if not isinstance(reference, nn.Module):
        raise wrong_type_error(owner, pl_module, "reference", reference, REFERENCE_NEEDS)
    if reference is policy:
        raise ProtocolError(f"{owner}: {_module_name(pl_module)}.reference is the policy itself; expected "
                            f"`reference`: a separate copy ({REFERENCE_NEEDS})")
    mismatch = layout_mismatch(policy, reference)
    if mismatch is not None:
        raise ProtocolError(f"{owner}: {_module_name(pl_module)}.reference does not have the policy's parameter "
                            f"layout: {mismatch}; expected `reference`: {REFERENCE_NEEDS}")
    return reference


def check_pass_at_k(pl_module: object, owner: str = "GSM8KPassAtK") -> None:
    """``GSM8KPassAtK``'s protocol: a causal-LM policy (:class:`CausalLM`) and a tokenizer (:class:`HasTokenizer`)."""
    require_policy(owner, pl_module, CAUSAL_LM_NEEDS, CausalLM)
    require_tokenizer(owner, pl_module)


def check_hf_export(pl_module: object, owner: str = "HFExport") -> None:
    """``HFExport``'s protocol: a policy with ``save_pretrained`` (:class:`Exportable`); a tokenizer, when the
    module has one that is not ``None``, with ``save_pretrained`` too."""
    require_policy(owner, pl_module, EXPORTABLE_NEEDS, Exportable)
    tokenizer = getattr(pl_module, "tokenizer", None)
    if tokenizer is not None and not isinstance(tokenizer, Exportable):
        raise wrong_type_error(owner, pl_module, "tokenizer", tokenizer,
                               "a Hugging Face tokenizer with `save_pretrained`, or None (nothing saved)")


def engine_of(trainer: L.Trainer, pl_module: object, explicit: RolloutEngine | None = None,
              owner: str = "WeightSync") -> RolloutEngine:
    """The rollout engine: ``explicit`` (passed to the callback), else ``trainer.datamodule.rollout_engine``, else
    ``pl_module.rollout_engine``; a :class:`ProtocolError` when there is none or it is not a ``RolloutEngine``."""
    where, engine = "engine", explicit
    if engine is None:
        datamodule = getattr(trainer, "datamodule", None)
        for owner_object in (datamodule, pl_module):
            engine = getattr(owner_object, "rollout_engine", None)
            if engine is not None:
                where = f"{type(owner_object).__name__}.rollout_engine"
                break
    if engine is None:
        raise ProtocolError(f"{owner}: no rollout engine; expected {ENGINE_NEEDS}, passed as {owner}(engine=...) or "
                            f"exposed as `rollout_engine` on the data module (RolloutDataModule has one) or on "
                            f"{_module_name(pl_module)}")
    if not isinstance(engine, RolloutEngine):
        raise ProtocolError(f"{owner}: {where} is a {type(engine).__name__}; expected {ENGINE_NEEDS}")
    return engine


def check_weight_sync(trainer: L.Trainer, pl_module: object, explicit: RolloutEngine | None = None,
                      owner: str = "WeightSync") -> RolloutEngine:
    """``WeightSync``'s protocol: the policy (:class:`HasPolicy`) and a rollout engine (:func:`engine_of`).
    Returns the engine."""
    require_policy(owner, pl_module)
    return engine_of(trainer, pl_module, explicit, owner)


def refuse_second(callback: object, callbacks: Iterable[object], kind: type) -> None:
    """A ``ValueError`` in one line when ``callbacks`` (the trainer's) hold another ``kind`` than ``callback``: two
    ``WeightSync`` would push twice and count syncs apart, two ``RefModelSwap`` would swap pi_ref on two clocks.
    (Two with the same ``state_key`` are refused earlier, by Lightning, when the trainer is made.)"""
    count = sum(isinstance(c, kind) for c in callbacks if c is not callback) + 1
    if count > 1:
        name = kind.__name__
        raise ValueError(f"{name}: the trainer has {count} {name} callbacks; expected one (remove the extra "
                         f"{name} from the trainer's callbacks)")


def full_named_tensors(module: nn.Module) -> FullParameters:
    """Full (unsharded) parameters by their model names. Sharded (FSDP2 DTensor) parameters are gathered one at a
    time and FSDP1 modules inside ``summon_full_params``, which every rank must do together; plain modules hand out
    their tensors without a copy. Wrapper prefixes (``_fsdp_wrapped_module.`` ...) are stripped.

    The iterator names its module (``FullParameters.module``): an engine that gathers more cheaply may use the
    module instead of iterating (the rollout server's push gathers FSDP2 shards to rank 0 only,
    ``lit_grpo.engines.remote.weight_gather.rank0_buckets``). Nothing is gathered until the first item is asked for."""
    return full_named_parameters(module)


def shares_policy(engine: RolloutEngine, pl_module: object, owner: str = "WeightSync") -> bool:
    """Whether ``engine`` samples from the module's policy itself (``shares_policy``: ``data.engine_options.weights``
    ``shared``), so that a push would copy the policy onto itself. A ``ProtocolError`` when it says so of a model
    that is not the module's ``policy`` (the policy was replaced after the engine was built)."""
    if not getattr(engine, "shares_policy", False):
        return False
    if getattr(engine, "model", None) is not policy_of(pl_module, owner):
        raise ProtocolError(f"{owner}: the rollout engine shares_policy but samples from another model than "
                            f"{_module_name(pl_module)}.policy; expected the policy itself, or "
                            "data.engine_options.weights: copy")
    return True
