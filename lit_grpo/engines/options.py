"""The rollout engines' options, one typed group per ``data.engine`` kind, and the check of ``data.engine_options``.

``data.engine_options`` stays a mapping (``{url: ...}`` for a server, ``{compile: false}`` in process), checked
against the group of ``data.engine``: ``TransformersOptions``, ``VLLMOptions`` or ``ServerOptions``. An unknown key
or a value of the wrong type is a ``ValueError`` naming it, before any model loads. The command line documents each
group: ``python -m lit_grpo fit --data.engine_options.help ServerOptions``.
"""

from __future__ import annotations

import types
from collections.abc import Mapping
from dataclasses import dataclass, field, fields
from typing import Any, Literal, Union, get_args, get_origin, get_type_hints

from lit_grpo.core.option_groups import as_group

#: ``TransformersOptions.sampler_autocast`` -> the autocast dtype's name in torch
SAMPLER_AUTOCAST: dict[str, str] = {"bf16": "bfloat16", "fp16": "float16"}
#: ``ServerOptions.kept_weights_device``'s values
KEPT_WEIGHTS_DEVICES = ("trainer", "cpu")
#: ``TransformersOptions.weights``'s values
ENGINE_WEIGHTS = ("auto", "copy", "shared")


def check_max_num_seqs(value: object) -> None:
    """Refuse a ``max_num_seqs`` that is neither ``None`` nor an integer >= 1, in one line."""
    if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < 1):
        raise ValueError(f"max_num_seqs must be an integer >= 1 (sequences decoding at once) or null, got {value!r}")


@dataclass(frozen=True)
class TransformersOptions:
    """``data.engine: transformers``: a private copy of the policy in the trainer's process
    (``lit_grpo.engines.transformers_engine.TransformersEngine``).

    Args:
        rescore: the engine's log-probs are the trainer's function, so when it holds the policy's current weights
            alpha = pi_k and the trainer's first forward gives alpha's log-probs; lagging weights are re-scored in
            the padded micro-batches (the trainer's unless ``model.packing`` packs them). ``false``: the sampler's
            log-probs are alpha's.
        decode: ``auto`` (``static`` on CUDA with ``compile``, else ``dynamic``), ``static`` (transformers'
            ``generate`` with a fixed-shape cache) or ``dynamic`` (a growing KV cache, a seeded generator of its own).
        compile: compile the static path's decode step into CUDA graphs on a GPU (``false`` also makes ``auto``
            take the dynamic path).
        width_multiple: the static cache's width is a multiple of this many tokens (fewer recompilations).
        sampler_autocast: ``bf16`` (or ``fp16``): sample under ``torch.autocast`` of that dtype on the engine's
            device type, while ``score`` (alpha's recompute) keeps the trainer's precision. The sampler's log-probs
            (mu) then come from a lower-precision pass than alpha's and pi's: on a CPU, the stand-in for a bf16 vLLM
            against an fp32 trainer. It takes the dynamic decoding path (``decode: static`` is refused: that path
            samples outside any autocast). ``null`` (default): sample in the trainer's precision.
        max_num_seqs: on the dynamic path, at most this many sequences decode at once; a finished sequence's slot
            takes the next waiting one (continuous batching). ``null`` (default): all of a step's sequences start at
            once. Finished sequences leave the running batch either way.
        weights: what the engine samples with. ``copy``: a private copy of the policy's weights, which
            ``WeightSync`` loads every v batches. ``shared``: the policy itself (no second copy in memory; a push is
            skipped), allowed only when a copy would equal the policy whenever it samples: ``WeightSync`` with
            ``every_n_batches: 1`` and ``delay_batches: 0``, ``data.max_staleness: 0``, a strategy that does not
            shard the policy (one device or DDP) and a module that does not push weights itself. ``auto``
            (default): ``shared`` where allowed, else ``copy``. The samples are the same either way; ``shared``
            saves one copy of the weights (2 GB for a 0.5B model in float32).
    """

    rescore: bool = True
    decode: Literal["auto", "static", "dynamic"] = "auto"
    compile: bool = True
    width_multiple: int = 64
    sampler_autocast: Literal["bf16", "fp16"] | None = None
    max_num_seqs: int | None = None
    weights: Literal["auto", "copy", "shared"] = "auto"

    def __post_init__(self) -> None:
        check_max_num_seqs(self.max_num_seqs)
        if self.weights not in ENGINE_WEIGHTS:
            raise ValueError(f"weights must be one of {ENGINE_WEIGHTS}, got {self.weights!r}")
        if self.sampler_autocast is not None and (not isinstance(self.sampler_autocast, str)
                                                  or self.sampler_autocast not in SAMPLER_AUTOCAST):
            raise ValueError(f"sampler_autocast must be one of {sorted(SAMPLER_AUTOCAST)} or null, "
                             f"got {self.sampler_autocast!r}")
        if self.sampler_autocast is not None and self.decode == "static":
            raise ValueError(f"sampler_autocast={self.sampler_autocast!r} samples on the dynamic path (the static "
                             "cache samples outside autocast); expected decode 'auto' or 'dynamic', got 'static'")


