"""LoRA adapters on the policy (``model.lora``), through peft: build them, read and write them, merge them into the
base, and the pieces a sampler needs to follow the trainer (no Lightning here).

Why LoRA fits the paper's method (Mroueh et al., Algorithm 1):

- pi_ref is the policy with its adapter switched off: no second copy of the model (``GRPOModule`` builds none);
- the stage swap (line 16, pi_ref <- pi_theta) is "merge the adapter into the base, start a fresh adapter"
  (:func:`swap_reference_by_merge`): after it pi_ref (adapter off = the merged base) equals the policy (merged base
  plus an adapter with B = 0);
- a weight push (lines 8-9) sends the adapter, plus the merges the sampler has not applied yet, so that its base
  follows the trainer's (:func:`adapter_update`, checked by :func:`base_hash`).

Names: adapters travel under peft's saved names (``get_peft_model_state_dict``: ``base_model.model.<hf module>.
lora_A.weight``); base weights and merged full weights under the plain model's names (``model.layers.0...``).

Sharded policies: the functions that read or write full tensors (:func:`adapter_state`, :func:`base_hash`,
:func:`merge_adapter_into_base`, :func:`reset_adapter`, :func:`merged_named_tensors`) are collectives under FSDP2
(``full_tensor`` per tensor, in the same order on every rank) and FSDP1 (``summon_full_params``): every rank calls
them together. peft is imported by the functions that use it, so that parsing ``model.lora`` stays cheap.
"""

from __future__ import annotations

import contextlib
import hashlib
import math
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import nn

from lit_grpo.core.distributed import all_gather_objects, is_fsdp1, strip_wrapper_prefixes

ADAPTER = "default"  # peft's name of the one adapter a policy carries
PEFT_PREFIX = "base_model.model."  # what peft puts before the plain model's names
#: the linear projections of attention and MLP in the model families transformers ships (Llama / Qwen / Mistral /
#: SmolLM, GPT-2's Conv1D, GPT-NeoX, Falcon, Phi, OPT, BLOOM): the default targets are those present in the model
ATTENTION_MLP_PROJECTIONS = (
    "q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj",
    "c_attn", "c_proj", "c_fc", "query_key_value", "dense", "dense_h_to_4h", "dense_4h_to_h",
    "out_proj", "fc1", "fc2", "qkv_proj", "gate_up_proj", "w1", "w2", "w3",
)


@dataclass(frozen=True)
class LoraArgs:
    """LoRA adapters on the policy (``model.lora`` in a config; ``--model.lora '{"r": 8}'`` on the command line).

    Each targeted linear layer W gets ``W + (alpha / r) * B @ A``, A ``[r, in]`` and B ``[out, r]`` trained, W frozen
    (Hu et al., LoRA, eq. 3 with peft's scaling alpha / r).

    Args:
        r: the adapters' rank.
        alpha: the scale's numerator: the update is ``(alpha / r) * B @ A``.
        dropout: dropout on the adapter's input in the gradient pass (0: none; the policy's own dropout stays off).
            Every scoring pass runs without it (pi_k, the TV monitors, pi_ref, the samplers), and the loss gets the
            dropout-free values with the dropout pass's gradient (``lit_grpo.core.scoring.policy_logprobs``), so the
            ratio pi / alpha stays exactly 1 at v = 1, i = 1; it costs one more no-grad forward per micro-batch.
        target_modules: the module names (last part, e.g. ``q_proj``) that get an adapter; None: every linear
            projection of attention and MLP found in the model (not the embeddings nor ``lm_head``).
    """

    r: int = 16
    alpha: float = 32.0
    dropout: float = 0.0
    target_modules: list[str] | None = None

    def __post_init__(self) -> None:
        if isinstance(self.r, bool) or not isinstance(self.r, int) or self.r < 1:
            raise ValueError(f"lora.r must be an integer >= 1, got {self.r!r}")
        if isinstance(self.alpha, bool) or not isinstance(self.alpha, (int, float)) or not (
                math.isfinite(self.alpha) and self.alpha > 0):
            raise ValueError(f"lora.alpha must be a finite number > 0, got {self.alpha!r}")
        if isinstance(self.dropout, bool) or not isinstance(self.dropout, (int, float)) or not 0 <= self.dropout < 1:
            raise ValueError(f"lora.dropout must be a number in [0, 1), got {self.dropout!r}")
        targets = self.target_modules
        if targets is not None and (isinstance(targets, str) or not targets
                                    or not all(isinstance(t, str) and t for t in targets)):
            raise ValueError(f"lora.target_modules must be a non-empty list of module names (or null: every "
                             f"attention and MLP projection), got {targets!r}")

    @property
    def scale(self) -> float:
        """alpha / r, the factor of B @ A."""
        return self.alpha / self.r


