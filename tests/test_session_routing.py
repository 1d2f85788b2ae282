"""Sticky sessions over several rollout servers (``lit_grpo.engines.remote.session_routing``): a new session goes to
the least-loaded server, its later turns stay there, a released one frees its server; the trajectory runner names
each group's session in every turn and releases it when its last trajectory ends; ``ServerEngine`` sends each prompt
to its session's server, and keeps the contiguous chunks (and their seeds) without sessions."""

from __future__ import annotations

import pytest
from test_multi_turn import SAMPLING, TOKENIZER, count_up
from toy_environments import GuessTheNumber, ScriptedSampler

from lit_grpo.data.multi_turn import MultiTurnOptions, TrajectoryRunner
from lit_grpo.engines.remote.request_layout import contiguous_runs
from lit_grpo.engines.remote.session_routing import SessionRouter, spread_stats
from lit_grpo.environments.rendering import ConversationRenderer
from lit_grpo.environments.tool_calls import parse_hermes
from lit_grpo.environments.tools import ToolBox


def test_a_new_session_takes_the_least_loaded_server_and_keeps_it_until_released():
    router = SessionRouter(3)
    assert router.route(["a", "b", "c", "d"], [4, 4, 2, 1]) == [0, 1, 2, 2]  # d: server 2 holds 2 < 4
    assert router.load() == [4, 4, 3]
    assert router.route(["d", "e"], [1, 1]) == [2, 2]  # d stays; e: 2 holds 3 < 4
    assert router.route(["a"], [1]) == [0]  # a's later turn: one trajectory left, still server 0
    assert router.load() == [1, 4, 4]
    router.release(["b", "unknown"])
    assert router.load() == [1, 0, 4] and router.server_of("b") is None
    assert router.route(["f", "g"], [3, 3]) == [1, 0]  # least first, ties to the lowest index
    assert router.take_sent() == [4 + 1 + 3, 4 + 3, 2 + 1 + 1 + 1] and router.take_sent() == [0, 0, 0]


def test_route_refuses_mismatched_counts_and_a_router_needs_a_server():
    with pytest.raises(ValueError, match="one row count per session, got 2 sessions and 1 counts"):
        SessionRouter(2).route(["a", "b"], [1])
    with pytest.raises(ValueError, match="at least one server, got 0"):
        SessionRouter(0)


def test_spread_stats_name_each_servers_sequences_and_the_busiest_share():
    assert spread_stats([6, 2]) == {"server_0_sequences": 6.0, "server_1_sequences": 2.0,
                                    "server_load_ratio_max": pytest.approx(1.5)}
    assert spread_stats([0, 0])["server_load_ratio_max"] == 1.0


def test_contiguous_runs_are_the_chunks_each_kind_used_before_sessions():
    # the project's server: chunk c holds prompts c * P // k .. (c + 1) * P // k - 1
    assert contiguous_runs(3, 2, "lit_grpo") == [0, 1, 1]
    assert contiguous_runs(5, 3, "lit_grpo") == [0, 1, 1, 2, 2]
    assert contiguous_runs(1, 3, "lit_grpo") == [0]
    # vLLM: prompt p to server p * k // P
    assert contiguous_runs(3, 2, "vllm") == [0, 0, 1]


class NamedGuess(GuessTheNumber):
    """GuessTheNumber whose prompt names the row's player, so that each group's prompt differs."""

    def __init__(self, row: dict) -> None:
        super().__init__(row)
        self.name = row["name"]

    def reset(self) -> str:
        return f"Guess my number, {self.name}."


class RoutedSampler(ScriptedSampler):
    """A scripted ``Sample`` that takes sessions, routes them over two servers and records, per request, each
    prompt with its session and server."""

    def __init__(self, script, router: SessionRouter) -> None:  # noqa: ANN001
        super().__init__(script)
        self.router = router
        self.sent: list[tuple[tuple[int, ...], object, int]] = []
        self.released: list[object] = []

    def __call__(self, prompts, n, sampling, seed, sessions=None):  # noqa: ANN001, ANN204
        assert sessions is not None and len(sessions) == len(prompts)
        servers = self.router.route(sessions, [n] * len(prompts))
        self.sent += [(tuple(p), s, server) for p, s, server in zip(prompts, sessions, servers)]
        return super().__call__(prompts, n, sampling, seed)

    def release(self, sessions) -> None:  # noqa: ANN001
        self.released += list(sessions)
        self.router.release(sessions)


