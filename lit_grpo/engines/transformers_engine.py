"""In-process rollout engine on a transformers causal LM: a private copy of the policy's weights, batched
seeded sampling with a KV cache, one prompt prefill shared by the prompt's n completions. With a LoRA policy
(``model.lora``) the copy is a peft model too, base and adapter apart, and takes ``AdapterUpdate``s
(``AdapterEngine``: ``lit_grpo.engines.adapters``)."""

from __future__ import annotations

import contextlib
import json
import logging
from collections.abc import Callable, Iterable
from typing import Any

import torch
from torch import nn

from lit_grpo.core.batch import left_pad
from lit_grpo.core.cache_argument import cache_kwarg, output_cache
from lit_grpo.core.distributed import is_sharded
from lit_grpo.core.scoring import layout_logprobs, positions_from_mask
from lit_grpo.engines.base import AdapterUpdate, Completion, RolloutEngine, SamplingConfig, ScoringLayout
from lit_grpo.engines.continuous_batching import (
    first_used_column,
    left_pad_rows,
    rebuild_cache,
    rebuild_due,
    rebuildable,
    sample_step,
    top_p_filter,  # noqa: F401 (importable from here, as before the decode step moved)
)
from lit_grpo.engines.kv_cache import preallocate
from lit_grpo.engines.options import SAMPLER_AUTOCAST, check_max_num_seqs
from lit_grpo.engines.progress import Reporter
from lit_grpo.engines.static_decoding import StaticDecoder
from lit_grpo.models.copies import materialize, skeleton_copy

log = logging.getLogger(__name__)
DECODE_MODES = ("auto", "static", "dynamic")
#: the keys of ``state_dict`` beside the weights, for a LoRA copy
LORA_SPEC_KEY = "lit_grpo.lora_spec"
MERGES_KEY = "lit_grpo.merges_applied"


def _check_request(prompts: list[list[int]], n: int) -> None:
    if n < 1:
        raise ValueError(f"n must be >= 1, got {n}")
    if not prompts or any(len(p) == 0 for p in prompts):
        raise ValueError("every prompt needs at least one token")