# ---- building ------------------------------------------------------------------------------------------
def linear_module_names(model: nn.Module) -> list[str]:
    """The last name parts of the model's linear layers (``nn.Linear`` and transformers' ``Conv1D``), in the order
    they first appear, without the output embeddings (``lm_head``)."""
    from transformers.pytorch_utils import Conv1D

    output = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
    names: list[str] = []
    for name, module in model.named_modules():
        if isinstance(module, (nn.Linear, Conv1D)) and module is not output:
            leaf = name.rpartition(".")[2]
            if leaf not in names:
                names.append(leaf)
    return names


def resolve_target_modules(model: nn.Module, targets: list[str] | None) -> list[str]:
    """``targets`` checked against the model's linear layers, or (None) its attention and MLP projections.

    Raises ValueError naming a target that matches no linear layer, and the names available."""
    available = linear_module_names(model)
    if targets is None:
        found = [name for name in available if name in ATTENTION_MLP_PROJECTIONS]
        if not found:
            raise ValueError(f"lora.target_modules=null finds no attention or MLP projection in "
                             f"{type(model).__name__}; name them, among its linear layers {available}")
        return found
    unknown = [t for t in targets if t not in available]
    if unknown:
        raise ValueError(f"lora.target_modules {unknown} match no linear layer of {type(model).__name__}; "
                         f"expected among {available}")
    return list(targets)


def apply_lora(model: nn.Module, args: LoraArgs) -> nn.Module:
    """``model`` (a transformers causal LM) with a LoRA adapter of ``args`` on its target modules: a peft
    ``PeftModel`` whose base weights are frozen. A is drawn with peft's init from the torch RNG (so a seeded run
    builds the same adapter), B = 0 (the policy starts as the model). The policy carries its :class:`MergeLog`."""
    from peft import LoraConfig, TaskType, get_peft_model

    config = LoraConfig(r=args.r, lora_alpha=args.alpha, lora_dropout=args.dropout, bias="none",
                        target_modules=resolve_target_modules(model, args.target_modules),
                        task_type=TaskType.CAUSAL_LM)
    peft_model = get_peft_model(model, config)
    peft_model.lit_grpo_merge_log = MergeLog()
    return peft_model


def peft_model_of(model: nn.Module) -> nn.Module:
    """The peft model inside ``model`` (itself, or under a DDP / FSDP1 / compile wrapper). Raises ValueError if
    there is none."""
    from peft import PeftModel

    seen = model
    while not isinstance(seen, PeftModel):
        inner = getattr(seen, "module", None) or getattr(seen, "_orig_mod", None)
        if not isinstance(inner, nn.Module):
            raise ValueError(f"expected a peft model with a LoRA adapter (model.lora), got {type(model).__name__}")
        seen = inner
    return seen


def is_lora(model: nn.Module) -> bool:
    """Whether ``model`` carries LoRA adapters (a peft model, also under DDP / FSDP wrappers)."""
    try:
        from peft.tuners.lora import LoraLayer
    except ImportError:  # no peft installed: no model can carry its adapters
        return False
    return any(isinstance(m, LoraLayer) for m in model.modules())