def test_every_turn_of_a_trajectory_goes_to_the_server_of_its_first_turn_and_ended_sessions_are_released():
    runner = TrajectoryRunner(NamedGuess, ToolBox([]), parse_hermes, ConversationRenderer(TOKENIZER),
                              MultiTurnOptions(max_turns=6))
    router = SessionRouter(2)
    sampler = RoutedSampler(count_up, router)
    # targets 1, 4, 2: the groups need 2, 5 and 3 turns at most (completion j guesses j, then one more per turn)
    rows = [{"target": 1, "name": "Ann"}, {"target": 4, "name": "Bob"}, {"target": 2, "name": "Cy"}]
    groups = runner.run(rows, 2, sampler, SAMPLING, seed=0, release=sampler.release).groups
    assert [max(c.trajectory["turns"] for c in g) for g in groups] == [2, 5, 3]
    first_turn = {p: (s, server) for p, s, server in sampler.sent[:3]}
    assert [server for _, _, server in sampler.sent[:3]] == [0, 1, 0]  # least-loaded: 2 / 2 / 4 sequences
    later = sampler.sent[3:]
    assert later
    for prompt, session, server in later:
        (start,) = [p for p in first_turn if prompt[: len(p)] == p]  # the group's prompt it continues
        assert (session, server) == first_turn[start]
    # released once each, when its group's last trajectory ended: the shortest first
    sessions = [s for s, _ in first_turn.values()]
    assert sampler.released == [sessions[0], sessions[2], sessions[1]]
    assert router.load() == [0, 0]


def test_a_failed_turn_releases_every_open_session():
    from lit_grpo.engines.base import Rollouts

    runner = TrajectoryRunner(GuessTheNumber, ToolBox([]), parse_hermes, ConversationRenderer(TOKENIZER),
                              MultiTurnOptions(max_turns=6))
    router = SessionRouter(2)
    sampler = RoutedSampler(count_up, router)
    calls = [0]

    def failing(prompts, n, sampling, seed, sessions=None):  # noqa: ANN001, ANN202
        calls[0] += 1
        if calls[0] == 2:
            router.route(sessions, [n] * len(prompts))
            return Rollouts(None, "server down")
        return sampler(prompts, n, sampling, seed, sessions=sessions)

    out = runner.run([{"target": 4}, {"target": 3}], 2, failing, SAMPLING, seed=0, release=sampler.release)
    assert out.error == "server down"
    assert sorted(sampler.released) == sorted({s for _, s, _ in sampler.sent}) and router.load() == [0, 0]


def test_without_release_the_runner_sends_no_sessions():
    runner = TrajectoryRunner(GuessTheNumber, ToolBox([]), parse_hermes, ConversationRenderer(TOKENIZER),
                              MultiTurnOptions(max_turns=3))
    plain = ScriptedSampler(count_up)  # takes no sessions argument: a TypeError if one were passed
    groups = runner.run([{"target": 2}], 2, plain, SAMPLING, seed=0).groups
    assert len(groups[0]) == 2 and len(plain.requests) > 1


def test_ranks_break_ties_from_servers_of_their_own():
    # two ranks, each with one session at a time and no view of the other's load: they start apart
    assert SessionRouter(2, first=0).route(["a"], [4]) == [0]
    assert SessionRouter(2, first=1).route(["a"], [4]) == [1]
    assert SessionRouter(3, first=2).route(["a", "b", "c"], [1, 1, 1]) == [2, 0, 1]
    # single-turn chunks: each rank's chunks start at its own server (seeds follow the chunk, not the server)
    assert contiguous_runs(1, 2, "lit_grpo", first=1) == [1]
    assert contiguous_runs(3, 2, "lit_grpo", first=1) == [1, 0, 0]
    assert contiguous_runs(3, 2, "vllm", first=3) == [1, 1, 0]
