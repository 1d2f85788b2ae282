"""`ServerEngine`: rollouts from one or more rollout servers over HTTP (the paper's layout: a GPU serves
rollouts, the FSDP ranks train), the policy's weights pushed to them every v batches.

Two kinds of server speak the same protocol (``lit_grpo.wire.protocol`` documents it):

- ``kind: lit_grpo``: the project's own ``python -m lit_grpo serve`` (``lit_grpo.serve.server``).
- ``kind: vllm``: ``vllm serve`` (0.32 or 0.33) in dev mode; what differs lives in
  ``lit_grpo.engines.remote.vllm_client``, imported only for that kind.

The engine owns one ``ServerConnection`` per server, the weight push (``pusher``, a ``WeightPusher``,
``lit_grpo.engines.remote.weight_push``) and, for ``data.reference_on_server``, the client of the server's pi_ref
(``reference``, a ``ReferenceClient``, ``lit_grpo.engines.remote.reference_client``).

Generation is two steps (``RemoteEngine``), so that a background thread can run the first:

- ``request_rollouts``: HTTP only. Every rank sends its own prompts, spread over the servers in contiguous
  chunks, and gets back ``Rollouts``: the completions, or the error that stopped them. No torch.distributed
  call, so it is safe on a thread other than the training thread.
- ``check_lockstep(rollouts)``: on the training thread, one ``all_reduce`` of a flag (option ``lockstep``,
  world > 1) lets all ranks stop together when one rank's request failed; returns the completions.

``generate`` is both, one after the other.
"""

from __future__ import annotations

import json
import secrets
import time
import warnings
from collections.abc import Callable, Hashable, Iterable, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import torch
from torch import nn

from lit_grpo.core.batch import MicroBatch
from lit_grpo.core.distributed import close_at_exit, everyone, rank_and_world
from lit_grpo.core.option_groups import as_group, plain
from lit_grpo.engines.base import (
    AdapterEngine,
    AdapterUpdate,
    Completion,
    ReferenceServing,
    RemoteEngine,
    Rollouts,
    SamplingConfig,
    ScoringLayout,
)
from lit_grpo.engines.options import ServerOptions
from lit_grpo.engines.progress import wait_reporting
from lit_grpo.engines.remote.adapter_push import merges_held, push_served_adapter, push_vllm_adapter
from lit_grpo.engines.remote.completions import response_groups
from lit_grpo.engines.remote.connection import RouterConnection, ServerConnection
from lit_grpo.engines.remote.fleet import Fleet
from lit_grpo.engines.remote.kept_weights import LORA_SPEC_KEY, MERGES_KEY, KeptWeights
from lit_grpo.engines.remote.prefix_cache import PrefixCacheMeter, counters_of
from lit_grpo.engines.remote.reference_client import ReferenceClient
from lit_grpo.engines.remote.request_layout import (
    CHUNK_SEED_STRIDE,
    SEED_MODULUS,
    Request,
    contiguous_runs,
)
from lit_grpo.engines.remote.session_routing import SessionRouter, spread_stats
from lit_grpo.engines.remote.weight_push import WeightPusher
from lit_grpo.engines.sampling_fields import vllm_sampling_fields
from lit_grpo.wire.auth import TOKEN_ENV, TOKEN_FILE_ENV, find_token
from lit_grpo.wire.protocol import ServerError, version_text