def merge_log(model: nn.Module) -> MergeLog:
    """The policy's :class:`MergeLog` (made by :func:`apply_lora`)."""
    peft_model = peft_model_of(model)
    log = peft_model.__dict__.get("lit_grpo_merge_log")
    if log is None:
        log = peft_model.__dict__["lit_grpo_merge_log"] = MergeLog()
    return log


def lora_spec(model: nn.Module) -> dict[str, Any]:
    """What a sampler needs to build the same adapter structure: ``r``, ``alpha``, ``target_modules`` (resolved,
    sorted) and ``dropout`` (0: sampling never drops), a JSON-able dict whose keys are :class:`LoraArgs`' fields,
    so ``apply_lora(model, LoraArgs(**spec))`` rebuilds it."""
    config = peft_model_of(model).peft_config[ADAPTER]
    return {"r": int(config.r), "alpha": float(config.lora_alpha), "dropout": 0.0,
            "target_modules": sorted(config.target_modules)}


# ---- reading and writing full tensors (collectives under FSDP) ------------------------------------------
@contextlib.contextmanager
def _full_view(model: nn.Module, writeback: bool) -> Iterator[None]:
    """FSDP1 shows full parameters only inside ``summon_full_params``; FSDP2 and plain models need nothing."""
    if is_fsdp1(model):
        from torch.distributed.fsdp import FullyShardedDataParallel

        with FullyShardedDataParallel.summon_full_params(model, writeback=writeback):
            yield
    else:
        yield


def _full(tensor: torch.Tensor) -> torch.Tensor:
    """The full tensor of an FSDP2 shard (an all-gather every rank makes), else the tensor."""
    return tensor.full_tensor() if hasattr(tensor, "full_tensor") else tensor


def _write_full(param: torch.Tensor, full: torch.Tensor) -> None:
    """Write the full tensor ``full`` into ``param``: its own shard of it for an FSDP2 parameter (no
    communication: every rank holds ``full``), the whole of it otherwise."""
    with torch.no_grad():
        if hasattr(param, "full_tensor"):
            from torch.distributed.tensor import distribute_tensor

            local = distribute_tensor(full.to(param.dtype), param.device_mesh, param.placements, src_data_rank=None)
            param.to_local().copy_(local.to_local())
        else:
            param.copy_(full)


def _lora_layers(model: nn.Module) -> list[tuple[str, nn.Module]]:
    """``(peft module name, layer)`` of every LoRA layer, in module order (the one fixed order of every merge)."""
    from peft.tuners.lora import LoraLayer

    layers = [(strip_wrapper_prefixes(name), module) for name, module in model.named_modules()
              if isinstance(module, LoraLayer)]
    if not layers:
        raise ValueError(f"expected a peft model with LoRA adapters (model.lora), got {type(model).__name__} "
                         "without any")
    return layers


def _adapter_params(layer: nn.Module) -> tuple[nn.Parameter, nn.Parameter]:
    return layer.lora_A[ADAPTER].weight, layer.lora_B[ADAPTER].weight


def adapter_names(model: nn.Module) -> list[str]:
    """peft's saved names of the adapter tensors, in module order: A then B of each LoRA layer."""
    return [f"{name}.{part}.weight" for name, _ in _lora_layers(model) for part in ("lora_A", "lora_B")]


def adapter_parameters(model: nn.Module) -> list[nn.Parameter]:
    """The adapter parameters (the trainable ones), in the order of :func:`adapter_names`."""
    return [p for _, layer in _lora_layers(model) for p in _adapter_params(layer)]


@torch.no_grad()
def adapter_state(model: nn.Module) -> dict[str, torch.Tensor]:
    """The adapter tensors under peft's saved names (``get_peft_model_state_dict``'s), full, detached copies on the
    CPU in the policy's dtype. A collective under FSDP: every rank calls it."""
    out = {}
    with _full_view(model, writeback=False):
        for name, layer in _lora_layers(model):
            for part, param in zip(("lora_A", "lora_B"), _adapter_params(layer)):
                out[f"{name}.{part}.weight"] = _full(param).detach().to("cpu", copy=True)
    return out


