"""Synthetic arithmetic tasks in GSM8K's row format, generated from a seed: a task a small model learns on a CPU.

GSM8K is too hard for the models that train on a CPU in minutes (SmolLM2-135M solves about 1 %), so its
reward has almost no spread and nothing shows that GRPO learns. These tasks keep what matters for GRPO and
change only the difficulty:

- the reward is verifiable and the same judge: rows are ``{"question", "answer", "gold"}`` with a worked
  ``answer`` ending in ``#### <number>``, scored by ``lit_grpo.data.rewards.correctness_reward``;
- there is a held-out test split, disjoint from the train split (no problem, i.e. no tuple of operands,
  appears in both);
- everything is a pure function of ``(task, split, seed)``: no file, no network, same rows on every machine.

Tasks (load by name with ``load_gsm8k("synthetic:<task>")``, or ``"synthetic:<task>:seed=<n>"`` for
another draw):

- ``addition``: ``What is 47 + 38?`` -> ``47 + 38 = 85\\n#### 85`` (two-digit operands, 8,100 problems).
- ``add_sub``: ``What is 47 + 38 - 21?`` -> ``47 + 38 = 85\\n85 - 21 = 64\\n#### 64`` (two-digit operands,
  non-negative result): two steps with an intermediate result, like GSM8K's multi-step solutions.
"""

from __future__ import annotations

import random
from collections.abc import Callable
from dataclasses import dataclass

PREFIX = "synthetic:"
SPLITS: tuple[str, ...] = ("train", "test")
LOW, HIGH = 10, 99  # two-digit operands
TEST_SIZE = 200
TRAIN_SIZE = 5000


@dataclass(frozen=True)
class Problem:
    """One arithmetic problem: ``operands[0] + operands[1] (- operands[2])``."""

    operands: tuple[int, ...]

    @property
    def steps(self) -> list[tuple[int, str, int, int]]:
        """The worked solution as ``(left, op, right, result)`` steps, left to right."""
        total = self.operands[0]
        steps = []
        for op, right in zip(("+", "-"), self.operands[1:]):
            result = total + right if op == "+" else total - right
            steps.append((total, op, right, result))
            total = result
        return steps

    @property
    def result(self) -> int:
        return self.steps[-1][3]

    @property
    def question(self) -> str:
        expression = " ".join(f"{op} {b}" for op, b in zip(("+", "-"), self.operands[1:]))
        return f"What is {self.operands[0]} {expression}?"


def worked_answer(steps: list[tuple[int, str, int, int]]) -> str:
    """GSM8K-style solution text: one line per step, then ``#### <result of the last step>``."""
    lines = [f"{a} {op} {b} = {r}" for a, op, b, r in steps]
    return "\n".join(lines) + f"\n#### {steps[-1][3]}"


def as_row(problem: Problem) -> dict[str, str]:
    return {"question": problem.question, "answer": worked_answer(problem.steps), "gold": str(problem.result)}


def _addition(rng: random.Random) -> Problem:
    return Problem((rng.randint(LOW, HIGH), rng.randint(LOW, HIGH)))


def _add_sub(rng: random.Random) -> Problem:
    a, b = rng.randint(LOW, HIGH), rng.randint(LOW, HIGH)
    c = rng.randint(LOW, min(HIGH, a + b))  # the result is >= 0, as GSM8K's answers are
    return Problem((a, b, c))


#: task name -> sampler of one problem (uniform over the task's problems, given an RNG)
TASKS: dict[str, Callable[[random.Random], Problem]] = {"addition": _addition, "add_sub": _add_sub}


def task_names() -> list[str]:
    """Every valid dataset name of this module, e.g. ``synthetic:addition``."""
    return [PREFIX + task for task in TASKS]


def is_synthetic(source: object) -> bool:
    return isinstance(source, str) and source.startswith(PREFIX)


def parse_name(source: str) -> tuple[str, int]:
    """``"synthetic:add_sub"`` -> ``("add_sub", 0)``; ``"synthetic:add_sub:seed=3"`` -> ``("add_sub", 3)``."""
    expected = (f"expected one of {', '.join(task_names())}, optionally followed by ':seed=<integer>' "
                f"(e.g. '{task_names()[-1]}:seed=1')")
    if not is_synthetic(source):
        raise ValueError(f"dataset {source!r} is not a synthetic task; {expected}")
    task, _, rest = source[len(PREFIX):].partition(":")
    if task not in TASKS:
        raise ValueError(f"unknown synthetic task {task!r} in dataset {source!r}; {expected}")
    seed = 0
    if rest:
        key, _, value = rest.partition("=")
        if key != "seed" or not value.lstrip("-").isdigit():
            raise ValueError(f"dataset {source!r}: bad suffix {rest!r}; {expected}")
        seed = int(value)
    return task, seed


def generate_problems(task: str, seed: int = 0, test_size: int = TEST_SIZE,
                      train_size: int = TRAIN_SIZE) -> dict[str, list[Problem]]:
    """Both splits of one draw: ``test_size + train_size`` distinct problems from one seeded stream, the first
    ``test_size`` for test and the rest for train, so the splits never share a problem."""
    if task not in TASKS:
        raise ValueError(f"unknown synthetic task {task!r}; expected one of {sorted(TASKS)}")
    if test_size < 1 or train_size < 1:
        raise ValueError(f"test_size and train_size must be >= 1, got {test_size} and {train_size}")
    sample = TASKS[task]
    rng = random.Random(f"lit_grpo.synthetic:{task}:{seed}")  # str seeds hash with SHA-512: stable everywhere
    seen: set[tuple[int, ...]] = set()
    problems: list[Problem] = []
    attempts, limit = 0, 50 * (test_size + train_size)
    while len(problems) < test_size + train_size:
        attempts += 1
        if attempts > limit:
            raise ValueError(f"task {task!r} has too few distinct problems for {test_size} + {train_size} rows")
        problem = sample(rng)
        if problem.operands not in seen:
            seen.add(problem.operands)
            problems.append(problem)
    return {"test": problems[:test_size], "train": problems[test_size:]}


def generate_rows(task: str, split: str, seed: int = 0) -> list[dict[str, str]]:
    """Rows ``{"question", "answer", "gold"}`` of one split of a task, a pure function of its arguments."""
    if split not in SPLITS:
        raise ValueError(f"split {split!r}: expected one of {', '.join(repr(s) for s in SPLITS)}")
    return [as_row(p) for p in generate_problems(task, seed)[split]]


def load_synthetic(source: str, split: str) -> list[dict[str, str]]:
    """Rows of a dataset named ``synthetic:<task>[:seed=<n>]`` (what ``load_gsm8k`` calls for such names)."""
    task, seed = parse_name(source)
    return generate_rows(task, split, seed)
