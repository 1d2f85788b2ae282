"""Multi-turn rollouts: G trajectories per task, each a conversation between the policy and an environment (or its
tools), sampled turn by turn through any engine's ``generate`` and kept as one token sequence.

A trajectory is the prompt, the model's tokens exactly as sampled, the environment's tokens
(``lit_grpo.environments.rendering``), the model's next tokens, and so on; it ends on the model's last token. It
comes out as one :class:`~lit_grpo.engines.base.Completion` whose ``mask`` marks the model's tokens (the loss and the
statistics count those only) and whose ``trajectory`` holds its record (messages, rewards, counts) as plain data, so
the batch layout, alpha, pi_ref, the server's scoring and the checkpoints of batches in flight all work unchanged.

Turns are batched: the first samples G completions of each task's prompt, every later one samples one continuation
of each trajectory still running, all in one request. An engine with prefix caching (vLLM) reuses each trajectory's
cached prefix; the others recompute it.

How a model turn is answered: when tools are given and the turn calls any (parsed in ``tool_call_format``), each
call's result goes back as a tool message and the trajectory goes on; otherwise the environment's ``step`` answers.
Without ``data.environment`` the task's row is the environment: its ``question`` is the first message, and a turn
without a tool call ends the trajectory (``data.rewards`` then score the final answer).
"""

from __future__ import annotations

import itertools
import warnings
from collections.abc import Callable, Hashable
from dataclasses import dataclass, field
from typing import Any

from lit_grpo.engines.base import Completion, Rollouts, SamplingConfig
from lit_grpo.environments.protocol import (
    EnvironmentFault,
    EnvironmentShapeError,
    check_reset,
    check_step,
    close,
    environment_name,
)
from lit_grpo.environments.rendering import ConversationRenderer, RenderingError
from lit_grpo.environments.tool_calls import ToolCall, ToolCallError, ToolCallParser
from lit_grpo.environments.tools import ToolBox, ToolOutcome, check_tool_runner

#: how a sampling request is made: ``(prompts, n, sampling, seed) -> Rollouts`` (an engine's generate, or a remote
#: engine's request: no collective); with sessions (``run``'s ``release``), also ``sessions=``: each prompt's session
Sample = Callable[..., Rollouts]
#: forgets sessions whose trajectories all ended (a remote engine's ``release_sessions``)
Release = Callable[[list[Hashable]], None]


@dataclass(frozen=True)
class MultiTurnOptions:
    """Multi-turn rollouts (``data.multi_turn``; used when ``data.environment`` or ``data.tools`` is set).

    Args:
        max_turns: model turns per trajectory at most; a trajectory still going after them ends and is counted as
            truncated (``rollout/truncated``).
        max_total_tokens: the model's and the environment's tokens after the prompt at most (``null``: no cap
            beyond ``max_turns * max_new_tokens`` and the environment's replies); reaching it ends the trajectory,
            counted as truncated. Each turn samples up to ``data.max_new_tokens``.
        tool_timeout_s: a tool call running longer answers with a timeout error, and the trajectory goes on.
        tool_call_format: how tool calls are written in the model's output: ``hermes`` (``<tool_call>{json}``
            ``</tool_call>``) or an import path ``package.module:parse`` of ``parse(text) -> list[ToolCall]``.
        tool_runner: where a call runs: ``thread`` (the default: any callable, no cost per call; a call past its
            limit runs on) or ``process`` (a process per call, killed at its limit; the tool must be importable by
            path). A turn's calls run at once either way (``lit_grpo.environments.tools``).
    """

    max_turns: int = 4
    max_total_tokens: int | None = None
    tool_timeout_s: float = 10.0
    tool_call_format: str = "hermes"
    tool_runner: str = "thread"

    def __post_init__(self) -> None:
        if isinstance(self.max_turns, bool) or not isinstance(self.max_turns, int) or self.max_turns < 1:
            raise ValueError(f"multi_turn.max_turns must be an integer >= 1, got {self.max_turns!r}")
        if self.max_total_tokens is not None and (isinstance(self.max_total_tokens, bool)
                                                  or not isinstance(self.max_total_tokens, int)
                                                  or self.max_total_tokens < 1):
            raise ValueError(f"multi_turn.max_total_tokens must be an integer >= 1 or null, "
                             f"got {self.max_total_tokens!r}")
        if not self.tool_timeout_s > 0:
            raise ValueError(f"multi_turn.tool_timeout_s must be > 0, got {self.tool_timeout_s!r}")
        check_tool_runner(self.tool_runner)