@dataclass(frozen=True)
class VLLMOptions:
    """``data.engine: vllm``: vLLM in the trainer's process (``lit_grpo.engines.vllm_engine.VLLMEngine``). Any other
    key of ``data.engine_options`` is a ``vllm.LLM`` argument (``enforce_eager``, ``tensor_parallel_size``, ...) and
    goes to ``llm_kwargs``.

    Args:
        dtype: the weights' dtype inside vLLM.
        gpu_memory_utilization: the fraction of the GPU vLLM may take (weights and KV cache); the trainer needs the
            rest.
        max_model_len: the longest prompt + completion; ``null`` takes the model's.
        enable_sleep_mode: free vLLM's GPU memory between rollouts.
        seed: vLLM's engine seed (each batch's requests are seeded from the batch's own seed).
        lora_dir: with ``model.lora``, where the adapter versions pushed to vLLM are written (a fresh directory
            inside it, removed when the engine closes); ``null``: the system's temporary directory.
        llm_kwargs: further ``vllm.LLM`` arguments.
    """

    dtype: str = "bfloat16"
    gpu_memory_utilization: float = 0.3
    max_model_len: int | None = None
    enable_sleep_mode: bool = False
    seed: int = 0
    lora_dir: str | None = None
    llm_kwargs: dict[str, Any] = field(default_factory=dict)