class ServerEngine(RemoteEngine, ReferenceServing, AdapterEngine):
    """Rollouts from rollout servers (``data.engine: server``, ``data.engine_options: {url: ..., ...}``).

    Args:
        policy: the policy module, or a callable returning it; vLLM's transfer needs its parameter names and
            shapes before the first gather (the data module passes it).
        serves_reference: the data module asks the servers for pi_ref's log-probs (``data.reference_on_server``),
            so ``WeightSync`` pushes pi_ref to them before the policy.
        **options: the fields of ``lit_grpo.engines.options.ServerOptions`` (``url`` or ``urls``, ``token``,
            ``timeout_s``, ``kind``, ``bucket_mb``, ...), which documents them.
    """

    def __init__(self, policy: nn.Module | Callable[[], nn.Module] | None = None, serves_reference: bool = False,
                 **options: Any) -> None:
        options = self.options = as_group(ServerOptions, options, "ServerEngine")
        if (options.url is None) == (options.urls is None):
            raise ValueError("ServerEngine needs exactly one of url (one server) and urls (a list of servers)")
        urls = [options.url] if options.url is not None else list(options.urls or [])
        if not urls or len(set(urls)) != len(urls) or not all(isinstance(u, str) for u in urls):
            raise ValueError(f"urls must be a non-empty list of distinct server URLs, got {urls!r}")
        token = options.token if options.token is not None else find_token(options.token_file)[0]
        if token is None and options.kind == "lit_grpo":
            raise ValueError(f"ServerEngine needs the server's token: engine_options.token, token_file, "
                             f"${TOKEN_FILE_ENV} or ${TOKEN_ENV}")
        if token is None and options.transfer_backend == "gloo":  # the plugin refuses a push without it
            raise ValueError(f"kind 'vllm' with backend 'gloo' needs the token vllm serve was started with "
                             f"(${TOKEN_ENV} in its environment, and --api-key): engine_options.token, token_file, "
                             f"${TOKEN_FILE_ENV} or ${TOKEN_ENV}")
        self.kind = options.kind
        self.timeout_s = float(options.timeout_s)
        self.generate_timeout_s = float(options.generate_timeout_s)
        # a kept copy of the pushed weights is the trainer's function of them: alpha is its recompute
        default_rescore = options.kind == "lit_grpo" or options.keep_pushed_weights
        self.rescore = default_rescore if options.rescore is None else bool(options.rescore)
        stops = options.stop_token_ids
        self.stop_token_ids = sorted({int(t) for t in stops}) if stops is not None else []
        self.lockstep = bool(options.lockstep)
        self.servers = [ServerConnection(u, token, self.timeout_s) for u in urls]
        #: where completions go through when a router fronts the servers (``router_url``); pushes go to each server
        self.router = (RouterConnection(options.router_url, token, self.timeout_s, self.servers)
                       if options.router_url is not None else None)
        if self.router is not None:  # it answers, and takes this token (lit_grpo route checks it on every route)
            self.router.client.text("GET", "/health")
        #: without a router: which server each multi-turn session's turns go to (sticky, least-loaded)
        self.sessions = SessionRouter(len(self.servers), first=rank_and_world()[0])
        #: each open session's ``cache_salt`` (kind vllm): its trajectory's turns share the first turn's
        self._session_salts: dict[Hashable, str] = {}
        #: a router's session ids: unique across the ranks and runs that share it
        self.session_prefix = f"{secrets.token_hex(4)}-r{rank_and_world()[0]}"
        #: vllm serve's prefix-cache counters (``GET /metrics`` of each server), read once a batch; the first read,
        #: now, is the baseline
        self.prefix_cache = (PrefixCacheMeter(counters_of(self.servers), len(self.servers))
                             if options.kind == "vllm" else None)
        if self.prefix_cache is not None:
            self.prefix_cache.take()
        self.synced_step = 0
        self.serves_reference = bool(serves_reference)
        #: servers that a push after the first reached with a new transfer group (a restarted server rejoining), the
        #: same on every rank: the data module's sampler check takes their first batch again (``take_rejoined``)
        self.rejoined: set[str] = set()
        #: called on every rank before each push (the asynchronous producer's ``drain``), see ``load_weights``
        self.before_push: list[Callable[[], None]] = []
        #: partial rollouts (``keep_generating_through_pushes``): a push keeps the generations in flight
        self.partial_rollouts = False
        #: pushes begun so far: a completion that reports no version is labelled only if none began while it ran
        self.pushes_started = 0
        #: which servers are up (``lit_grpo.engines.remote.fleet``): a dead one costs a retry, not the run
        self.fleet = Fleet(self.servers, self.timeout_s)
        self.fleet.router = self.router  # behind a router, its list of servers follows which are up
        self.pusher = WeightPusher(self.servers, options, self._server_dtype(options.dtype), policy, self.fleet)
        self.reference = ReferenceClient(self.fleet, self.generate_timeout_s)
        self._merges_applied: int | None = None  # asked of the servers at the first LoRA push
        self.vllm_adapters = None  # kind vllm with model.lora: vllm_client.ServeAdapters, made at the first push
        #: the trainer's copy of the last pushed weights (``keep_pushed_weights``), which ``score`` recomputes
        self.kept_weights: KeptWeights | None = None
        if options.keep_pushed_weights:
            self.kept_weights = KeptWeights(self._kept_policy, options.kept_weights_device)
        close_at_exit(self.close)  # the end of a fit run from the command line; a library user may call it sooner

    def keep_generating_through_pushes(self) -> None:
        """Partial rollouts (``data.partial_rollouts``): a policy push pauses the servers with ``/pause?mode=keep``
        (the generations in flight stop at a token boundary, the weights are swapped, they go on under the new ones)
        instead of waiting for them, and a completion may then carry several versions, each one this trainer pushed
        (``Completion.versions`` and ``span_lengths``). Adapter pushes (``model.lora``) still wait."""
        self.partial_rollouts = True
        self.pusher.pause_mode = "keep"

    # ---- servers ------------------------------------------------------------------------------------
    def _server_dtype(self, requested: str | None) -> torch.dtype:
        """Check every server answers (URL and token right) and agree on the dtype weights travel in."""
        from lit_grpo.wire.weight_transfer import dtype_from_name

        if self.kind == "vllm":
            from lit_grpo.engines.remote.vllm_client import vllm_dtype

            return vllm_dtype(self.servers, requested)
        found = set()
        for server in self.servers:
            dtypes = server.client.get("/weight_info").get("dtypes") or []
            if len(dtypes) != 1:
                raise ServerError(f"rollout server {server.url} reports weight dtypes {dtypes}; expected exactly one")
            found.add(dtypes[0])
        if len(found) > 1:
            raise ValueError(f"the rollout servers hold weights in different dtypes {sorted(found)}")
        (served,) = found
        if requested is not None and requested != served:
            raise ValueError(f"dtype {requested!r} was asked for, but the server holds {served!r}")
        return dtype_from_name(served)

    def weight_versions(self) -> dict[str, str | None]:
        """The ``weight_version`` each server reports now."""
        return {s.url: version_text(s.client.get("/weight_info").get("weight_version")) for s in self.servers}

    def weight_checksums(self) -> dict[str, dict[str, str]]:
        """Each server's SHA-256 of every parameter (``POST /weight_checker``), for exact comparisons."""
        return {s.url: s.client.post("/weight_checker", {"action": "checksum"})["checksums"] for s in self.servers}

    def close(self) -> None:
        """Shut the weight transfer down (the project's groups, vLLM's trainer side with its sockets, stores and
        groups) and remove the adapter versions written for ``vllm serve`` (``ServeAdapters.close``). Runs at exit
        too; a second call does nothing, and a push after it starts over (a new group, new adapter versions)."""
        for server in self.servers:
            server.close_group()
        adapters, self.vllm_adapters = self.vllm_adapters, None
        if adapters is not None:
            adapters.close()

    # ---- weights ------------------------------------------------------------------------------------
    def _kept_policy(self) -> nn.Module:
        if self.pusher._policy is None:
            raise ValueError("keep_pushed_weights needs the policy module (ServerEngine(policy=...); the data module "
                             "passes it)")
        return self.pusher.policy()

    def _before_push(self) -> None:
        """Every rank runs the hooks (the asynchronous producer's drain: batches already requested finish first),
        then, when there are any, waits for the others, so that rank 0 pauses the servers only once every rank's
        requests are in."""
        for hook in self.before_push:
            hook()
        if self.before_push and rank_and_world()[1] > 1:
            everyone(True)

    def _pushing(self, step: int) -> None:
        """Record the version a push is about to write: with partial rollouts a completion can carry it before the
        push has returned (its request went on under it right after the swap)."""
        self.pushes_started += 1
        for server in self.servers:
            server.pushed_versions.add(str(int(step)))

    @torch.no_grad()
    def load_weights(self, named_tensors: Iterable[tuple[str, torch.Tensor]], step: int) -> None:
        """Push the full parameters to every server (``WeightPusher.push``: rank 0 sends, every rank gathers), then
        record the version the servers report. Raises ``ServerError`` on every rank if the push failed on any
        server; a server left behind keeps its previous weights and version."""
        self._before_push()
        self._pushing(step)
        # vLLM's LoRA labels a completion with the adapter it named: a reload of its base must not cut generations
        self.pusher.pause_mode = "keep" if self.partial_rollouts and self.vllm_adapters is None else "wait"
        kept = self.kept_weights
        if kept is not None:  # copied as the push takes each tensor: no second gather
            named_tensors = kept.keeping(named_tensors)
        try:
            versions = self.pusher.push(named_tensors, str(int(step)), "policy")
        except ServerError:
            for server in self.servers:  # its version is no longer known on any rank
                server.expected_version = None
            raise
        first = self.fleet.pushed is None
        self.record_push(versions)
        for server in self.servers:  # pi_ref is pushed again to a server the push left out or joined anew
            if server.url in self.fleet.left_out or (not first and server.url in self.pusher.joined):
                server.reference_version = None
        if not first:
            self.rejoined.update(self.pusher.joined)
        self.fleet.pushed = str(int(step))
        if kept is not None:
            kept.commit(self.synced_step)

    def take_rejoined(self) -> list[str]:
        """The servers that rejoined since the last call (``rejoined``), and forget them: the same on every rank,
        so the sampler check arms again on all of them together."""
        taken, self.rejoined = sorted(self.rejoined), set()
        return taken

    @property
    def reference_version(self) -> str | None:
        """The label of the pi_ref every server the last push reached holds (``None``: none pushed yet, a push
        failed, or a server that rejoined lacks it, so ``WeightSync`` pushes pi_ref again and the trainer scores
        pi_ref itself until then). It depends on the pushes' outcomes only, the same on every rank."""
        labels = {s.reference_version for s in self.servers if s.url not in self.fleet.left_out}
        return labels.pop() if len(labels) == 1 else None

    @reference_version.setter
    def reference_version(self, version: str | None) -> None:
        for server in self.servers:
            server.reference_version = version

    @property
    def merges_applied(self) -> int:
        """How many of the policy's merges the servers' bases hold (``model.lora``;
        ``lit_grpo.engines.remote.adapter_push.merges_held``)."""
        return merges_held(self)

    @torch.no_grad()
    def load_adapter(self, update: AdapterUpdate, step: int) -> None:
        """A LoRA push (``model.lora``): the adapter, and the merges the servers' bases lack, to every server
        (``lit_grpo.serve.served_adapter``: they sample with base plus adapter, unmerged, and check their base
        against ``update.base_hash``). Only rank 0's update is sent; every rank holds the same one. With
        ``data.reference_on_server`` the servers' pi_ref is their base with the adapter off, labelled with the merges
        it holds, so no pi_ref is pushed. With ``keep_pushed_weights`` the trainer keeps the adapter pushed
        (``KeptWeights.keep_adapter``)."""
        if not isinstance(update, AdapterUpdate):
            raise TypeError(f"load_adapter takes an AdapterUpdate, got {type(update).__name__}")
        if self.kept_weights is not None:
            self.kept_weights.invalidate()  # until this push is through
        if self.kind == "vllm":
            push_vllm_adapter(self, update, step)
        else:
            push_served_adapter(self, update, step)
        if self.kept_weights is not None:  # the adapter only: the base is the policy's, at this many merges
            self.kept_weights.keep_adapter(update.adapter, update.spec, self.merges_applied, self.synced_step)

    def record_push(self, versions: dict[str, str]) -> None:
        """The versions a push left on the servers it reached (``versions``, by URL; a server it did not reach is
        down, ``Fleet``), and ``synced_step``: theirs."""
        for server in self.servers:
            server.expected_version = versions.get(server.url)
        self.synced_step = int(next(iter(versions.values())))

    @torch.no_grad()
    def load_reference(self, named_tensors: Iterable[tuple[str, torch.Tensor]], version: str) -> None:
        """Push pi_ref's full parameters into every project server's copy of pi_ref (``data.reference_on_server``),
        labelled ``version``; the same transfer as ``load_weights``, and the rollout policy is untouched.

        The label changes only once the push is through, and is cleared only when it failed: a scoring job of the
        asynchronous producer may have passed its check of the label and not yet read it when the push begins,
        and the push drains the producer first. Until the servers swap (all or nothing, at the end of the push)
        they hold, and score with, the previous pi_ref, which the label names."""
        if self.kind != "lit_grpo":
            raise ValueError(f"pi_ref can be pushed to the project's server only, not to kind {self.kind!r}")
        self._before_push()
        try:
            reached = self.pusher.push(named_tensors, str(version), "reference")
        except ServerError:
            self.reference_version = None  # which pi_ref each server holds is no longer known
            raise
        for server in self.servers:  # one it did not reach is down (``Fleet``): pi_ref is pushed to it when it is back
            server.reference_version = str(version) if server.url in reached else None

    def score_reference(self, micro_batches: list[MicroBatch], num_sequences: int, width: int, temperature: float,
                        autocast: str | None = None) -> tuple[torch.Tensor, str]:
        """pi_ref's log-probs from the first server up that holds the pi_ref last pushed (``ReferenceClient.score``);
        one lost on the way hands the batch to the next."""
        return self.reference.score(micro_batches, num_sequences, width, temperature, autocast,
                                    self.reference_version)

    # ---- generation ---------------------------------------------------------------------------------
    def request_rollouts(self, prompts: list[list[int]], n: int, sampling: SamplingConfig, seed: int,
                         sessions: Sequence[Hashable] | None = None) -> Rollouts:
        """This rank's completion requests, HTTP only: no torch.distributed call, so it is safe on a background
        thread. The prompts are spread over the servers in contiguous chunks, one request per chunk, sent in
        parallel; with ``sessions`` (the multi-turn session of each prompt) each prompt goes to its session's
        server instead (``SessionRouter``: a new session to the least-loaded one, a known one where it started).
        Bad arguments raise ``ValueError`` at once; a failed request (``ServerError``, or an odd answer) comes back
        as ``Rollouts.error``, for ``check_lockstep`` to share with the other ranks."""
        if n < 1:
            raise ValueError(f"n must be >= 1, got {n}")
        if any(len(p) == 0 for p in prompts):
            raise ValueError("every prompt needs at least one token")
        if sessions is not None and len(sessions) != len(prompts):
            raise ValueError(f"sessions must name one session per prompt, got {len(sessions)} for {len(prompts)} "
                             "prompts")
        try:
            return Rollouts(self._generate(prompts, n, sampling, seed, sessions))
        except ServerError as err:
            return Rollouts(None, str(err))
        except Exception as err:  # noqa: BLE001 (an odd answer: still stop every rank together)
            return Rollouts(None, f"rollout request failed: {type(err).__name__}: {err}")

    def check_lockstep(self, rollouts: Rollouts) -> list[list[Completion]]:
        """On the training thread, after this rank's requests: with ``lockstep`` and more than one rank, one
        ``all_reduce`` (a collective every rank must reach) tells every rank whether all requests succeeded; if
        one failed, every rank raises ``ServerError`` (the failing rank with its own message). Returns
        ``rollouts.groups``."""
        error = rollouts.error
        _, world = rank_and_world()
        if self.lockstep and world > 1 and not everyone(error is None) and error is None:
            error = "a rollout request of another rank failed (its log names the server and the error)"
        if error is not None:
            raise ServerError(error)
        return rollouts.groups  # type: ignore[return-value]

    def release_sessions(self, sessions: Iterable[Hashable]) -> None:
        """The sessions' trajectories ended: their servers take new sessions in their place (``SessionRouter``, or
        the router's ``POST /finish_session``; a router that misses one expires it after its TTL)."""
        sessions = list(sessions)
        for session in sessions:
            self._session_salts.pop(session, None)
        if self.router is None:
            self.sessions.release(sessions)
            return
        for session in sessions:
            try:
                self.router.client.post("/finish_session", query={"session_id": self.session_id(session)})
            except ServerError as err:
                warnings.warn(f"the router did not release a session ({err}); it expires at the router's TTL",
                              stacklevel=2)
                return

    def session_id(self, session: Hashable) -> str:
        """A session's id at the router (``X-Session-ID``): unique across the ranks and runs that share it."""
        return f"{self.session_prefix}-{session}"

    def routing_stats(self) -> dict[str, float]:
        """With several servers and no router, the sequences sent to each since the last call, and the busiest
        server's share over the mean (``session_routing.spread_stats``; with a router its own metrics say where it
        sent them); with ``vllm serve``, each server's prefix-cache hit rate since the last call, over every
        client's requests (``prefix_cache.PrefixCacheMeter``; the project's server has no prefix cache)."""
        sent = self.sessions.take_sent()
        stats = spread_stats(sent) if len(self.servers) > 1 and self.router is None else {}
        stats.update(self.fleet.stats())
        if self.prefix_cache is not None:
            stats.update(self.prefix_cache.take())
        return stats

    def _requests(self, prompts: list[list[int]], n: int, seed: int,
                  sessions: Sequence[Hashable] | None = None) -> list[Request]:
        """The requests of one call. The project's server takes one request per server (a contiguous chunk of
        prompts, seeded as one ``TransformersEngine.generate`` call: with one server the rollouts equal the
        in-process engine's; with ``sessions``, the prompts of each server's sessions, in their order). vLLM gets
        one request per prompt (``vllm_requests``). Through a router, one request per session (per prompt without
        sessions), named in its ``X-Session-ID``, each seeded as vLLM's prompts are."""
        if self.router is not None:
            return self._router_requests(prompts, n, seed, sessions)
        if sessions is not None:
            chosen = self.sessions.route(sessions, [n] * len(prompts))
        else:  # contiguous runs, one per server (at most one per prompt), from this rank's own first server
            chosen = contiguous_runs(len(prompts), len(self.servers), self.kind, rank_and_world()[0])
            for server in chosen:
                self.sessions.count_sent(server, n)
        if self.kind == "vllm":
            from lit_grpo.engines.remote.vllm_client import vllm_requests

            return [Request(server, indices, s) for server, indices, s in
                    vllm_requests(self.servers, prompts, n, seed, chosen)]
        out = []
        # seeded by the chunk's place in the call, not by its server: which server takes it changes nothing
        for c, server in enumerate(dict.fromkeys(chosen)):
            indices = [p for p, s in enumerate(chosen) if s == server]
            chunk_seed = int(seed) if c == 0 else (int(seed) * CHUNK_SEED_STRIDE + c) % SEED_MODULUS
            out.append(Request(self.servers[server], indices, chunk_seed % 2**63))
        return out

    def _router_requests(self, prompts: list[list[int]], n: int, seed: int,
                         sessions: Sequence[Hashable] | None) -> list[Request]:
        """Through a router: one request per session, or per prompt without sessions, seeded as vLLM's prompts are
        (``prompt_seed`` of its first prompt), so that no two share a seed whatever server answers."""
        from lit_grpo.engines.vllm_engine import prompt_seed

        keys: list[Hashable] = list(sessions) if sessions is not None else list(range(len(prompts)))
        order: dict[Hashable, list[int]] = {}
        for p, key in enumerate(keys):
            order.setdefault(key, []).append(p)
        return [Request(self.router, indices, prompt_seed(seed, indices[0], n) % 2**63,
                        self.session_id(key) if sessions is not None else None)
                for key, indices in order.items()]

    def _generate(self, prompts: list[list[int]], n: int, sampling: SamplingConfig, seed: int,
                  sessions: Sequence[Hashable] | None = None) -> list[list[Completion]]:
        if not prompts:
            return []
        requests = self._requests(prompts, n, seed, sessions)
        salts = self._cache_salts(len(prompts), sessions)
        results: list[list[Completion] | None] = [None] * len(prompts)
        with ThreadPoolExecutor(max_workers=min(32, len(requests))) as pool:
            futures = [pool.submit(self._complete_on_fleet, r, [prompts[i] for i in r.indices], n, sampling,
                                   salts[r.indices[0]] if salts is not None else None) for r in requests]
            answered = wait_reporting(futures, len(prompts) * n, lambda groups: (
                sum(map(len, groups)), sum(len(c.token_ids) for g in groups for c in g)))  # a long rollout's progress
            for request, groups in zip(requests, answered):
                for i, group in zip(request.indices, groups):
                    results[i] = group
        return results  # type: ignore[return-value]

    def _cache_salts(self, count: int, sessions: Sequence[Hashable] | None) -> list[str] | None:
        """Each prompt's ``cache_salt`` for ``vllm serve``: the weight version it is admitted under, the same for
        every turn of a trajectory (its session's first). vLLM's prefix cache then never serves a block computed
        under other weights: a ``keep`` pause ignores ``clear_cache`` (vLLM 0.32), so without the salt a prompt
        cached before a push would be scored with the old weights' KV after it. ``None`` for the project's server,
        which keeps no prefix cache."""
        if self.kind != "vllm":
            return None
        now = f"lit-grpo-weights-{self.synced_step}"
        if sessions is None:
            return [now] * count
        return [self._session_salts.setdefault(key, now) for key in sessions]

    def _complete_on_fleet(self, request: Request, prompts: list[list[int]], n: int, sampling: SamplingConfig,
                           salt: str | None = None) -> list[list[Completion]]:
        """``request`` on its server, or, when that one is lost, as it is (its prompts, its seed) on the next server
        up (``Fleet.on_any``); through a router, sent again once the servers it could not reach are out of its list
        (``Fleet.through_router``)."""
        if isinstance(request.server, RouterConnection):
            return self.fleet.through_router(lambda: self._complete(
                request.server, prompts, n, sampling, request.seed, request.session, salt))
        return self.fleet.on_any(request.server, lambda server: self._complete(
            server, prompts, n, sampling, request.seed, request.session, salt))

    def _complete(self, server: ServerConnection | RouterConnection, prompts: list[list[int]], n: int,
                  sampling: SamplingConfig, seed: int, session: str | None = None,
                  salt: str | None = None) -> list[list[Completion]]:
        # every sampling field is explicit: vllm serve fills the ones a request leaves unset from the model's
        # generation config (lit_grpo.engines.sampling_fields); the project's server ignores the extra ones
        body = {"prompt": [[int(t) for t in p] for p in prompts], "n": n, "seed": int(seed),
                **vllm_sampling_fields(sampling), "logprobs": 0, "return_token_ids": True,
                "return_weight_versions": True}
        if self.stop_token_ids:
            body["stop_token_ids"] = self.stop_token_ids
        if salt is not None:  # vllm serve: its prefix cache keyed by the weights too (``_cache_salts``)
            body["cache_salt"] = salt
        adapter = self.vllm_adapters.current() if self.vllm_adapters is not None else None
        if adapter is not None:  # kind vllm with model.lora: the request names the newest adapter version
            body["model"] = adapter[0]
        deadline = time.monotonic() + self.generate_timeout_s
        wait = 0.1
        pushes = self.pushes_started  # before the request is admitted: see _groups
        while True:
            try:
                response = server.client.post("/v1/completions", body, timeout_s=self.generate_timeout_s,
                                              headers={"X-Session-ID": session} if session is not None else None)
                break
            except ServerError as err:
                if err.status != 503 or time.monotonic() + wait > deadline:
                    raise
                time.sleep(wait)  # paused for another trainer's weight update: wait for /resume
                wait = min(2 * wait, 2.0)
        if adapter is not None:
            from lit_grpo.engines.remote.vllm_client import with_adapter_versions

            response = with_adapter_versions(response, adapter[1])
        return self._groups(server, response, len(prompts), n, pushes)

    def _groups(self, server: ServerConnection | RouterConnection, response: dict, num_prompts: int, n: int,
                pushes: int | None = None) -> list[list[Completion]]:
        """``response_groups`` (``lit_grpo.engines.remote.completions``): the answer's completions by prompt, each
        labelled with the versions that sampled its tokens and the server that answered."""
        pushed = pushes is not None and pushes != self.pushes_started
        return response_groups(server, response, num_prompts, n, pushed, self.partial_rollouts)

    # ---- the rest of the interface ------------------------------------------------------------------
    def score(self, layout: ScoringLayout, temperature: float) -> torch.Tensor | None:
        """With ``keep_pushed_weights``: the kept copy's log-probs of a batch sampled with the last pushed version
        (``KeptWeights.score``, in the caller's precision context: the data module gives the trainer's), so alpha
        is the trainer's recompute; ``None`` otherwise (alpha is the servers' report)."""
        if self.kept_weights is None:
            return None
        return self.kept_weights.score(layout, temperature, self.synced_step, self.head_chunk_mb)

    def kept_weights_stats(self) -> dict[str, float]:
        """``KeptWeights.stats`` (empty without ``keep_pushed_weights``): the batch statistics of the kept copy."""
        return {} if self.kept_weights is None else self.kept_weights.stats()

    def state_dict(self) -> dict[str, torch.Tensor] | None:
        """With ``keep_pushed_weights``: the kept copy (``KeptWeights.state_dict``), which ``load_state_dict`` pushes
        back to the servers and keeps again, so a checkpoint taken while the servers lag the policy resumes exactly
        (same weights sampled, same alpha). Otherwise ``None``: the weights live in the server, and such a checkpoint
        resumes from the current policy (``WeightSync`` warns), not an exact continuation. Checkpoints taken right
        after a sync resume exactly either way (the resumed run pushes the policy, which is the kept copy)."""
        if self.kept_weights is None or self.kept_weights.version != self.synced_step:
            return None
        return self.kept_weights.state_dict()

    def load_state_dict(self, state: dict[str, Any], step: int) -> None:
        """Push ``state_dict``'s weights to the servers (and keep them): full tensors as a full push; a kept adapter
        as an adapter push carrying the policy's merges the servers lack, when the policy's base still holds the
        merges it was pushed against (else the current adapter, with a warning: not an exact continuation)."""
        state = dict(state)
        spec, merges = state.pop(LORA_SPEC_KEY, None), state.pop(MERGES_KEY, None)
        if spec is None:
            self.load_weights(state.items(), step)
            return
        from lit_grpo.models.lora import adapter_update, base_hash, merge_log

        policy = self.pusher.policy()
        entries = merge_log(policy).entries
        if int(merges) != len(entries):
            warnings.warn(f"the checkpoint's kept adapter was pushed against {merges} merges and the policy has made "
                          f"{len(entries)}: the servers get the current adapter, so this run is not an exact "
                          "continuation", stacklevel=2)
            self.load_adapter(adapter_update(policy, self.merges_applied, with_hash=True, step=step), step)
            return
        update = AdapterUpdate(spec=json.loads(spec), merges=tuple(entries[self.merges_applied:]), adapter=state,
                               base_hash=base_hash(policy), step=int(step))
        self.load_adapter(update, step)


def check_servers(options: ServerOptions) -> None:
    """Before anything loads: every server answers with the right token. Raises ``ValueError`` (one line, naming
    the URL) otherwise, so the CLI reports it as a usage error."""
    try:
        ServerEngine(**plain(options)).close()
    except ServerError as err:
        if err.status in (401, 403):  # it answers, and refuses this token: starting it again would not help
            raise ValueError(f"the rollout server refused this run's token, the token is wrong ({err}); expected "
                             f"the token the server was started with, in data.engine_options.token or token_file "
                             f"(or ${TOKEN_ENV}, ${TOKEN_FILE_ENV})") from None
        raise ValueError(f"the rollout server does not answer: {err}. Start it first (python -m lit_grpo serve) "
                         "or fix data.engine_options") from None
