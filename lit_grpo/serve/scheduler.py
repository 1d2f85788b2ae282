"""One decode loop per rollout server: the completion requests in flight share one running batch.

Before, each request decoded on its own thread with its own KV cache, so the requests of several trainer ranks that
reach one server at once ran as that many independent batches on the same device, each paying its own forwards.
Here a request is a ``Ticket`` queued with the ``DecodeScheduler``; one thread decodes the rows of every queued
request together, at most ``max_num_seqs`` at a time (``--max-num-seqs``; ``None``: all), admitting waiting rows into
slots that finished rows free (``lit_grpo.engines.continuous_batching``: the same rebuild rule and cache merge as
the in-process engine's dynamic path).

What a request gets back does not depend on what else decodes beside it: its rows draw their uniforms from its own
seed (one per row and token position, as ``TransformersEngine`` draws them), so a request alone in the scheduler gives
the in-process engine's completions token for token, and beside others the same up to the floating-point differences
of batched kernels. Requests whose sampling differs (temperature, top-p, stop ids) do not share a batch: one batch
runs one sampling key, and the next key's requests start when it empties.

The pause and the weight version (``ServedPolicy``): a request is counted in flight by its handler thread for as long
as it is held here. ``/pause?mode=abort`` fails the held requests of an older abort epoch at the next decoding step;
a ``keep`` pause parks the loop, counting every held request as parked, so the swap may run; every held request then
records the version it goes on with, from the token each of its rows reached (``make_version_spans`` in
``serve.generation``). A request's first version is the one it was admitted under, read by ``ServedPolicy.generating``
before it is queued, never after it returns. torch is imported when the first request comes.
"""

from __future__ import annotations

import math
import threading
import traceback
from collections import deque
from dataclasses import dataclass, field
from typing import Any

from lit_grpo.serve.served_policy import ServedPolicy

#: the versions a request went on with, and for each the token at which each of its rows took it up (``None``: every
#: row from its first token, the version the request was admitted under); ``make_version_spans`` reads it
Starts = list[tuple[str | None, list[int] | None]]


@dataclass(frozen=True)
class SamplingKey:
    """What the rows of one batch must share: the logits' temperature and nucleus, and the ids that end a row."""

    temperature: float
    top_p: float
    stops: tuple[int, ...]


@dataclass(eq=False)
class Ticket:
    """One completion request in the scheduler: row ``p * n + j`` is prompt ``p``'s ``j``-th completion. Its tensors
    (filled by the decode thread) are read by the request's thread once ``done`` is set."""

    prompts: list[list[int]]
    n: int
    max_new: int
    seed: int
    key: SamplingKey
    epoch: int  # the abort epoch it was admitted under
    starts: Starts
    done: threading.Event = field(default_factory=threading.Event)
    #: why it failed (``(HTTP status, message)``), or None
    failure: tuple[int, str] | None = None
    admitted: int = 0  # rows that entered the running batch
    finished: int = 0  # rows that ended (an end id, or ``max_new`` tokens)
    tokens: Any = None  # [rows, max_new] sampled ids, then its per-row fields below, made at its first admission
    logps: Any = None
    lengths: Any = None
    ended: Any = None
    uniforms: Any = None

    @property
    def rows(self) -> int:
        return len(self.prompts) * self.n

    def allocate(self, device: Any, pad: int) -> None:
        """Its buffers, and its uniforms drawn from its seed exactly as ``TransformersEngine._generate`` draws them."""
        import torch

        generator = torch.Generator(device=device).manual_seed(int(self.seed))
        self.uniforms = torch.rand(self.rows, self.max_new, generator=generator, device=device, dtype=torch.float64)
        self.tokens = torch.full((self.rows, self.max_new), pad, dtype=torch.long, device=device)
        self.logps = torch.zeros(self.rows, self.max_new, device=device)
        self.lengths = torch.zeros(self.rows, dtype=torch.long, device=device)
        self.ended = torch.zeros(self.rows, dtype=torch.bool, device=device)

    def completions(self) -> list[list[Any]]:
        """Its completions, one group of ``n`` per prompt (``Completion``s)."""
        from lit_grpo.engines.base import Completion

        tokens, logps = self.tokens.tolist(), self.logps.tolist()
        lengths, ended = self.lengths.tolist(), self.ended.tolist()
        return [[Completion(tokens[r][: lengths[r]], logps[r][: lengths[r]], truncated=not ended[r])
                 for r in range(p * self.n, (p + 1) * self.n)] for p in range(len(self.prompts))]