def _check_adapter(model: nn.Module, tensors: dict[str, torch.Tensor], what: str) -> None:
    """One-line errors for a missing, unknown or mis-shaped adapter tensor, before anything is written."""
    expected = {}
    for name, layer in _lora_layers(model):
        for part, param in zip(("lora_A", "lora_B"), _adapter_params(layer)):
            shape = param.shape if not hasattr(param, "full_tensor") else param.size()
            expected[f"{name}.{part}.weight"] = torch.Size(shape)
    missing = [k for k in expected if k not in tensors]
    unknown = [k for k in tensors if k not in expected]
    if missing or unknown:
        raise ValueError(f"{what} does not fit the model's adapter: "
                         + (f"missing {missing[0]!r} ({len(missing)} in all)" if missing else "")
                         + ("; " if missing and unknown else "")
                         + (f"unknown {unknown[0]!r} ({len(unknown)} in all)" if unknown else ""))
    for key, shape in expected.items():
        if tuple(tensors[key].shape) != tuple(shape):
            raise ValueError(f"{what}[{key!r}] has shape {list(tensors[key].shape)}, the model's adapter "
                             f"{list(shape)}")


@torch.no_grad()
def load_adapter_state(model: nn.Module, tensors: dict[str, torch.Tensor]) -> None:
    """Copy adapter tensors (peft's saved names, as :func:`adapter_state` gives them) into the model's adapter,
    exactly. Raises ValueError on a missing, unknown or mis-shaped name, before any is written."""
    _check_adapter(model, tensors, "adapter")
    with _full_view(model, writeback=True):
        for name, layer in _lora_layers(model):
            for part, param in zip(("lora_A", "lora_B"), _adapter_params(layer)):
                _write_full(param, tensors[f"{name}.{part}.weight"].to(param.device))


def lora_delta(a: torch.Tensor, b: torch.Tensor, scale: float, fan_in_fan_out: bool,
               dtype: torch.dtype) -> torch.Tensor:
    """LoRA's weight update ``scale * B @ A`` (Hu et al., eq. 3; scale = alpha / r), in ``dtype`` and laid out like
    the base weight (transposed for GPT-2's ``Conv1D``, whose weight is ``[in, out]``). One fixed order of operations,
    so equal inputs give bitwise-equal deltas in any process."""
    delta = (b.to(dtype) @ a.to(dtype)) * scale
    return delta.T if fan_in_fan_out else delta


@torch.no_grad()
def merge_adapter_into_base(model: nn.Module,
                            adapter: dict[str, torch.Tensor] | None = None) -> dict[str, torch.Tensor]:
    """Base weight of every LoRA layer ``+= (alpha / r) * B @ A`` (:func:`lora_delta`), with ``adapter`` (peft's
    saved names) or, when None, the model's current adapter, in module order. Returns the merged adapter tensors
    (full, on the CPU). The adapter itself is left as it is (:func:`reset_adapter` starts a fresh one). Two
    processes merging equal adapters into equal bases get bitwise-equal bases. A collective under FSDP."""
    if adapter is not None:
        _check_adapter(model, adapter, "merged adapter")
    merged = adapter_state(model) if adapter is None else {k: v.detach().to("cpu", copy=True)
                                                          for k, v in adapter.items()}
    with _full_view(model, writeback=True):
        for name, layer in _lora_layers(model):
            weight = layer.get_base_layer().weight
            base = _full(weight)
            delta = lora_delta(merged[f"{name}.lora_A.weight"].to(base.device),
                               merged[f"{name}.lora_B.weight"].to(base.device),
                               layer.scaling[ADAPTER], bool(getattr(layer, "fan_in_fan_out", False)), base.dtype)
            _write_full(weight, base + delta)
    return merged