@dataclass(frozen=True)
class ServerOptions:
    """``data.engine: server``: rollout servers over HTTP (``lit_grpo.engines.remote.client.ServerEngine``).

    Args:
        url: one server (``http://HOST:PORT``); give exactly one of ``url`` and ``urls``.
        urls: several servers: each step's prompts are spread over them; weights go to all. A multi-turn
            trajectory's group is a session: its first turn goes to the server with the fewest sequences of running
            sessions, its later turns to the same server.
        router_url: a router in front of the servers of ``url``/``urls`` (``vllm-router --policy
            sticky_least_loaded``, docs/rollout-server.md): completions go through it, one request per session (per
            prompt in single-turn rollouts) named in ``X-Session-ID`` and released with its ``/finish_session``;
            weight pushes, pause and resume still go to every server directly.
        token: the servers' bearer token; default ``$LIT_GRPO_SERVER_TOKEN``. Prefer the environment or
            ``token_file``: a config's values are saved with the run.
        token_file: a file holding the token.
        timeout_s: limit of every control call and of each bucket's transfer; keep it below the trainer's
            process-group timeout, since the other ranks wait in a gather while rank 0 sends a bucket.
        generate_timeout_s: limit of one completion request (and of waiting for a paused server).
        kind: ``lit_grpo`` (``python -m lit_grpo serve``) or ``vllm`` (``vllm serve`` 0.32 or 0.33 in dev mode).
        bucket_mb: size of the buckets rank 0 gathers, then sends (lit_grpo kind).
        backend: ``gloo`` (CPU) or ``nccl`` (GPU) for the weight transfer. Default: ``gloo`` for the project's
            server, ``nccl`` for vLLM (a CPU ``vllm serve`` takes ``gloo`` when started with
            ``--weight-transfer-config '{"backend": "gloo"}'``, see ``lit_grpo.wire.vllm_gloo``).
        transfer_address: this machine's address the server connects to (default: the one that routes to it).
        dtype: the weights' dtype on the wire, which must be the server's (default: the one the project's server
            reports; ``bfloat16`` for vLLM).
        rescore: ``true``: when the server holds the policy's current weights (synced at this optimizer step),
            alpha = pi_k and the trainer's first forward gives alpha's log-probs (first-iteration ratio exactly 1;
            needs ``data.reuse_policy_logprobs``). Otherwise the server's sampler log-probs are alpha's. Default:
            ``true`` for the project's server, ``false`` for vLLM (whose kernels differ from the trainer's).
        stop_token_ids: token ids that end a completion besides the server's EOS; default: the trainer's EOS ids,
            so both engines stop alike.
        lockstep: after generating, agree over the ranks that every request succeeded (one all-reduce), so a
            failure stops every rank at once.
        packed: send a bucket's tensors packed into one ``uint8`` buffer (one broadcast per bucket).
        lora_dir: ``kind: vllm`` with ``model.lora``: a directory rank 0 writes the adapter versions into and the
            ``vllm serve`` reads them from (``/v1/load_lora_adapter`` takes a path), so it must be on a filesystem
            both share, under the same path; required there.
        lora_keep: ``kind: vllm`` with ``model.lora``: the adapter versions kept loaded on the server (older ones
            are unloaded); None: K + 1 for ``data.max_staleness`` K, the fewest a request in flight may name. The
            server's ``--max-loras`` must be at least this.
        allow_remote: ``kind: vllm``: accept a server URL off this machine (not loopback). ``vllm serve``'s dev
            routes (pause, weight transfer, ...) have no authentication and it binds every interface by default,
            so its URL must be loopback unless this is set (and the server runs with ``LIT_GRPO_ALLOW_REMOTE_PUSH=1``
            for its gloo plugin), on a private network only. The project's server needs no such switch: it
            authenticates every route and binds loopback unless its own ``--host`` says otherwise.
        verify_pushes: ``kind: vllm``: after each push, read the server's digests of what it holds
            (``/weight_checker``) and stop the run, naming the server, when the push did not take effect
            (``lit_grpo.engines.remote.vllm_verify``: the tensors vLLM keeps as sent must equal them, and when every
            pushed tensor moved, every served one must have). Costs the server a hash of its model per push; the
            project's server is always checked, by its own digest.
        keep_pushed_weights: keep a frozen copy of the weights of each push on the trainer (the trainer's tensors,
            in the trainer's dtype), so that a batch sampled with the last pushed version, trained on after the
            policy moved on (v > 1, or ``data.max_staleness`` >= 1), gets alpha as that copy's recompute in the
            trainer's numerics (``alpha_source`` ``recompute``) instead of the server's report: verl's decoupled
            mode, for a server that cannot rescore (``vllm serve``). Implies ``rescore`` (``false`` with it is
            refused). With ``model.lora`` the copy is the adapter only (the base is the policy's own); an
            unsharded policy only. Logged: ``kept_weights_bytes``, ``kept_weights_copy_seconds``,
            ``alpha_recompute_seconds``.
        kept_weights_device: where the copy lives between pushes: ``trainer`` (the policy's device: no transfer
            per recompute, a second copy of the weights in its memory) or ``cpu`` (host memory; moved to the
            trainer's device for each recompute and back).
    """

    url: str | None = None
    urls: list[str] | None = None
    router_url: str | None = None
    token: str | None = None
    token_file: str | None = None
    timeout_s: float = 60.0
    generate_timeout_s: float = 900.0
    kind: Literal["lit_grpo", "vllm"] = "lit_grpo"
    bucket_mb: float = 64.0
    backend: Literal["gloo", "nccl"] | None = None
    transfer_address: str | None = None
    dtype: str | None = None
    rescore: bool | None = None
    stop_token_ids: list[int] | None = None
    lockstep: bool = True
    packed: bool = True
    lora_dir: str | None = None
    lora_keep: int | None = None
    allow_remote: bool = False
    verify_pushes: bool = True
    keep_pushed_weights: bool = False
    kept_weights_device: Literal["trainer", "cpu"] = "trainer"

    def __post_init__(self) -> None:
        if not isinstance(self.kept_weights_device, str) or self.kept_weights_device not in KEPT_WEIGHTS_DEVICES:
            raise ValueError(f"kept_weights_device must be one of {KEPT_WEIGHTS_DEVICES}, "
                             f"got {self.kept_weights_device!r}")
        if self.keep_pushed_weights is True and self.rescore is False:
            raise ValueError("keep_pushed_weights: true recomputes alpha from the kept copy, which rescore: false "
                             "turns off; drop rescore (it follows keep_pushed_weights) or set it true")
        # which servers is the engine's to check (ServerEngine): its message comes after the sampling checks that
        # depend on the kind alone
        kinds = get_args(get_type_hints(ServerOptions)["kind"])
        if self.kind not in kinds:
            raise ValueError(f"unknown server kind {self.kind!r}; expected one of {kinds}")
        for name in ("timeout_s", "generate_timeout_s", "bucket_mb"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not value > 0:
                raise ValueError(f"{name} must be a number > 0, got {value!r}")
        if self.lora_keep is not None and (isinstance(self.lora_keep, bool) or not isinstance(self.lora_keep, int)
                                           or self.lora_keep < 1):
            raise ValueError(f"lora_keep must be an integer >= 1 (K + 1 adapter versions), got {self.lora_keep!r}")
        backends = ("gloo", "nccl")
        if self.backend is not None and self.backend not in backends:
            raise ValueError(f"unknown backend {self.backend!r}; expected one of {backends}")
        if self.kind == "vllm" and self.allow_remote is not True:
            from lit_grpo.wire.auth import remote_url

            remote = remote_url([self.url, *(self.urls if isinstance(self.urls, list) else [])])
            if remote is not None:
                raise ValueError(f"kind 'vllm' server url {remote!r} is not on this machine: vllm serve's dev routes "
                                 "have no authentication, so bind it to 127.0.0.1 and use that, or set allow_remote: "
                                 "true (and LIT_GRPO_ALLOW_REMOTE_PUSH=1 for vllm serve) on a private network")
        from lit_grpo.wire.weight_transfer import DTYPES

        if self.dtype is not None and self.dtype not in DTYPES:
            raise ValueError(f"unknown dtype {self.dtype!r}; expected one of {sorted(DTYPES)}")

    @property
    def bucket_bytes(self) -> int:
        return max(1, int(self.bucket_mb * 2**20))

    @property
    def transfer_backend(self) -> str:
        """``backend``, or the kind's default: NCCL for vLLM, gloo for the project's server."""
        return self.backend or ("nccl" if self.kind == "vllm" else "gloo")


#: ``data.engine`` -> the group its ``data.engine_options`` are checked against
ENGINE_OPTIONS: dict[str, type] = {"transformers": TransformersOptions, "vllm": VLLMOptions, "server": ServerOptions}
EngineOptions = Union[TransformersOptions, VLLMOptions, ServerOptions]  # noqa: UP007 (a value, read at run time)


def engine_options(engine: str, value: EngineOptions | Mapping[str, Any] | None) -> EngineOptions:
    """``data.engine_options`` as the group of ``engine``: a group of that kind as is, a mapping checked key by key
    and value by value (for vLLM, a key that is not an option is a ``vllm.LLM`` argument)."""
    cls = ENGINE_OPTIONS[engine]
    name = "data.engine_options"
    if isinstance(value, (TransformersOptions, VLLMOptions, ServerOptions)) and not isinstance(value, cls):
        raise ValueError(f"{name} is a {type(value).__name__}, but data.engine {engine!r} takes a {cls.__name__}")
    if cls is VLLMOptions and isinstance(value, Mapping):
        known = {f.name for f in fields(VLLMOptions)}
        extra = {k: v for k, v in value.items() if k not in known}
        value = {**{k: v for k, v in value.items() if k in known},
                 "llm_kwargs": {**dict(value.get("llm_kwargs") or {}), **extra}}
    group = as_group(cls, value, name)
    check_types(group, name)
    return group


def check_types(group: object, name: str) -> None:
    """Refuse a field whose value does not have its annotated type (what a YAML or JSON mapping can hold: numbers,
    strings, booleans, lists, mappings, null, and a ``Literal``'s values)."""
    hints = get_type_hints(type(group))
    for f in fields(group):
        value = getattr(group, f.name)
        if not _fits(value, hints[f.name]):
            raise ValueError(f"{name}.{f.name} must be {_describe(hints[f.name])}, got {value!r} "
                             f"({type(group).__name__})")


def _fits(value: Any, hint: Any) -> bool:
    origin, args = get_origin(hint), get_args(hint)
    if hint is Any:
        return True
    if origin in (Union, types.UnionType):
        return any(_fits(value, arg) for arg in args)
    if origin is Literal:
        return value in args
    if hint is type(None):
        return value is None
    if origin is list:
        return isinstance(value, list) and all(_fits(item, args[0]) for item in value)
    if origin is dict:
        return isinstance(value, Mapping) and all(isinstance(k, str) for k in value)
    if hint is float:
        return isinstance(value, (int, float)) and not isinstance(value, bool)
    if hint is int:
        return isinstance(value, int) and not isinstance(value, bool)
    return isinstance(value, hint)


def _describe(hint: Any) -> str:
    origin, args = get_origin(hint), get_args(hint)
    if origin in (Union, types.UnionType):
        return " or ".join(_describe(arg) for arg in args)
    if origin is Literal:
        return "one of " + ", ".join(repr(a) for a in args)
    if hint is type(None):
        return "null"
    return getattr(hint, "__name__", str(hint))