@dataclass(eq=False)
class Slice:
    """The running rows of one ticket: their positions in the batch and their row numbers in the ticket."""

    ticket: Ticket
    positions: Any  # LongTensor of batch positions
    rows: Any  # LongTensor of the ticket's rows, in the same order


class DecodeScheduler:
    """The server's one decode loop over ``policy``'s model (see the module's docstring). ``submit`` queues a
    request and returns its ticket; the caller waits on ``ticket.done`` inside ``policy.generating()``."""

    def __init__(self, policy: ServedPolicy, pad: int, max_num_seqs: int | None = None) -> None:
        from lit_grpo.engines.options import check_max_num_seqs

        check_max_num_seqs(max_num_seqs)
        self.policy = policy
        self.pad = int(pad)
        self.max_num_seqs = max_num_seqs
        self._queue: deque[Ticket] = deque()  # tickets with rows not admitted yet, in arrival order
        self._held: list[Ticket] = []  # every ticket submitted and not done
        self._parking = False
        self._parked = 0  # tickets counted in ``policy.parked`` by the loop's park
        self._thread: threading.Thread | None = None
        #: rows in the running batch after each decoding step's forward, for tests and the benchmark (the largest)
        self.peak_rows = 0
        self._reset_batch()

    # ---- the request threads' side ------------------------------------------------------------------
    def submit(self, prompts: list[list[int]], n: int, max_new: int, seed: int, key: SamplingKey, epoch: int,
               version: str | None) -> Ticket:
        """Queue a request (admitted under abort epoch ``epoch`` and weight version ``version``)."""
        ticket = Ticket(prompts, n, max_new, seed, key, epoch, [(version, None)])
        with self.policy.cond:
            self._queue.append(ticket)
            self._held.append(ticket)
            if self._parking:  # it came in while the loop is parked: it waits there too, counted as parked
                self._parked += 1
                self.policy.parked += 1
            if self._thread is None:
                self._thread = threading.Thread(target=self._loop, name="lit_grpo-decode", daemon=True)
                self._thread.start()
            self.policy.cond.notify_all()
        return ticket

    # ---- the decode thread --------------------------------------------------------------------------
    def _reset_batch(self) -> None:
        self.cache = self.attention = self.logits = None
        self.key: SamplingKey | None = None
        self.slices: list[Slice] = []
        self.counts = self.finished = self.max_new = None
        self.room = 0

    def _loop(self) -> None:
        import torch

        while True:
            with self.policy.cond:
                while not self._queue:
                    self.policy.cond.wait()
            try:
                with torch.no_grad():
                    self._run_batch()
            except Exception as err:  # noqa: BLE001 (a bug fails the requests it held, not the server)
                traceback.print_exc()
                self._fail_all(500, f"decoding failed: {type(err).__name__}: {err}")
            self._reset_batch()

    def _fail_all(self, status: int, message: str) -> None:
        with self.policy.cond:
            for ticket in list(self._held):
                self._end(ticket, (status, message))
            self._queue.clear()

    def _end(self, ticket: Ticket, failure: tuple[int, str] | None = None) -> None:
        """Hand ``ticket`` back to its thread (call with ``policy.cond`` held)."""
        if ticket.done.is_set():
            return
        ticket.failure = failure
        if ticket in self._held:
            self._held.remove(ticket)
        if ticket in self._queue:
            self._queue.remove(ticket)
        ticket.done.set()

    def _waiting(self) -> int:
        """Rows of the running key's queued tickets not admitted yet."""
        with self.policy.cond:
            return sum(t.rows - t.admitted for t in self._queue if t.key == self.key)

    def _take(self, count: int) -> list[tuple[Ticket, int, int]]:
        """Up to ``count`` waiting rows of the running key, in arrival order: ``(ticket, first row, rows)``."""
        taken = []
        with self.policy.cond:
            for ticket in list(self._queue):
                if count == 0:
                    break
                if ticket.key != self.key:
                    continue
                rows = min(count, ticket.rows - ticket.admitted)
                taken.append((ticket, ticket.admitted, rows))
                ticket.admitted += rows
                count -= rows
                if ticket.admitted == ticket.rows:
                    self._queue.remove(ticket)
        return taken

    def _prefill(self, taken: list[tuple[Ticket, int, int]]) -> tuple[Any, Any, Any, list[Slice]]:
        """The cache, attention mask and last logits of the rows ``taken``, one row each (each ticket's prompts
        prefilled once for their rows), and their slices, positions counted from ``len`` of the running batch."""
        import torch

        from lit_grpo.core.batch import left_pad
        from lit_grpo.core.cache_argument import output_cache
        from lit_grpo.core.scoring import positions_from_mask

        model, device = self.policy.model, self.policy.device
        prompts, expand, slices = [], [], []
        at = 0 if self.counts is None else int(self.counts.numel())
        for ticket, first, count in taken:
            if ticket.tokens is None:
                ticket.allocate(device, self.pad)
            lo, hi = first // ticket.n, (first + count - 1) // ticket.n
            rows = torch.arange(first, first + count, device=device)
            expand.append(rows // ticket.n - lo + len(prompts))
            prompts.extend(ticket.prompts[lo: hi + 1])
            slices.append(Slice(ticket, torch.arange(at, at + count, device=device), rows))
            at += count
        ids, mask = left_pad(prompts, self.pad, device)
        out = model(input_ids=ids, attention_mask=mask, position_ids=positions_from_mask(mask), use_cache=True,
                    logits_to_keep=1)
        index = torch.cat(expand)
        cache = output_cache(out)
        cache.batch_select_indices(index)
        return cache, mask[index], out.logits[:, -1][index], slices

    def _run_batch(self) -> None:
        """Decode one sampling key's rows until none runs and none of that key waits."""
        import torch

        from lit_grpo.core.cache_argument import cache_kwarg
        from lit_grpo.engines.continuous_batching import first_used_column, rebuild_due, rebuildable
        from lit_grpo.engines.kv_cache import preallocate

        with self.policy.cond:
            if not self._queue:
                return
            self.key = self._queue[0].key
        cap = self.max_num_seqs if self.max_num_seqs is not None else math.inf
        taken = self._take(min(cap, self._waiting()))
        self.cache, self.attention, self.logits, self.slices = self._prefill(taken)
        self.room = max(t.max_new for t, _, _ in taken)
        preallocate(self.cache, self.room)
        can_rebuild = rebuildable(self.cache)
        if not can_rebuild and self.max_num_seqs is not None:
            layers = sorted({type(layer).__name__ for layer in self.cache.layers})
            raise ValueError(f"--max-num-seqs {self.max_num_seqs} needs a KV cache of plain dynamic layers; this "
                             f"model's has {layers}; start the server without --max-num-seqs")
        device = self.policy.device
        self.counts = torch.zeros(sum(c for _, _, c in taken), dtype=torch.long, device=device)
        self.finished = torch.zeros_like(self.counts, dtype=torch.bool)
        self.max_new = torch.cat([torch.full((c,), t.max_new, device=device) for t, _, c in taken])
        stops = torch.tensor(self.key.stops, device=device)
        cache_name = cache_kwarg(self.policy.model)
        while True:
            self._step(stops)
            self._between_steps()
            running = int(self.counts.numel())
            done_rows = int(self.finished.sum())
            waiting = self._waiting() if can_rebuild else 0
            if done_rows == running and waiting == 0:
                return
            if done_rows < running:
                self.attention = torch.cat([self.attention, (~self.finished).long().unsqueeze(-1)], dim=1)
                sampled = self.last_sampled
                self.logits = self.policy.model(
                    input_ids=sampled.unsqueeze(-1), attention_mask=self.attention,
                    position_ids=(self.attention.sum(-1, keepdim=True) - 1).clamp(min=0), use_cache=True,
                    **{cache_name: self.cache}).logits[:, -1]
                self.peak_rows = max(self.peak_rows, running)
            free = cap - (running - done_rows)
            if can_rebuild and (rebuild_due(done_rows, running, waiting) or (waiting and free > 0
                                                                               and running < cap)):
                self._rebuild(int(min(free, waiting)), first_used_column)

    def _step(self, stops: Any) -> None:
        """Sample one token for every running row (a finished row samples the pad, kept nowhere), as
        ``TransformersEngine._generate`` does, and write each live row's token and log-prob into its ticket."""
        import torch

        from lit_grpo.engines.continuous_batching import sample_step

        draws = torch.empty(self.counts.numel(), dtype=torch.float64, device=self.counts.device)
        for part in self.slices:  # each row's uniform for its next position (a finished row's is not used)
            column = self.counts[part.positions].clamp(max=part.ticket.max_new - 1)
            draws[part.positions] = part.ticket.uniforms[part.rows, column]
        sampled, logps = sample_step(self.logits, self.key.temperature, self.key.top_p, draws, self.finished,
                                     self.pad)
        live = ~self.finished
        hit = live & torch.isin(sampled, stops)
        for part in self.slices:
            mine = live[part.positions]
            if bool(mine.any()):
                rows, at = part.rows[mine], part.positions[mine]
                part.ticket.tokens[rows, self.counts[at]] = sampled[at]
                part.ticket.logps[rows, self.counts[at]] = logps[at]
        self.counts = self.counts + live.long()
        newly = live & (hit | (self.counts >= self.max_new))
        self.finished = self.finished | newly
        for part in self.slices:
            ticket = part.ticket
            ticket.lengths[part.rows] = self.counts[part.positions]
            ticket.ended[part.rows] |= hit[part.positions]
            ticket.finished += int(newly[part.positions].sum())
        self.last_sampled = sampled

    def _between_steps(self) -> None:
        """Once per decoding step: fail the tickets of an older abort epoch, park for a ``keep`` pause, and hand back
        the tickets whose rows all ended."""
        policy = self.policy
        if policy.holding:
            self._park()
        with policy.cond:
            for ticket in list(self._held):
                if ticket.epoch != policy.abort_epoch:
                    self._end(ticket, (503, "generation aborted by /pause; retry after /resume"))
                elif ticket.finished == ticket.rows:
                    self._end(ticket)
        aborted = {id(s.ticket) for s in self.slices if s.ticket.failure is not None}
        if aborted:  # their rows stop sampling and leave at the next rebuild
            for part in self.slices:
                if id(part.ticket) in aborted:
                    self.finished[part.positions] = True

    def _park(self) -> None:
        """Wait out a ``keep`` pause and the swap it makes room for, every held ticket counted as parked; then each
        one records the version it goes on with, from the token each of its rows has reached."""
        policy = self.policy
        with policy.cond:
            self._parking = True
            self._parked = len(self._held)
            policy.parked += self._parked
            policy.cond.notify_all()  # the pause waits for every generation in flight to park
            try:
                while (policy.holding or policy.swapping) and all(t.epoch == policy.abort_epoch for t in self._held):
                    policy.cond.wait()
            finally:
                policy.parked -= self._parked
                self._parked = 0
                self._parking = False
            version = policy.weight_version
            held = [t for t in self._held if t.epoch == policy.abort_epoch]
        for ticket in held:
            if version != ticket.starts[-1][0]:
                lengths = ticket.lengths.tolist() if ticket.lengths is not None else [0] * ticket.rows
                ticket.starts.append((version, lengths))

    def _rebuild(self, admit: int, first_used_column: Any) -> None:
        """Drop the finished rows and admit up to ``admit`` waiting ones (their prompts prefilled, their caches
        merged into the running one)."""
        import torch

        from lit_grpo.engines.continuous_batching import left_pad_rows, rebuild_cache

        keep = (~self.finished).nonzero().squeeze(-1)
        start = first_used_column(self.attention[keep]) if keep.numel() else self.attention.shape[1]
        taken = self._take(admit) if admit else []
        new_cache = new_attention = new_logits = None
        new_slices: list[Slice] = []
        kept_slices = []
        order = torch.full((int(self.counts.numel()),), -1, dtype=torch.long, device=keep.device)
        order[keep] = torch.arange(keep.numel(), device=keep.device)
        for part in self.slices:
            mine = order[part.positions]
            stays = mine >= 0
            if bool(stays.any()):
                kept_slices.append(Slice(part.ticket, mine[stays], part.rows[stays]))
        counts, finished, max_new = self.counts[keep], self.finished[keep], self.max_new[keep]
        self.counts = counts  # ``_prefill`` numbers the new rows after the kept ones
        if taken:
            new_cache, new_attention, new_logits, new_slices = self._prefill(taken)
            self.room = max([self.room] + [t.max_new for t, _, _ in taken])
        rebuild_cache(self.cache, keep, start, new_cache, room=self.room)
        parts = [self.attention[keep, start:]] + ([new_attention] if taken else [])
        self.attention = left_pad_rows(parts, dim=1)
        self.logits = torch.cat([self.logits[keep]] + ([new_logits] if taken else []))
        added = sum(c for _, _, c in taken)
        self.counts = torch.cat([counts, counts.new_zeros(added)])
        self.finished = torch.cat([finished, finished.new_zeros(added)])
        self.max_new = torch.cat([max_new] + [torch.full((c,), t.max_new, device=max_new.device)
                                              for t, _, c in taken])
        self.slices = kept_slices + new_slices