@torch.no_grad()
def reset_adapter(model: nn.Module) -> None:
    """A fresh adapter: B = 0 and A redrawn with peft's default init (Kaiming-uniform, a = sqrt(5)), so the policy's
    function is unchanged. A comes from its own generator, seeded by the run's torch seed (``torch.initial_seed``,
    rank 0's) and the number of merges so far: every rank draws the same A, and a resumed run the A of the run it
    continues, whatever else drew from the global RNG meanwhile (building a sampler's copy on resume does)."""
    key = f"{torch.initial_seed()}:{len(merge_log(model))}".encode()
    seed = int.from_bytes(hashlib.sha256(key).digest()[:8], "little") >> 1
    seed = int(all_gather_objects(seed)[0])  # rank 0's, so sharded and replicated ranks agree
    generator = torch.Generator().manual_seed(seed)
    with _full_view(model, writeback=True):
        for _, layer in _lora_layers(model):
            a, b = _adapter_params(layer)
            fresh_a = torch.empty(tuple(a.size()), dtype=torch.float32)
            nn.init.kaiming_uniform_(fresh_a, a=math.sqrt(5), generator=generator)
            _write_full(a, fresh_a.to(a.device, a.dtype))
            _write_full(b, torch.zeros(tuple(b.size()), dtype=b.dtype, device=b.device))


def plain_name(name: str) -> str:
    """A peft base parameter's name as the plain model names it (``base_model.model.`` and ``.base_layer`` gone)."""
    return strip_wrapper_prefixes(name).removeprefix(PEFT_PREFIX).replace(".base_layer.", ".")


def _base_parameters(model: nn.Module) -> list[tuple[str, torch.Tensor]]:
    """The base (non-adapter) parameters under the plain model's names, in module order."""
    return [(plain_name(name), p) for name, p in model.named_parameters() if ".lora_" not in name]


@torch.no_grad()
def base_hash(model: nn.Module) -> str:
    """sha256 over the base (non-adapter) parameters, in name order (the plain model's names), each as its name,
    dtype, shape and the bytes of its full tensor. Equal bases give equal hashes. A collective under FSDP."""
    digest = hashlib.sha256()
    with _full_view(model, writeback=False):
        for name, param in sorted(_base_parameters(model), key=lambda item: item[0]):
            full = _full(param).detach().to("cpu").contiguous()
            digest.update(f"{name}|{full.dtype}|{list(full.shape)}|".encode())
            digest.update(full.reshape(-1).view(torch.uint8).numpy().tobytes())
    return digest.hexdigest()


def merged_named_tensors(model: nn.Module) -> Iterator[tuple[str, torch.Tensor]]:
    """The policy as a plain model's full weights: ``W + (alpha / r) * B @ A`` for each LoRA layer, the other
    weights as they are, under the plain model's names, one at a time (a push to an engine that takes no adapters).
    The policy is not changed. A collective under FSDP: every rank iterates it to the end."""
    with torch.no_grad(), _full_view(model, writeback=False):
        layers = {id(layer.get_base_layer().weight): layer for _, layer in _lora_layers(model)}
        for name, param in _base_parameters(model):
            full = _full(param).detach()
            layer = layers.get(id(param))
            if layer is not None:
                a, b = (_full(p).detach().to(full.device) for p in _adapter_params(layer))
                full = full + lora_delta(a, b, layer.scaling[ADAPTER], bool(getattr(layer, "fan_in_fan_out", False)),
                                         full.dtype)
            yield name, full


def parameter_bytes(model: nn.Module) -> int:
    """Bytes of the weights a full push sends: every parameter but the adapters (a LoRA policy sends its merged
    view, of the base's shapes), tied ones once, FSDP2 shards at their full size. A collective under FSDP1."""
    with _full_view(model, writeback=False):
        return sum(p.numel() * p.element_size() for name, p in model.named_parameters() if ".lora_" not in name)


