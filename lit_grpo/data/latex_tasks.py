"""Small competition-style math sets with LaTeX answers, generated from a seed: the offline stand-ins of DeepScaleR,
AIME24 and MATH-500 for the CPU twin of the paper's section 5.2 (``configs/deepscaler/cpu_smollm2.yaml``).

Rows are in DeepScaleR's columns, ``{"problem", "answer", "solution"}``, so a run reads them by their columns
(``data.problem_column: problem``, ``data.answer_column: answer``) and judges them with ``math_verify`` exactly as it
reads and judges the real datasets; the gold is LaTeX that GSM8K's number-only judge cannot read (``\\frac{5}{6}``,
``3\\sqrt{2}``, ``9\\pi``, ``[-1, 5]``). Each task has a ``train`` and a ``test`` split, disjoint (no problem is in
both), and every row is a pure function of ``(task, split, seed)``: no file, no network, the same rows everywhere.

Names (``data.dataset``, an evaluation's ``dataset``): ``latex:<task>`` or ``latex:<task>:seed=<n>``, ``<task>``
one of :data:`TASKS`, or ``mixed`` (all of them, interleaved).
"""

from __future__ import annotations

import math
import random
from collections.abc import Callable

PREFIX = "latex:"
SPLITS: tuple[str, ...] = ("train", "test")
#: rows per task and split (``mixed`` has as many per task)
SIZES = {"train": 200, "test": 40}
INSTRUCTION = "Put the final answer within \\boxed{}."


def _fraction(p: int, q: int) -> str:
    """``p/q`` reduced, in LaTeX: an integer when ``q`` divides ``p``, a sign in front of the fraction."""
    g = math.gcd(p, q)
    p, q = p // g, q // g
    if q == 1:
        return str(p)
    sign = "-" if p < 0 else ""
    return f"{sign}\\frac{{{abs(p)}}}{{{q}}}"


def fractions(rng: random.Random) -> tuple[str, str, str]:
    """``a/b + c/d`` as a reduced fraction."""
    a, c = rng.randint(1, 9), rng.randint(1, 9)
    b, d = rng.randint(2, 12), rng.randint(2, 12)
    p, q = a * d + c * b, b * d
    answer = _fraction(p, q)
    problem = f"Compute $\\frac{{{a}}}{{{b}}} + \\frac{{{c}}}{{{d}}}$ as a fraction in lowest terms."
    return problem, answer, f"$\\frac{{{a * d} + {c * b}}}{{{q}}} = {answer}$"


def radicals(rng: random.Random) -> tuple[str, str, str]:
    """``sqrt(k^2 m)`` in simplest radical form, ``m`` square-free."""
    k = rng.randint(2, 30)
    m = rng.choice([2, 3, 5, 6, 7, 10, 11, 13, 14, 15, 17, 19, 21, 22, 23])
    answer = f"{k}\\sqrt{{{m}}}"
    return (f"Simplify $\\sqrt{{{k * k * m}}}$ to simplest radical form.", answer,
            f"${k * k * m} = {k}^2 \\cdot {m}$, so the root is ${answer}$")


def circles(rng: random.Random) -> tuple[str, str, str]:
    """A circle's area from its radius or diameter, in terms of pi."""
    r = rng.randint(2, 200)
    if rng.random() < 0.5:
        return (f"A circle has radius {r}. What is its area? Express your answer in terms of $\\pi$.",
                f"{r * r}\\pi", f"$\\pi r^2 = {r * r}\\pi$")
    # radius r/2: (r/2)^2 pi, a whole multiple of pi when r is even
    answer = f"{(r // 2) ** 2}\\pi" if r % 2 == 0 else f"\\frac{{{r * r}\\pi}}{{4}}"
    return (f"A circle has diameter {r}. What is its area? Express your answer in terms of $\\pi$.", answer,
            f"the radius is $\\frac{{{r}}}{{2}}$, so the area is ${answer}$")


def intervals(rng: random.Random) -> tuple[str, str, str]:
    """The solutions of ``|x - a| <= b`` as a closed interval."""
    a, b = rng.randint(-30, 30), rng.randint(1, 20)
    answer = f"[{a - b}, {a + b}]"
    shifted = f"x - {a}" if a >= 0 else f"x + {-a}"
    return (f"Find all real $x$ with $|{shifted}| \\le {b}$. Give your answer in interval notation.", answer,
            f"$-{b} \\le {shifted} \\le {b}$, so $x \\in {answer}$")


#: task name -> its generator: ``rng -> (problem, answer, solution)``
TASKS: dict[str, Callable[[random.Random], tuple[str, str, str]]] = {
    "fractions": fractions, "radicals": radicals, "circles": circles, "intervals": intervals}


def parse_name(source: str) -> tuple[str, int]:
    """``(task, seed)`` of ``latex:<task>[:seed=<n>]``, or one line naming what is wrong."""
    rest = source.removeprefix(PREFIX)
    task, _, option = rest.partition(":")
    if task not in TASKS and task != "mixed":
        raise ValueError(f"dataset {source!r}: unknown LaTeX task {task!r}; expected one of "
                         f"{', '.join([*TASKS, 'mixed'])} (latex:<task>[:seed=<n>])")
    if not option:
        return task, 0
    key, _, value = option.partition("=")
    if key != "seed" or not value.lstrip("-").isdigit():
        raise ValueError(f"dataset {source!r}: expected latex:<task> or latex:<task>:seed=<n>, got {option!r} "
                         f"after the task")
    return task, int(value)


def _task_rows(task: str, split: str, seed: int) -> list[dict[str, str]]:
    """``SIZES[split]`` distinct rows of one task; the test split first, then the train split without its
    problems (the problem space of each task holds a few hundred problems or more)."""
    rng = random.Random(f"{task}:{seed}")
    seen: set[str] = set()
    splits: dict[str, list[dict[str, str]]] = {"test": [], "train": []}
    for name in ("test", "train"):
        tries = 0
        while len(splits[name]) < SIZES[name]:
            problem, answer, solution = TASKS[task](rng)
            tries += 1
            if problem in seen:
                if tries > 100 * SIZES[name]:
                    raise RuntimeError(f"latex:{task} has fewer than {sum(SIZES.values())} distinct problems")
                continue
            seen.add(problem)
            splits[name].append({"problem": f"{problem} {INSTRUCTION}", "answer": answer, "solution": solution})
    return splits[split]


def load_latex_task(source: str, split: str) -> list[dict[str, str]]:
    """The rows of ``latex:<task>[:seed=<n>]``'s ``split`` (``mixed``: every task's, interleaved)."""
    task, seed = parse_name(source)
    if split not in SPLITS:
        raise ValueError(f"dataset {source!r}: split {split!r}; expected one of {', '.join(SPLITS)}")
    if task != "mixed":
        return _task_rows(task, split, seed)
    per_task = [_task_rows(name, split, seed) for name in TASKS]
    return [row for rows in zip(*per_task, strict=True) for row in rows]


__all__ = ["PREFIX", "TASKS", "load_latex_task", "parse_name"]