class QuestionEnvironment:
    """The environment of a task with tools only: the row's ``question`` is the first user message and the first
    turn without a tool call ends the trajectory (no reward of its own: ``data.rewards`` score the answer)."""

    def __init__(self, row: dict[str, Any]) -> None:
        if not isinstance(row.get("question"), str):
            raise EnvironmentShapeError(f"a task with tools and no data.environment needs rows with a 'question' "
                                        f"string; got the keys {sorted(row)}")
        self.question = row["question"]

    def reset(self) -> str:
        return self.question

    def step(self, completion: str) -> tuple[None, None, bool]:
        return None, None, True


@dataclass
class Trajectory:
    """One trajectory being sampled: its tokens after the prompt, the mask of the model's, and its record."""

    environment: Any
    prompt_ids: list[int]
    conversation: list[dict[str, Any]]  # as rendered (the model's turns as their text)
    held_text: str  # the text of every token held: what the next rendering must continue
    token_ids: list[int] = field(default_factory=list)
    mask: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    versions: list[str] = field(default_factory=list)
    messages: list[dict[str, Any]] = field(default_factory=list)  # the record: tool calls parsed, rewards
    reward: float = 0.0
    turns: int = 0
    env_tokens: int = 0
    tool_calls: int = 0
    tool_errors: int = 0
    env_error: str | None = None
    template_mismatch: bool = False
    truncated: bool = False
    stop: str = ""
    final_text: str = ""

    @property
    def running(self) -> bool:
        return not self.stop

    def record(self) -> dict[str, Any]:
        """The trajectory as plain data (``Completion.trajectory``; ``predict`` writes it)."""
        return {"messages": self.messages, "env_reward": self.reward, "turns": self.turns,
                "model_tokens": int(sum(self.mask)), "env_tokens": self.env_tokens, "tool_calls": self.tool_calls,
                "tool_errors": self.tool_errors, "env_error": self.env_error,
                "template_mismatch": self.template_mismatch, "stop": self.stop, "final_text": self.final_text}

    def completion(self) -> Completion:
        return Completion(list(self.token_ids), list(self.logprobs), self.truncated,
                          tuple(dict.fromkeys(self.versions)), tuple(self.mask), self.record())


@dataclass
class ToolTurn:
    """The tool calls of one model turn: the calls parsed (or the error of a call that cannot be read, or what a
    parser raised otherwise), and their outcomes once run."""

    calls: list[ToolCall] = field(default_factory=list)
    error: ToolCallError | None = None
    failure: Exception | None = None
    outcomes: list[ToolOutcome] | None = None


def turn_seed(seed: int, turn: int) -> int:
    """The sampling seed of a batch's turn ``turn`` (turn 0 keeps the batch's seed)."""
    return (seed + turn * 1_000_000_009) % (2**62)