# ---- the stage swap and the push --------------------------------------------------------------------
class MergeLog:
    """The adapters merged into the base so far, oldest first (``entries``, peft's saved names, on the CPU). A
    sampler that has applied ``n`` of them gets ``entries[n:]`` at its next push and applies them in order with
    :func:`merge_adapter_into_base`, so its base follows the trainer's. Kept in checkpoints (``state_dict``)."""

    def __init__(self) -> None:
        self.entries: list[dict[str, torch.Tensor]] = []

    def __len__(self) -> int:
        return len(self.entries)

    def append(self, adapter: dict[str, torch.Tensor]) -> None:
        self.entries.append({k: v.detach().to("cpu", copy=True) for k, v in adapter.items()})

    def state_dict(self) -> dict[str, Any]:
        return {"entries": [dict(entry) for entry in self.entries]}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        entries = state.get("entries") if isinstance(state, dict) else None
        if not isinstance(entries, list) or not all(isinstance(e, dict) for e in entries):
            raise ValueError(f"a LoRA merge log's state must be {{'entries': [dict of tensors, ...]}}, "
                             f"got {type(state).__name__}")
        self.entries = [dict(entry) for entry in entries]


@dataclass(frozen=True)
class AdapterUpdate:
    """One LoRA push (``model.lora``): what a sampler holding the same base and a LoRA adapter of the same ``spec``
    needs to sample from the policy. The sampler applies ``merges`` to its base in order (each one the adapter a
    ``RefModelSwap`` merged into the trainer's base, with ``lit_grpo.models.lora.merge_adapter_into_base``), checks its
    base against ``base_hash`` when it is given (sent at the first push of a fit and with every merge), then loads
    ``adapter``. Tensors travel in the dtype of a full push (the policy's), under peft's saved names.

    Attributes:
        spec: ``lit_grpo.models.lora.lora_spec`` of the policy (r, alpha, target modules): the adapter's structure.
        merges: the merged adapters the engine has not applied yet, oldest first.
        adapter: the policy's current adapter tensors.
        base_hash: ``lit_grpo.models.lora.base_hash`` of the trainer's base after ``merges``, or ``None`` (not checked).
        step: the optimizer step of the policy the adapter belongs to.
    """

    spec: dict[str, Any]
    merges: tuple[dict[str, torch.Tensor], ...]
    adapter: dict[str, torch.Tensor]
    base_hash: str | None
    step: int

    def __post_init__(self) -> None:
        if not isinstance(self.spec, dict) or not self.spec:
            raise ValueError(f"AdapterUpdate.spec must be the non-empty dict of lora_spec, got {self.spec!r}")
        if not isinstance(self.merges, tuple):
            raise ValueError(f"AdapterUpdate.merges must be a tuple of adapter dicts, got {type(self.merges).__name__}")
        for what, tensors in [("adapter", self.adapter)] + [(f"merges[{i}]", m) for i, m in enumerate(self.merges)]:
            if not isinstance(tensors, dict) or not tensors:
                raise ValueError(f"AdapterUpdate.{what} must be a non-empty dict of tensors")
            bad = [name for name, t in tensors.items() if not isinstance(t, torch.Tensor)]
            if bad:
                raise ValueError(f"AdapterUpdate.{what}[{bad[0]!r}] is a {type(tensors[bad[0]]).__name__}, "
                                 "expected a tensor")
        if self.base_hash is not None and not isinstance(self.base_hash, str):
            raise ValueError(f"AdapterUpdate.base_hash must be a hex string or None, got {self.base_hash!r}")
        if isinstance(self.step, bool) or not isinstance(self.step, int) or self.step < 0:
            raise ValueError(f"AdapterUpdate.step must be an integer >= 0, got {self.step!r}")

    @property
    def nbytes(self) -> int:
        """Bytes of the tensors it carries (adapter and merges): ``sync/bytes`` of a LoRA push."""
        return sum(t.numel() * t.element_size() for tensors in (self.adapter, *self.merges) for t in tensors.values())


@torch.no_grad()
def swap_reference_by_merge(policy: nn.Module, optimizers: list[torch.optim.Optimizer]) -> None:
    """Algorithm 1, line 16 (pi_ref <- pi_theta) for a LoRA policy whose pi_ref is its adapter switched off: merge
    the adapter into the base (:func:`merge_adapter_into_base`), log the merge, start a fresh adapter (B = 0,
    :func:`reset_adapter`) and clear the adapter's optimizer state (its moments belong to the old adapter). After
    it, pi_ref = merged base = the policy. A collective under FSDP."""
    if hasattr(policy, "reshard"):  # FSDP2: every parameter in its sharded form before shards are written
        policy.reshard()
    merged = merge_adapter_into_base(policy)
    merge_log(policy).append(merged)
    reset_adapter(policy)
    params = adapter_parameters(policy)
    for optimizer in optimizers:
        for param in params:
            optimizer.state.pop(param, None)


