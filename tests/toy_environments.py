"""Environments and tools written as a user would, importable by path in tests (``toy_environments:...``)."""

from __future__ import annotations


class GuessTheNumber:
    """Guess a number from 0 to 9 in a few tries: the plain form of the environment protocol, in ten lines."""

    def __init__(self, row: dict):
        self.target = int(row["target"])

    def reset(self) -> str:
        return "Guess my number (0-9)."

    def step(self, completion: str) -> tuple[str | None, float | None, bool]:
        digits = [c for c in completion if c.isdigit()]
        if digits and int(digits[0]) == self.target:
            return None, 1.0, True
        return "Higher." if digits and int(digits[0]) < self.target else "Lower.", 0.0, False


class Broken:
    """An environment whose step raises."""

    def __init__(self, row: dict):
        pass

    def reset(self) -> str:
        return "hello"

    def step(self, completion: str):
        raise RuntimeError("the environment broke")


class WrongShape(Broken):
    def step(self, completion: str):
        return "just a string"


def add(a: int, b: int) -> int:
    """Add two integers.

    Args:
        a: the first
        b: the second
    """
    return a + b


class TwoTurns:
    """Answers the model's first turn once, then ends: with turns that stop before ``max_new_tokens``, every
    trajectory is prompt, model, environment, model. Each model turn that holds a character other than a letter
    earns 0.5, so a random model's group has rewards that spread."""

    def __init__(self, row: dict):
        self.target = int(row["target"])
        self.turn = 0

    def reset(self) -> str:
        return f"Say a number near {self.target}."

    def step(self, completion: str) -> tuple[str | None, float, bool]:
        self.turn += 1
        reward = 0.5 if any(not c.isalpha() for c in completion) else 0.0
        if self.turn == 1:
            return f"Now one more, {self.target} again?", reward, False
        return None, reward, True


class TypedGuess(GuessTheNumber):
    """GuessTheNumber in the typed form: ``step`` returns a StepResult, and a reply may be chat messages."""

    def step(self, completion: str):
        from lit_grpo.environments.protocol import StepResult

        reply, reward, done = super().step(completion)
        return StepResult([{"role": "user", "content": reply}] if reply else None, reward, done)


class RandomStart(GuessTheNumber):
    """Starts each trajectory with another message: the G trajectories of one task would not share a prompt."""

    made = 0

    def reset(self) -> str:
        RandomStart.made += 1
        return f"Guess my number, attempt {RandomStart.made}."


class Counting:
    """Never done: answers every turn with ``Again.`` and a reward of 0.5 (for caps and summed rewards)."""

    closed = 0

    def __init__(self, row: dict):
        self.row = row

    def reset(self) -> str:
        return "Count."

    def step(self, completion: str) -> tuple[str, float, bool]:
        return "Again.", 0.5, False

    def close(self) -> None:
        Counting.closed += 1


def slow(seconds: float) -> str:
    """Sleep, then answer.

    Args:
        seconds: how long to sleep
    """
    import time

    time.sleep(seconds)
    return "woke"


def fail(x: int) -> int:
    """Raise.

    Args:
        x: anything
    """
    raise ZeroDivisionError(f"cannot take {x}")


def parse_braces(text: str) -> list:
    """A user's tool-call format: ``{{name a b}}`` calls ``name(a=int(a), b=int(b))``."""
    import re

    from lit_grpo.environments.tool_calls import ToolCall

    return [ToolCall(name, {"a": int(a), "b": int(b)}) for name, a, b in re.findall(r"\{\{(\w+) (\d+) (\d+)\}\}", text)]


class ScriptedSampler:
    """A ``Sample`` function (``lit_grpo.data.multi_turn``) whose model turns come from ``script(prefix, j)``: the
    token ids of completion ``j`` of the prefix (prompt and trajectory so far), or ``(ids, truncated)``. Each sampled
    token's log-prob is distinct (-(k + 1) / 100 for the k-th token handed out), so tests can find them again;
    ``requests`` keeps every request's prefixes."""

    def __init__(self, script) -> None:  # noqa: ANN001
        self.script = script
        self.requests: list[list[list[int]]] = []
        self.handed = 0

    def __call__(self, prompts, n, sampling, seed):  # noqa: ANN001, ANN204
        from lit_grpo.engines.base import Completion, Rollouts

        self.requests.append([list(p) for p in prompts])
        groups = []
        for prompt in prompts:
            group = []
            for j in range(n):
                out = self.script(list(prompt), j)
                ids, truncated = out if isinstance(out, tuple) else (out, False)
                logprobs = [-(self.handed + k + 1) / 100 for k in range(len(ids))]
                self.handed += len(ids)
                group.append(Completion(list(ids), logprobs, truncated))
            groups.append(group)
        return Rollouts(groups)


def guessing_generate(prompts, n, sampling, seed, all_finished=None):  # noqa: ANN001, ANN201
    """An engine's ``generate`` for GuessTheNumber with the character tokenizer, scripted: completion j of the first
    turn guesses j, each later turn one more than the last guess, then ends its turn (<|im_end|>)."""
    from lit_grpo.engines.base import Completion

    return [[Completion([20 + guess_after(prompt, j) % 10, 2], [-1.0, -1.0], False) for j in range(n)]
            for prompt in prompts]


def guess_after(prefix: list[int], j: int) -> int:
    """The guess that follows ``prefix`` (character tokenizer, no system prompt): ``j`` on the first turn (the prompt
    opens two messages, the user's and the assistant's: two ``<|im_start|>``, id 1), else the last digit + 1."""
    if prefix.count(1) == 2:
        return j
    return [t - 20 for t in prefix if 20 <= t < 30][-1] + 1  # '0'..'9' are ids 20..29


def scripted_turns_data(**kwargs):  # noqa: ANN003, ANN201
    """A RolloutDataModule whose in-process engine's turns are :func:`guessing_generate` (its scoring, alpha, stays the
    engine's own)."""
    from lit_grpo.data.datamodule import RolloutDataModule

    class ScriptedTurns(RolloutDataModule):
        def build_engine(self, module):  # noqa: ANN001, ANN202
            engine = super().build_engine(module)
            engine.generate = guessing_generate
            return engine

    return ScriptedTurns(**kwargs)


class RowVerdict:
    """A one-turn environment whose reward is the row's ``pass`` (0 or 1), whatever the model says: evaluation's
    Pass@k is then known exactly from the rows."""

    def __init__(self, row: dict):
        self.verdict = float(row["pass"])

    def reset(self) -> str:
        return "Say anything."

    def step(self, completion: str) -> tuple[None, float, bool]:
        return None, self.verdict, True


class ResetRaises(Broken):
    """An environment whose ``reset()`` raises, whatever the row."""

    def reset(self) -> str:
        raise RuntimeError("reset broke")


class ResetOutOfShape(Broken):
    """An environment whose ``reset()`` answers with a number, not a message."""

    def reset(self):
        return 42


class ObservationRole(GuessTheNumber):
    """GuessTheNumber answering in a role of its own (``observation``), which many chat templates refuse."""

    def step(self, completion: str):
        reply, reward, done = super().step(completion)
        return ([{"role": "observation", "content": reply}] if reply else None), reward, done


#: a chat template that raises on a role it does not know, as the Llama-2, Mistral and Gemma templates do (their
#: ``raise_exception`` text), with the character tokenizer's ChatML markers
STRICT_ROLES_TEMPLATE = (
    "{% for message in messages %}"
    "{% if message['role'] not in ['system', 'user', 'assistant'] %}"
    "{{ raise_exception('Only user, assistant and system roles are supported!') }}"
    "{% endif %}"
    "{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)