class TrajectoryRunner:
    """Samples G trajectories per task through a ``Sample`` function (see the module's docstring)."""

    def __init__(self, environment: Callable[[dict[str, Any]], Any] | None, tools: ToolBox,
                 parse_tool_calls: ToolCallParser, renderer: ConversationRenderer, options: MultiTurnOptions) -> None:
        self.make_environment = environment or QuestionEnvironment
        #: how errors name the environment, and the option they point at (the rows are the task with tools only)
        self.environment_name = environment_name(self.make_environment)
        self.environment_key = "data.environment" if environment is not None else "data.dataset"
        self.tools = tools
        self.parse_tool_calls = parse_tool_calls
        self.renderer = renderer
        self.options = options
        self.mismatch_warned = False
        self._sessions = itertools.count()  # a session per group of trajectories, unique in this process

    # ---- the first prompt ---------------------------------------------------------------------------
    def start(self, row: dict[str, Any]) -> tuple[Any, list[dict[str, Any]]]:
        """A fresh environment for ``row`` and its first messages (system prompt first)."""
        environment, stage = None, "building it raised "
        try:
            environment = self.make_environment(row)
            stage = "reset() raised "
            first = environment.reset()
            stage = ""  # reset() answered: check_reset's own line says what is wrong with the answer
            return environment, self.renderer.with_system(check_reset(first))
        except Exception as e:
            close(environment)
            raise self.start_error(row, f"{stage}{type(e).__name__}: {e}" if stage else str(e)) from e

    def start_error(self, row: dict[str, Any], what: str) -> EnvironmentStartError:
        """The one line saying that this environment could not start ``row``'s task, and ``what`` went wrong."""
        return EnvironmentStartError(f"the environment {self.environment_name} could not start the task "
                                     f"{row_name(row)}: {what}", self.environment_key)

    def first_prompt(self, row: dict[str, Any], environment: Any,
                     messages: list[dict[str, Any]]) -> tuple[list[int], str]:
        """The prompt of ``row``'s task from its environment's first ``messages`` (ids and text); a template that
        cannot render them means the task cannot start (``environment`` is then closed)."""
        try:
            return self.renderer.prompt(messages)
        except RenderingError as e:
            close(environment)
            raise self.start_error(row, f"its first messages do not render: {e}") from e

    def prompt(self, row: dict[str, Any]) -> list[int]:
        """The prompt of ``row``'s task (a throwaway environment's first messages)."""
        environment, messages = self.start(row)
        ids, _ = self.first_prompt(row, environment, messages)
        close(environment)
        return ids

    # ---- sampling -----------------------------------------------------------------------------------
    def run(self, rows: list[dict[str, Any]], n: int, sample: Sample, sampling: SamplingConfig, seed: int,
            keep_going: Callable[[bool], bool] | None = None, release: Release | None = None) -> Rollouts:
        """``n`` trajectories of each row's task, as ``Rollouts`` (groups in row order); a failed request ends
        every trajectory and comes back as ``Rollouts.error``.

        ``keep_going(any_running)`` makes ranks that sample with a sharded policy (FSDP: every forward is a
        collective) take their turns together: a turn runs while any rank has a trajectory running, and a rank with
        none samples its first prompt again and discards it.

        ``release`` (an engine that routes sessions over several servers): each group of trajectories is a session,
        named in every request (``sample(..., sessions=)``), so all the turns of its trajectories go to one server;
        it is released once its last trajectory ends."""
        groups: list[list[Trajectory]] = []
        prompts: list[list[int]] = []
        sessions: list[Hashable] = []
        open_sessions: set[Hashable] = set()

        def request(texts: list[list[int]], count: int, turn_seed_: int, names: list[Hashable]) -> Rollouts:
            if release is None:
                return sample(texts, count, sampling, turn_seed_)
            open_sessions.update(names)
            return sample(texts, count, sampling, turn_seed_, sessions=names)

        def release_ended() -> None:
            ended = [s for s, g in zip(sessions, groups) if s in open_sessions and not any(t.running for t in g)]
            if ended and release is not None:
                open_sessions.difference_update(ended)
                release(ended)

        try:
            for row in rows:
                group: list[Trajectory] = []
                groups.append(group)
                for _ in range(n):
                    environment, messages = self.start(row)
                    if group and messages != group[0].conversation:
                        close(environment)
                        raise EnvironmentStartError(
                            f"the environments {self.environment_name} of the task {row_name(row)} start with "
                            f"different messages; the G trajectories of a group must share their task (build the "
                            f"environment from the row alone)", self.environment_key)
                    # equal messages render equally: the group's prompt is rendered once
                    ids, text = (group[0].prompt_ids, group[0].held_text) if group \
                        else self.first_prompt(row, environment, messages)
                    group.append(Trajectory(environment, ids, list(messages), text, messages=list(messages)))
                prompts.append(group[0].prompt_ids)
                sessions.append(next(self._sessions))
            first = request(prompts, n, seed, sessions)
            if first.error is not None:
                return first
            self.answer_all([pair for group, completions in zip(groups, first.groups)
                             for pair in zip(group, completions)])
            release_ended()
            turn = 1
            while True:
                running = [(t, s) for g, s in zip(groups, sessions) for t in g if t.running]
                if not (keep_going(bool(running)) if keep_going is not None else running):
                    break
                if not running:  # in step with the ranks still sampling (a throwaway turn: no session)
                    sample(prompts[:1], 1, sampling, turn_seed(seed, turn))
                    turn += 1
                    continue
                rollouts = request([t.prompt_ids + t.token_ids for t, _ in running], 1, turn_seed(seed, turn),
                                   [s for _, s in running])
                if rollouts.error is not None:
                    return rollouts
                self.answer_all([(t, c) for (t, _), (c,) in zip(running, rollouts.groups)])
                release_ended()
                turn += 1
        finally:
            if release is not None and open_sessions:  # a failed turn or environment: nothing goes on
                release(sorted(open_sessions))
            for trajectory in (t for g in groups for t in g):
                close(trajectory.environment)
        return Rollouts([[t.completion() for t in g] for g in groups], reference=None)

    def answer_all(self, pairs: list[tuple[Trajectory, Completion]]) -> None:
        """Take the model's turn of each ``(trajectory, completion)`` as :meth:`answer` does, with the tool calls of
        every turn run first, at once: a turn whose calls hang waits about one ``tool_timeout_s``, not the sum."""
        turns = [self.tool_turn(trajectory, completion) for trajectory, completion in pairs]
        outcomes = iter(self.tools.call_many([call for turn in turns if turn is not None for call in turn.calls]))
        for (trajectory, completion), turn in zip(pairs, turns):
            if turn is not None:
                turn.outcomes = [next(outcomes) for _ in turn.calls]
            self.answer(trajectory, completion, turn)

    def kept_tokens(self, trajectory: Trajectory, completion: Completion) -> tuple[list[int], list[float], bool]:
        """The turn's tokens and log-probs that fit under ``max_total_tokens``, and whether the cap cut them."""
        cap = self.options.max_total_tokens
        tokens, logprobs = list(completion.token_ids), list(completion.logprobs)
        over_cap = cap is not None and len(trajectory.token_ids) + len(tokens) > cap
        if over_cap:
            keep = cap - len(trajectory.token_ids)
            tokens, logprobs = tokens[:keep], logprobs[:keep]
        return tokens, logprobs, over_cap

    def tool_turn(self, trajectory: Trajectory, completion: Completion) -> ToolTurn | None:
        """The tool calls of the model's turn, parsed, before the turn is taken: ``None`` when its tools do not run
        (no tools, or a turn cut at a cap: the call is likely cut too)."""
        tokens, _, over_cap = self.kept_tokens(trajectory, completion)
        if not self.tools or completion.truncated or over_cap:
            return None
        content = self.renderer.tokenizer.decode(tokens, skip_special_tokens=True)
        try:
            return ToolTurn(self.parse_tool_calls(content))
        except ToolCallError as e:
            return ToolTurn(error=e)
        except Exception as e:  # a parser's own bug: raised again where the turn is answered (an env_error)
            return ToolTurn(failure=e)

    def answer(self, trajectory: Trajectory, completion: Completion, tool_turn: ToolTurn | None = None) -> None:
        """Take the model's turn into ``trajectory``, then the environment's answer (or end it); ``tool_turn``: its
        tool calls already parsed and run (:meth:`answer_all`), else they are here."""
        cap = self.options.max_total_tokens
        tokens, logprobs, over_cap = self.kept_tokens(trajectory, completion)
        trajectory.token_ids += tokens
        trajectory.mask += [1] * len(tokens)
        trajectory.logprobs += logprobs
        trajectory.versions += list(completion.versions)
        trajectory.turns += 1
        turn_text = self.renderer.decode(tokens)
        content = self.renderer.tokenizer.decode(tokens, skip_special_tokens=True)
        trajectory.held_text += turn_text
        trajectory.final_text = content
        # the template writes the turn's end itself; any other special token the model sampled stays in the text it
        # renders, so that the rendering continues the trajectory (the environment reads the plain text)
        trajectory.conversation.append({"role": "assistant", "content": self.renderer.turn_content(tokens)})
        message: dict[str, Any] = {"role": "assistant", "content": content}
        trajectory.messages.append(message)
        cut = completion.truncated or over_cap
        try:
            # a turn cut at a cap still goes to the environment, as a single-turn reward scores a cut completion;
            # its tools do not run (the call is likely cut too), and the trajectory ends after it
            reply = self.respond(trajectory, content, message, tools=not cut, tool_turn=tool_turn)
        except Exception as e:  # the environment raised or answered out of shape: counted, the trajectory ends
            trajectory.env_error = f"{type(e).__name__}: {e}"
            return self.end(trajectory, "env_error")
        if cut:
            return self.end(trajectory, "max_total_tokens" if over_cap else "max_new_tokens", truncated=True)
        if reply is None:
            return self.end(trajectory, "done")
        if trajectory.turns >= self.options.max_turns:
            return self.end(trajectory, "max_turns", truncated=True)
        try:
            continuation = self.renderer.continuation(trajectory.conversation, reply, trajectory.held_text, turn_text)
        except RenderingError as e:
            trajectory.env_error = f"RenderingError: {e}"
            return self.end(trajectory, "env_error")
        if cap is not None and len(trajectory.token_ids) + len(continuation.token_ids) >= cap:
            return self.end(trajectory, "max_total_tokens", truncated=True)
        if continuation.template_mismatch:
            trajectory.template_mismatch = True
            self.warn_mismatch()
        trajectory.token_ids += continuation.token_ids
        trajectory.mask += [0] * len(continuation.token_ids)
        trajectory.logprobs += [0.0] * len(continuation.token_ids)
        trajectory.env_tokens += len(continuation.token_ids)
        trajectory.held_text += continuation.text
        trajectory.conversation += reply
        trajectory.messages += reply

    def respond(self, trajectory: Trajectory, content: str, message: dict[str, Any], tools: bool = True,
                tool_turn: ToolTurn | None = None) -> list[dict[str, Any]] | None:
        """The messages that answer the model's turn (tool results, or the environment's reply), ``None`` when the
        trajectory is done. Records tool calls in ``message`` and the environment's reward in the trajectory."""
        if self.tools and tools:
            turn = tool_turn
            if turn is None:
                try:
                    turn = ToolTurn(self.parse_tool_calls(content))
                except ToolCallError as e:
                    turn = ToolTurn(error=e)
            if turn.failure is not None:
                raise turn.failure
            if turn.error is not None:
                trajectory.tool_errors += 1
                return [{"role": "tool", "content": f"Error: {turn.error}"}]
            if turn.calls:
                message["tool_calls"] = [c.as_message_call() for c in turn.calls]
                outcomes = turn.outcomes if turn.outcomes is not None else self.tools.call_many(turn.calls)
                replies = []
                for call, outcome in zip(turn.calls, outcomes):
                    trajectory.tool_calls += 1
                    trajectory.tool_errors += outcome.failed
                    replies.append({"role": "tool", "name": call.name, "content": outcome.text})
                return replies
        result = check_step(trajectory.environment.step(content))
        if result.reward is not None:
            trajectory.reward += result.reward
            message["reward"] = result.reward
        if result.done:
            return None
        return result.reply or []

    def end(self, trajectory: Trajectory, stop: str, truncated: bool = False) -> None:
        trajectory.stop = stop
        trajectory.truncated = truncated

    def warn_mismatch(self) -> None:
        if not self.mismatch_warned:
            self.mismatch_warned = True
            warnings.warn("the chat template renders earlier turns differently from the tokens sampled (it rewrites "
                          "or drops part of them); trajectories keep the sampled tokens and only the environment's "
                          "messages are rendered, so training sees exactly what the model saw, which differs from "
                          "what the template gives at inference (counted in rollout/template_mismatch)", stacklevel=2)