def adapter_update(policy: nn.Module, merges_applied: int, with_hash: bool, step: int = 0) -> AdapterUpdate:
    """The LoRA push to an engine whose base holds ``merges_applied`` of the policy's merges: the merges it lacks,
    the current adapter, and the base's hash when ``with_hash`` or when merges travel. A collective under FSDP."""
    entries = merge_log(policy).entries
    valid = isinstance(merges_applied, int) and not isinstance(merges_applied, bool)
    if not valid or not 0 <= merges_applied <= len(entries):
        raise ValueError(f"the engine says it applied {merges_applied!r} merges; the policy has made {len(entries)} "
                         "(expected an integer between 0 and that): it follows another run's base")
    merges = tuple(entries[merges_applied:])
    digest = base_hash(policy) if with_hash or merges else None
    return AdapterUpdate(spec=lora_spec(policy), merges=merges, adapter=adapter_state(policy), base_hash=digest,
                         step=int(step))


# ---- export ----------------------------------------------------------------------------------------------
def cumulative_adapter(model: nn.Module) -> tuple[dict[str, Any], dict[str, torch.Tensor]]:
    """One adapter that, on the base the policy started from, gives the policy: the n merges so far and the current
    adapter stacked, ``sum_i s B_i A_i = s [B_1 .. B_n+1] @ [A_1; ..; A_n+1]``, a LoRA of rank ``r (n + 1)`` with
    alpha ``alpha (n + 1)`` (the same scale). Returns its spec (:func:`lora_spec`'s keys) and tensors. A collective
    under FSDP."""
    spec = lora_spec(model)
    adapters = [*merge_log(model).entries, adapter_state(model)]
    tensors = {}
    for key in adapters[-1]:
        dim = 0 if ".lora_A." in key else 1  # A is [r, in], B is [out, r]
        tensors[key] = torch.cat([adapter[key] for adapter in adapters], dim=dim)
    spec = {**spec, "r": spec["r"] * len(adapters), "alpha": spec["alpha"] * len(adapters)}
    return spec, tensors


def save_adapter(model: nn.Module, dirpath: str | Path, base_model: str | None = None) -> Path:
    """Write the policy's adapter in peft's format (``adapter_config.json``, ``adapter_model.safetensors``), as
    :func:`cumulative_adapter` makes it, so ``PeftModel.from_pretrained(base, dirpath)`` on the starting base gives
    the policy. ``base_model`` is recorded as the config's ``base_model_name_or_path``. Rank 0's job: gather first
    (:func:`cumulative_adapter`) on every rank under FSDP."""
    spec, tensors = cumulative_adapter(model)
    return write_adapter(spec, tensors, dirpath, base_model)


def write_adapter(spec: dict[str, Any], tensors: dict[str, torch.Tensor], dirpath: str | Path,
                  base_model: str | None = None) -> Path:
    """An adapter of :func:`lora_spec`'s ``spec`` and peft-named ``tensors`` written in peft's format."""
    from peft import LoraConfig, TaskType
    from safetensors.torch import save_file

    out = Path(dirpath).expanduser()
    out.mkdir(parents=True, exist_ok=True)
    config = LoraConfig(r=spec["r"], lora_alpha=spec["alpha"], lora_dropout=0.0, bias="none",
                        target_modules=list(spec["target_modules"]), task_type=TaskType.CAUSAL_LM,
                        base_model_name_or_path=base_model)
    config.save_pretrained(str(out))
    save_file({k: v.detach().cpu().contiguous() for k, v in tensors.items()}, str(out / "adapter_model.safetensors"))
    return out