class TransformersEngine(RolloutEngine):
    """Rollouts from a transformers model. With ``copy_weights=True`` (rollouts) it keeps its own copy of the
    model, so its weights stay those of the last sync; with ``False`` (evaluation) it samples from the model itself.

    Decoding (``decode``): ``"dynamic"`` grows a KV cache token by token in eager PyTorch, with the prompt prefilled
    once for its n completions and the sampling drawn from an explicit seeded generator. ``"static"`` samples
    through transformers' ``generate`` with a fixed-shape cache, compiled into CUDA graphs on a GPU when
    ``compile`` (see :mod:`lit_grpo.engines.static_decoding`: same distribution, another random stream).
    ``"auto"`` (default) takes ``"static"`` on CUDA with ``compile`` on, else ``"dynamic"``; ``compile: false``
    therefore turns the compiled path off. Decoding that must stay in lockstep across ranks, and any sharded
    model (evaluation samples from the training policy itself), always takes the dynamic path.

    The private copy is made on first use (the first ``load_weights``, which ``WeightSync`` makes at the start of
    training, or the first ``generate``), on the device the model is on by then: a GPU run never holds a second
    full copy on the host. Until then the engine keeps a parameter-less skeleton. If the model is sharded (FSDP)
    by then, the copy's values come from the first ``load_weights``.

    LoRA (``model.lora``; the engine is an ``AdapterEngine``): the copy holds the base and an adapter of the policy's
    structure, unmerged, and samples with both (peft's forward, the trainer's). ``load_adapter`` receives the adapter
    only, and the merges of the policy's ``RefModelSwap``s that its base lacks, applied with the trainer's own
    function and checked by the base's hash. A copy made from a LoRA policy holds its base as it is, so it starts
    with all the policy's merges applied (``merges_applied``).

    ``sampler_autocast`` (``bf16`` / ``fp16``): ``generate`` runs under ``torch.autocast`` of that dtype, so the
    sampler's log-probs (mu) come from a lower-precision pass, while ``score`` (alpha's recompute) stays in the
    caller's precision: the CPU stand-in for a bf16 vLLM sampling for an fp32 trainer. It takes the dynamic path
    (``auto`` does; ``static`` is refused), since the static path samples outside any autocast.

    The dynamic path frees finished slots: a row that ended leaves the running batch (its KV cache rows, mask and
    position) once enough rows ended to pay for the copy, so a decode step costs what the running rows cost.
    ``max_num_seqs`` (vLLM's name) caps the rows decoding at once: a freed slot takes the next waiting sequence,
    its prompt prefilled and its cache merged into the running one (continuous batching). ``None`` (default): every
    row starts at once. The static path is unchanged.

    ``shares_policy`` (with ``copy_weights=False``): the model is the trainer's policy, sampled between optimizer
    steps when a private copy would hold the same values (v = 1, nothing generated ahead): one copy of the weights
    less, the same samples. ``WeightSync`` then records each push's step without copying (``weights: shared``).
    """

    def __init__(
        self,
        model: nn.Module,
        eos_token_ids: Iterable[int],
        pad_token_id: int,
        copy_weights: bool = True,
        rescore: bool = True,
        decode: str = "auto",
        compile: bool = True,
        width_multiple: int = 64,
        sampler_autocast: str | None = None,
        max_num_seqs: int | None = None,
        shares_policy: bool = False,
    ) -> None:
        check_max_num_seqs(max_num_seqs)
        if shares_policy and copy_weights:
            raise ValueError("shares_policy=True samples from the policy itself; expected copy_weights=False with it")
        if decode not in DECODE_MODES:
            raise ValueError(f"unknown decode {decode!r}; expected one of {DECODE_MODES}")
        if sampler_autocast is not None and (not isinstance(sampler_autocast, str)
                                             or sampler_autocast not in SAMPLER_AUTOCAST):
            raise ValueError(f"sampler_autocast must be one of {sorted(SAMPLER_AUTOCAST)} or None, "
                             f"got {sampler_autocast!r}")
        if sampler_autocast is not None and decode == "static":
            raise ValueError(f"sampler_autocast={sampler_autocast!r} samples on the dynamic path (the static cache "
                             "samples outside autocast); expected decode 'auto' or 'dynamic', got 'static'")
        #: the autocast dtype sampling runs under (``None``: the caller's precision); ``score`` never takes it
        self.sampler_autocast = sampler_autocast
        #: at most this many sequences decode at once on the dynamic path (``None``: every row of a request)
        self.max_num_seqs = max_num_seqs
        self.decode = decode
        self.static_decoder = StaticDecoder(compile=compile, width_multiple=width_multiple)
        self.owns_weights = copy_weights
        #: the borrowed model is the trainer's policy (``data.engine_options.weights``: ``shared``): ``WeightSync``
        #: skips its pushes, which would copy the policy onto itself (``lit_grpo.callbacks.protocol.shares_policy``)
        self.shares_policy = shares_policy
        self._model: nn.Module | None = None if copy_weights else model
        # a private copy is made lazily from the source (see the class docstring); a borrowed model keeps its mode
        self._source: nn.Module | None = model if copy_weights else None
        self._skeleton: nn.Module | None = skeleton_copy(model).eval() if copy_weights else None
        self._filled = not copy_weights
        self.eos_token_ids = sorted(set(int(t) for t in eos_token_ids))
        if not self.eos_token_ids:
            raise ValueError("the engine needs at least one end-of-sequence token id")
        self.pad_token_id = int(pad_token_id)
        self.rescore = rescore
        self.synced_step = 0
        #: merges of the policy's log the copy's base holds (``None``: the copy is not made yet, see ``merges_applied``)
        self._merges_applied: int | None = None

    @property
    def merges_applied(self) -> int:
        """How many of the policy's merges (``lit_grpo.models.lora.merge_log``) the copy's base holds. Before the copy
        is
        made: those of the source, whose base it will copy."""
        if self._merges_applied is None:
            source = self._source if self._source is not None else self._model
            self._merges_applied = source_merges(source) if source is not None else 0
        return self._merges_applied

    @merges_applied.setter
    def merges_applied(self, value: int) -> None:
        self._merges_applied = int(value)

    @property
    def needs_base_weights(self) -> bool:
        """Whether the copy has (or will have) no values of its own: its source is sharded, so the first push must
        be a full ``load_weights`` before any adapter (``WeightSync`` sends one then)."""
        return not self._filled and (self._model is not None or is_sharded(self._source))

    @property
    def model(self) -> nn.Module:
        """The model the engine samples from (its private copy is made here on first access)."""
        if self._model is None:
            self._model = self._make_copy(fill=True)
        return self._model

    def _make_copy(self, fill: bool) -> nn.Module:
        """Storage for the private copy on the source's device; with ``fill``, the source's current values too
        (``load_weights`` makes it without: it overwrites every parameter next)."""
        source, skeleton = self._source, self._skeleton
        self._source = self._skeleton = None  # the engine must not keep the source's old tensors alive
        device = next(source.parameters()).device  # a DTensor reports its local device
        model = materialize(skeleton, device)
        self._merges_applied = source_merges(source)  # its base is the source's as it is now
        if fill and not is_sharded(source):
            from lit_grpo.models.lora import is_lora

            if is_lora(source) and not is_lora(model):  # the policy got its adapter after the engine was made
                model = copy_into_lora(model, source)
            else:
                with torch.no_grad():
                    for (name, mine), (src_name, theirs) in zip(model.named_parameters(), source.named_parameters()):
                        if name != src_name:
                            raise RuntimeError(f"rollout copy out of step with its source: {name} vs {src_name}")
                        mine.copy_(theirs.detach())
            self._filled = True
        return model

    @property
    def device(self) -> torch.device:
        return next(self.model.parameters()).device

    def to(self, device: torch.device | str) -> TransformersEngine:
        self.model.to(device)
        return self

    def generate(
        self, prompts: list[list[int]], n: int, sampling: SamplingConfig, seed: int,
        all_finished: Callable[[bool], bool] | None = None,
    ) -> list[list[Completion]]:
        """``all_finished(local_done)`` decides when decoding stops; sharded (FSDP) models pass a collective so
        that every rank runs the same number of forwards (each one is a collective). Default: this process."""
        # A borrowed model may be sharded (FSDP2): its all-gather buffers are reused by training afterwards, and
        # inference tensors could not be written there again, so plain no_grad for it.
        self.model  # noqa: B018 (makes the private copy on first use)
        if not self._filled:
            raise RuntimeError("the rollout engine holds no weights yet: its source model was sharded when the copy "
                               "was made, so load_weights must come first (WeightSync does at the start of training)")
        was_training = self.model.training
        try:
            with torch.inference_mode() if self.owns_weights else torch.no_grad(), self.sampling_precision():
                if all_finished is None and self.uses_static_decoding():
                    return self._generate_static(prompts, n, sampling, seed)
                return self._generate(prompts, n, sampling, seed, all_finished)
        finally:
            self.model.train(was_training)  # the caller's mode, also when sampling fails

    def sampling_precision(self) -> contextlib.AbstractContextManager:
        """``torch.autocast`` of ``sampler_autocast``'s dtype on the engine's device type while sampling (the
        sampler's log-probs, mu, then come from that pass), else nothing: the caller's precision."""
        if self.sampler_autocast is None:
            return contextlib.nullcontext()
        dtype = getattr(torch, SAMPLER_AUTOCAST[self.sampler_autocast])
        return torch.autocast(self.device.type, dtype=dtype)

    def uses_static_decoding(self) -> bool:
        """Whether ``generate`` takes the static-cache path. A sharded (FSDP) model, which evaluation may borrow
        even in one process, always takes the dynamic path: ``generate`` and its compilation expect a plain model."""
        if is_sharded(self.model) or self.sampler_autocast is not None:
            return False  # the static path samples in float32 outside any autocast
        if self.decode == "auto":
            return self.static_decoder.compile and self.device.type == "cuda"
        return self.decode == "static"

    def _generate_static(self, prompts: list[list[int]], n: int, sampling: SamplingConfig,
                         seed: int) -> list[list[Completion]]:
        _check_request(prompts, n)
        self.model.eval()
        tokens, logps, ended = self.static_decoder(
            self.model, prompts, n, sampling.max_new_tokens, sampling.temperature, sampling.top_p, seed,
            self.eos_token_ids, self.pad_token_id)
        if self.static_decoder.last_first_call_seconds is not None:
            log.info("static-cache decoding: first call for %d rows x %d new tokens took %.1f s (compilation%s)",
                     len(tokens), sampling.max_new_tokens, self.static_decoder.last_first_call_seconds,
                     " included" if self.static_decoder.compile and self.device.type == "cuda" else " off")
        return [[Completion(tokens[p * n + j], logps[p * n + j], truncated=not ended[p * n + j]) for j in range(n)]
                for p in range(len(prompts))]

    def _generate(
        self, prompts: list[list[int]], n: int, sampling: SamplingConfig, seed: int,
        all_finished: Callable[[bool], bool] | None,
    ) -> list[list[Completion]]:
        """Dynamic decoding that frees finished slots. Row ``p * n + j`` is prompt ``p``'s ``j``-th completion; rows
        are admitted in that order, at most ``max_num_seqs`` decoding at once (all of them when ``None``), each
        admission prefilling its prompts once for their rows. Rows that finished (an EOS, or ``max_new_tokens``)
        leave the running batch when a rebuild is due (``continuous_batching.rebuild_due``), and waiting rows take
        their slots: their prompt caches are merged into the running cache, left-padded to its width.

        Randomness: one uniform per row and token position is drawn up front from a generator seeded with ``seed``,
        and each token inverts its row's distribution at its uniform (``sample_with_uniforms``). The same seed and
        prompts therefore give the same completions, and a row's tokens do not depend on the batch it decoded in
        (``max_num_seqs``, when rows finished): only on floating-point differences of batched kernels. The stream
        differs from the one before rows were freed (one ``torch.multinomial`` over the whole batch per step): the
        same distribution, other draws.

        ``all_finished(local_done)`` is called once per decode step as before (not after the step that reaches
        ``max_new_tokens`` when every row started together), so ranks that decode in lockstep run the same number
        of forwards; a rank whose rows all finished keeps one of them to run its forwards. A sharded model (whose
        forwards are collectives) admits every row at once, since admissions would add forwards on one rank only.
        """
        _check_request(prompts, n)
        self.model.eval()
        device = self.device
        max_new = sampling.max_new_tokens
        total = len(prompts) * n
        cap = total if self.max_num_seqs is None or is_sharded(self.model) else min(self.max_num_seqs, total)
        all_at_once = cap == total
        generator = torch.Generator(device=device).manual_seed(int(seed))
        uniforms = torch.rand(total, max_new, generator=generator, device=device, dtype=torch.float64)
        cache_name = cache_kwarg(self.model)
        eos = torch.tensor(self.eos_token_ids, device=device)
        # per row, over the whole request; column max_new is scratch, written by rows that already finished
        out_tokens = torch.full((total, max_new + 1), self.pad_token_id, dtype=torch.long, device=device)
        out_logps = torch.zeros(total, max_new + 1, device=device)
        lengths = torch.zeros(total, dtype=torch.long, device=device)
        # tokens each row has decoded so far, updated in place: an ``all_finished`` hook may read it between two steps
        # (the rollout server's partial rollouts, to know at which token each row goes on under new weights)
        self.decoded_lengths = lengths
        ended = torch.zeros(total, dtype=torch.bool, device=device)

        def prefill(first: int, count: int) -> tuple[Any, torch.Tensor, torch.Tensor]:
            """The cache, attention mask and last logits of rows ``first .. first + count - 1``, one row each (their
            prompts prefilled once)."""
            lo, hi = first // n, (first + count - 1) // n
            ids, mask = left_pad(prompts[lo: hi + 1], self.pad_token_id, device)
            out = self.model(input_ids=ids, attention_mask=mask, position_ids=positions_from_mask(mask),
                             use_cache=True, logits_to_keep=1)
            expand = torch.arange(first, first + count, device=device) // n - lo
            cache = output_cache(out)
            cache.batch_select_indices(expand)
            return cache, mask[expand], out.logits[:, -1][expand]

        cache, attention, logits = prefill(0, cap)
        preallocate(cache, max_new)  # written in place: no copy of the whole cache per token
        if not all_at_once and not rebuildable(cache):
            raise ValueError(f"max_num_seqs={self.max_num_seqs} needs a KV cache of plain dynamic layers; this "
                             f"model's has {sorted({type(layer).__name__ for layer in cache.layers})}; "
                             "expected max_num_seqs null")
        can_rebuild = rebuildable(cache)
        rows = torch.arange(cap, device=device)  # the running rows' ids
        admitted = cap
        finished = torch.zeros(cap, dtype=torch.bool, device=device)
        counts = torch.zeros(cap, dtype=torch.long, device=device)
        steps, reporter = 0, Reporter(total)  # sequences and tokens done, for a progress bar (engines.progress)
        while True:
            draws = uniforms[rows, counts.clamp(max=max_new - 1)]
            sampled, logps = sample_step(logits, sampling.temperature, sampling.top_p, draws, finished,
                                         self.pad_token_id)
            column = torch.where(finished, max_new, counts)
            out_tokens[rows, column] = sampled
            out_logps[rows, column] = logps
            live = ~finished
            counts = counts + live.long()
            hit = live & torch.isin(sampled, eos)
            finished = finished | hit | (counts >= max_new)
            lengths[rows] = counts
            ended[rows] |= hit
            steps += 1
            done_rows, waiting = int(finished.sum()), total - admitted
            done = done_rows == rows.numel() and waiting == 0
            reporter.update(admitted - rows.numel() + done_rows, lambda: int(lengths.sum()))
            if all_at_once and steps == max_new:
                break
            if all_finished(done) if all_finished is not None else done:
                break
            # no forward for a batch whose rows all finished and leave for waiting ones
            if done_rows < rows.numel() or waiting == 0:
                attention = torch.cat([attention, (~finished).long().unsqueeze(-1)], dim=1)
                logits = self.model(
                    input_ids=sampled.unsqueeze(-1),
                    attention_mask=attention,
                    position_ids=(attention.sum(-1, keepdim=True) - 1).clamp(min=0),
                    use_cache=True,
                    **{cache_name: cache},
                ).logits[:, -1]
            if can_rebuild and rebuild_due(done_rows, rows.numel(), waiting):
                keep = (~finished).nonzero().squeeze(-1)
                admit = min(cap - keep.numel(), waiting)
                if keep.numel() == 0 and admit == 0:
                    keep = keep.new_zeros(1)  # a finished row still runs the forwards the other ranks run
                start = first_used_column(attention[keep])
                new_cache = new_attention = new_logits = None
                if admit:
                    new_cache, new_attention, new_logits = prefill(admitted, admit)
                rebuild_cache(cache, keep, start, new_cache, room=max_new)
                parts = [attention[keep, start:]] + ([new_attention] if admit else [])
                attention = left_pad_rows(parts, dim=1)
                logits = torch.cat([logits[keep]] + ([new_logits] if admit else []))
                rows = torch.cat([rows[keep], torch.arange(admitted, admitted + admit, device=device)])
                finished = torch.cat([finished[keep], finished.new_zeros(admit)])
                counts = torch.cat([counts[keep], counts.new_zeros(admit)])
                admitted += admit
        reporter.done(lambda: int(lengths.sum()))
        token_rows, logp_rows = out_tokens.tolist(), out_logps.tolist()
        length_rows, ended_rows = lengths.tolist(), ended.tolist()
        return [[Completion(token_rows[r][: length_rows[r]], logp_rows[r][: length_rows[r]],
                            truncated=not ended_rows[r]) for r in range(p * n, (p + 1) * n)]
                for p in range(len(prompts))]

    @torch.no_grad()
    def load_weights(self, named_tensors: Iterable[tuple[str, torch.Tensor]], step: int) -> None:
        if self._model is None:
            self._model = self._make_copy(fill=False)
        params = dict(self.model.named_parameters())
        params.update(dict(self.model.named_buffers()))
        seen = set()
        for name, tensor in named_tensors:
            if name not in params:
                raise KeyError(f"weight {name!r} does not exist in the rollout engine's model")
            params[name].copy_(tensor.to(params[name].device, params[name].dtype))
            seen.add(name)
        missing = set(dict(self.model.named_parameters())) - seen
        if missing:
            raise KeyError(f"weight sync left {len(missing)} parameters untouched, e.g. {sorted(missing)[:3]}")
        self._filled = True
        self.synced_step = int(step)

    @torch.no_grad()
    def load_adapter(self, update: AdapterUpdate, step: int) -> None:
        """A LoRA push: the copy becomes a peft model of ``update.spec``'s structure at the first one (its base is
        the copy's), applies ``update.merges`` and checks ``update.base_hash`` (``lit_grpo.engines.adapters.
        apply_adapter_update``: all or nothing, a one-line ``ValueError`` naming both hashes), loads the adapter and
        records ``step``."""
        from lit_grpo.engines.adapters import apply_adapter_update, ensure_lora

        if not isinstance(update, AdapterUpdate):
            raise TypeError(f"load_adapter takes an AdapterUpdate, got {type(update).__name__}")
        self.merges_applied  # noqa: B018 (read before the copy is made: the source's count)
        model = self.model  # makes the private copy (with the source's base) on first use
        if not self._filled:
            raise RuntimeError("the rollout engine holds no base weights yet: its source was sharded when the copy "
                               "was made, so a full load_weights must come before the first adapter")
        if self.owns_weights:
            self._model = model = ensure_lora(model, update.spec)
        elif ensure_lora(model, update.spec) is not model:
            raise ValueError("an engine that samples from the policy itself (copy_weights=False) takes no adapter")
        applied, _ = apply_adapter_update(model, update.merges, update.adapter, update.base_hash,
                                          "the in-process rollout engine")
        self.merges_applied = self.merges_applied + applied
        self.synced_step = int(step)

    @torch.inference_mode()
    def score(self, layout: ScoringLayout, temperature: float) -> torch.Tensor | None:
        """alpha's log-probs in the caller's precision (the trainer's forward context), never under
        ``sampler_autocast``: the recompute is the trainer's function of the engine's weights."""
        if not self.rescore:
            return None
        model = self.model
        was_training = model.training
        try:  # a borrowed model (the policy itself) may be in train mode: LoRA's dropout must not enter alpha
            model.eval()
            return layout_logprobs(model, layout, temperature, self.head_chunk_mb)
        finally:
            model.train(was_training)

    def state_dict(self) -> dict[str, Any]:
        """The copy's weights by name; for a LoRA copy (peft names: base and adapter) also its spec (``LORA_SPEC_KEY``,
        JSON) and the merges its base holds (``MERGES_KEY``), which an exact resume needs while it lags the policy."""
        from lit_grpo.models.lora import is_lora, lora_spec

        state: dict[str, Any] = {k: v.detach().cpu().clone() for k, v in self.model.named_parameters()}
        if is_lora(self.model):
            state[LORA_SPEC_KEY] = json.dumps(lora_spec(self.model))
            state[MERGES_KEY] = int(self.merges_applied)
        return state

    def load_state_dict(self, state: dict[str, Any], step: int) -> None:
        """Restore ``state_dict``'s weights (a LoRA copy: its adapter structure first, then base, adapter and
        merge count)."""
        from lit_grpo.engines.adapters import ensure_lora

        state = dict(state)
        spec, merges = state.pop(LORA_SPEC_KEY, None), state.pop(MERGES_KEY, None)
        if spec is not None:
            if self._model is None:
                self._model = self._make_copy(fill=False)
            if self.owns_weights:
                self._model = ensure_lora(self._model, json.loads(spec))
        self.load_weights(state.items(), step)
        if merges is not None:
            self.merges_applied = int(merges)


def source_merges(source: nn.Module) -> int:
    """How many merges of its log a LoRA policy's base holds (0 for a model without adapters)."""
    from lit_grpo.models.lora import is_lora, merge_log

    return len(merge_log(source)) if is_lora(source) else 0


@torch.no_grad()
def copy_into_lora(model: nn.Module, source: nn.Module) -> nn.Module:
    """A plain copy ``model`` filled with the base of the LoRA policy ``source`` (names mapped from peft's), then
    given the source's adapter structure and values."""
    from lit_grpo.engines.adapters import wrap_with_spec
    from lit_grpo.models.lora import adapter_state, load_adapter_state, lora_spec, plain_name

    mine = dict(model.named_parameters())
    for name, theirs in source.named_parameters():
        if ".lora_" in name:
            continue
        plain = plain_name(name)
        if plain not in mine:
            raise RuntimeError(f"rollout copy out of step with its source: no {plain} (from {name})")
        mine[plain].copy_(theirs.detach())
    model = wrap_with_spec(model, lora_spec(source))
    load_adapter_state(model, adapter_state(source))
    return model