class EnvironmentStartError(EnvironmentFault):
    """An environment could not start its task (the factory or ``reset`` raised, ``reset`` answered out of shape,
    the chat template cannot render its first messages, or G environments of one task disagree): no prompt can be
    formed, so the run stops in one line naming the environment and the row."""


def trajectory_stats(groups: list[list[Completion]]) -> dict[str, float]:
    """A multi-turn batch's statistics (``rollout/...``): means per trajectory of turns, model tokens, environment
    tokens and tool calls; counts of tool errors and template mismatches; the share truncated (the data module adds
    its running count of environment errors)."""
    records = [c.trajectory for g in groups for c in g if c.trajectory is not None]
    if not records:
        return {}
    count = len(records)
    truncated = sum(c.truncated for g in groups for c in g if c.trajectory is not None)
    return {"turns": sum(r["turns"] for r in records) / count,
            "model_tokens": sum(r["model_tokens"] for r in records) / count,
            "env_tokens": sum(r["env_tokens"] for r in records) / count,
            "tool_calls": sum(r["tool_calls"] for r in records) / count,
            "tool_errors": float(sum(r["tool_errors"] for r in records)),
            "template_mismatch": float(sum(r["template_mismatch"] for r in records)),
            "truncated": truncated / count}


def row_name(row: dict[str, Any]) -> str:
    """A task's row as messages name it: its ``question``, else the row itself, cut at 60 characters."""
    text = repr(row.get("question", row))
    return text[:60] + "..." if len(text) > 60 else text
