"""Synthetic arithmetic tasks in GSM8K's row format, generated from a seed: a task a small model learns on a CPU.

GSM8K is too hard for the models that train on a CPU in minutes (SmolLM2-135M solves about 1 %), so its
reward has almost no spread and nothing shows that GRPO learns. These tasks keep what matters for GRPO and
change only the difficulty:

- the reward is verifiable and judged the same way: rows are ``{"question", "answer", "gold"}`` with a worked
  ``answer`` ending in ``#### <number>``, scored by ``lit_grpo.data.rewards.correctness_reward``;
- the solutions are multi-step: column addition, one line per column with the carry written out, then the
  final answer, e.g. ``What is 47 + 38?`` -> ``7+8=15\\n4+3+1=8\\n#### 85``; a slip in any step makes
  the final number wrong, as in GSM8K's chains of calculations;
- there is a held-out test split, disjoint from the train split (no pair of operands appears in both);
- everything is a pure function of ``(task, split, seed)``: no file, no network, same rows on every machine.

Names (``load_gsm8k(name, split)``, ``data.dataset``, ``GSM8KPassAtK(dataset=...)``):
``synthetic:<task>`` or ``synthetic:<task>:seed=<n>`` (another draw of problems and split; default seed 0),
with ``<task>`` one of :data:`TASKS`: ``add_2digit`` (8,100 problems, 10..99 + 10..99) and ``add_3digit``
(810,000 problems, 100..999 + 100..999), or one of :data:`MUL_TASKS`, the tool-use tasks.

The tool-use tasks (:data:`MUL_TASKS`): ``mul_2digit`` (10..99 * 10..99) and ``mul_3x2digit`` (100..999 * 10..99),
rows ``{"question": "What is 47 * 38?", "answer": "#### 1786", "gold": "1786"}``. A character model of the size that
trains on a CPU cannot multiply in its head, but it can copy the operands into a call of the ``calculator`` tool
(:mod:`lit_grpo.environments.calculator`) and copy the result back: the task of the CPU tool-use demo. Their splits
are disjoint up to the order of the operands (``47 * 38`` in test keeps ``38 * 47`` out of train), so a model cannot
answer a test question from a train product it memorised. :func:`tool_sft_example` lays out one supervised example
token by token as a multi-turn rollout holds it (the warm start of ``calc-tiny-sft``).
"""

from __future__ import annotations

import random
from dataclasses import dataclass
from typing import Any

PREFIX = "synthetic:"
SPLITS: tuple[str, ...] = ("train", "test")
TEST_SIZE = 200
TRAIN_SIZE = 5000

#: task name -> number of digits of both operands
TASKS: dict[str, int] = {"add_2digit": 2, "add_3digit": 3}
#: tool-use task name -> number of digits of the first and of the second factor
MUL_TASKS: dict[str, tuple[int, int]] = {"mul_2digit": (2, 2), "mul_3x2digit": (3, 2)}


@dataclass(frozen=True)
class Column:
    """One step of column addition, written ``a+b=total`` (units column) or ``a+b+carry_in=total`` (the others;
    compact, like GSM8K's ``<<48/2=24>>`` calculator notes, to keep the sequences short for a character model)."""

    a: int
    b: int
    carry_in: int | None
    total: int

    @property
    def line(self) -> str:
        carry = "" if self.carry_in is None else f"+{self.carry_in}"
        return f"{self.a}+{self.b}{carry}={self.total}"


@dataclass(frozen=True)
class Problem:
    """``operands[0] + operands[1]``, solved column by column from the units up."""

    operands: tuple[int, int]

    @property
    def result(self) -> int:
        return sum(self.operands)

    @property
    def question(self) -> str:
        return f"What is {self.operands[0]} + {self.operands[1]}?"

    def digits(self) -> list[tuple[int, int]]:
        """Digit pairs, units first (the shorter operand padded with zeros)."""
        a, b = (str(x) for x in self.operands)
        width = max(len(a), len(b))
        return [(int(x), int(y)) for x, y in zip(reversed(a.zfill(width)), reversed(b.zfill(width)))]

    def columns(self, totals: dict[int, int] | None = None) -> list[Column]:
        """The worked steps. ``totals`` overrides the sum written in some columns (a slip: see
        ``lit_grpo.training.warm_start``); the later columns then carry on from the written sums, as a solver would."""
        out: list[Column] = []
        carry: int | None = None
        for i, (a, b) in enumerate(self.digits()):
            total = a + b + (carry or 0)
            if totals and i in totals:
                total = totals[i]
            out.append(Column(a, b, carry, total))
            carry = total // 10
        return out


@dataclass(frozen=True)
class Product:
    """``operands[0] * operands[1]``, answered in one line ``#### <product>`` (with the calculator's help)."""

    operands: tuple[int, int]

    @property
    def result(self) -> int:
        return self.operands[0] * self.operands[1]

    @property
    def question(self) -> str:
        return f"What is {self.operands[0]} * {self.operands[1]}?"

    @property
    def expression(self) -> str:
        """What a solver types into the calculator: the question's own spelling, so that a character model copies
        one unbroken span of it (with ``47*38`` the copy breaks at the operator, and a small model's copies of
        the second factor slipped by a digit)."""
        return f"{self.operands[0]} * {self.operands[1]}"


def final_answer(columns: list[Column]) -> int:
    """The number the written columns spell: the last column's sum, then the units digits of the others."""
    return int(str(columns[-1].total) + "".join(str(c.total % 10) for c in reversed(columns[:-1])))


def worked_answer(columns: list[Column]) -> str:
    """GSM8K-style solution text: one line per step, then ``#### <final answer>``."""
    return "\n".join(c.line for c in columns) + f"\n#### {final_answer(columns)}"


def as_row(problem: Problem | Product) -> dict[str, str]:
    if isinstance(problem, Product):
        return {"question": problem.question, "answer": f"#### {problem.result}", "gold": str(problem.result)}
    return {"question": problem.question, "answer": worked_answer(problem.columns()), "gold": str(problem.result)}


def task_names() -> list[str]:
    """Every valid dataset name of this module (default seed), e.g. ``synthetic:add_2digit``."""
    return [PREFIX + task for task in (*TASKS, *MUL_TASKS)]


def is_synthetic(source: object) -> bool:
    return isinstance(source, str) and source.startswith(PREFIX)


def parse_name(source: str) -> tuple[str, int]:
    """``"synthetic:add_2digit"`` -> ``("add_2digit", 0)``; ``"synthetic:add_2digit:seed=3"`` -> ``(..., 3)``."""
    expected = (f"expected one of {', '.join(repr(n) for n in task_names())}, optionally followed by "
                f"':seed=<integer>' (e.g. '{task_names()[0]}:seed=1')")
    if not is_synthetic(source):
        raise ValueError(f"dataset {source!r} is not a synthetic task; {expected}")
    task, _, rest = source[len(PREFIX):].partition(":")
    if task not in TASKS and task not in MUL_TASKS:
        raise ValueError(f"unknown synthetic task {task!r} in dataset {source!r}; {expected}")
    seed = 0
    if rest:
        key, _, value = rest.partition("=")
        if key != "seed" or not value.lstrip("-").isdigit():
            raise ValueError(f"dataset {source!r}: bad suffix {rest!r}; {expected}")
        seed = int(value)
    return task, seed


def generate_problems(task: str, seed: int = 0, test_size: int = TEST_SIZE,
                      train_size: int = TRAIN_SIZE) -> dict[str, list[Problem]] | dict[str, list[Product]]:
    """Both splits of one draw: ``test_size + train_size`` distinct problems from one seeded stream, the first
    ``test_size`` for test and the rest for train, so the splits never share a problem."""
    if task in MUL_TASKS:
        return generate_products(task, seed, test_size, train_size)
    if task not in TASKS:
        raise ValueError(f"unknown synthetic task {task!r}; expected one of {sorted((*TASKS, *MUL_TASKS))}")
    if test_size < 1 or train_size < 1:
        raise ValueError(f"test_size and train_size must be >= 1, got {test_size} and {train_size}")
    low, high = 10 ** (TASKS[task] - 1), 10 ** TASKS[task] - 1
    if test_size + train_size > (high - low + 1) ** 2:
        raise ValueError(f"task {task!r} has {(high - low + 1) ** 2} problems, fewer than {test_size} + {train_size}")
    rng = random.Random(f"lit_grpo.synthetic:{task}:{seed}")  # str seeds hash with SHA-512: stable everywhere
    seen: set[tuple[int, int]] = set()
    problems: list[Problem] = []
    while len(problems) < test_size + train_size:
        operands = (rng.randint(low, high), rng.randint(low, high))
        if operands not in seen:
            seen.add(operands)
            problems.append(Problem(operands))
    return {"test": problems[:test_size], "train": problems[test_size:]}


def generate_products(task: str, seed: int = 0, test_size: int = TEST_SIZE,
                      train_size: int = TRAIN_SIZE) -> dict[str, list[Product]]:
    """Both splits of a tool-use task, drawn as :func:`generate_problems` draws (its own seeded stream, test first),
    with a product and its swapped twin counted as one problem, so the splits never share a product. A task with
    fewer problems than ``test_size + train_size`` puts all the rest in train (``mul_2digit``: 4,095 problems,
    200 test and 3,895 train)."""
    if task not in MUL_TASKS:
        raise ValueError(f"unknown tool-use task {task!r}; expected one of {sorted(MUL_TASKS)}")
    if test_size < 1 or train_size < 1:
        raise ValueError(f"test_size and train_size must be >= 1, got {test_size} and {train_size}")
    ranges = [(10 ** (d - 1), 10**d - 1) for d in MUL_TASKS[task]]
    total = distinct_products(ranges)
    if test_size >= total:
        raise ValueError(f"task {task!r} has {total} problems; expected test_size below that, got {test_size}")
    train_size = min(train_size, total - test_size)
    rng = random.Random(f"lit_grpo.synthetic:{task}:{seed}")
    seen: set[tuple[int, int]] = set()
    problems: list[Product] = []
    while len(problems) < test_size + train_size:
        operands = (rng.randint(*ranges[0]), rng.randint(*ranges[1]))
        if (unordered := tuple(sorted(operands))) not in seen:
            seen.add(unordered)
            problems.append(Product(operands))
    return {"test": problems[:test_size], "train": problems[test_size:]}


def distinct_products(ranges: list[tuple[int, int]]) -> int:
    """How many factor pairs the two ranges hold, a pair and its swapped twin counted once."""
    (a_low, a_high), (b_low, b_high) = ranges
    pairs = (a_high - a_low + 1) * (b_high - b_low + 1)
    low, high = max(a_low, b_low), min(a_high, b_high)  # both orders lie in the ranges only inside the overlap
    overlap = max(0, high - low + 1)
    return pairs - overlap * (overlap - 1) // 2


def tool_sft_example(tokenizer: Any, problem: Product, use_tool: bool,
                     decide: bool = True) -> tuple[list[int], list[int], list[int]]:
    """One supervised example of the tool-use task, laid out as a multi-turn rollout holds it:
    ``(prompt_ids, completion_ids, trained)``, where ``trained`` is 1 on the model's tokens and 0 on the
    environment's.

    The prompt is the user's question rendered by the chat template
    (:class:`lit_grpo.environments.rendering.ConversationRenderer`, no system prompt). With ``use_tool`` the model's
    first turn is :func:`lit_grpo.environments.calculator.calculator_call_text` of the product and its end token;
    then the tool message with the calculator's answer, rendered as the difference of the conversation before and
    after it (``ConversationRenderer.continuation``: not trained, the model never learns to predict a tool's output);
    then the final turn ``#### <product>`` and its end token. Without, the only turn is ``#### <product>``. With
    ``decide`` false the call's first token is context, not a target: the example trains the call and the answer
    but not the choice to call."""
    from lit_grpo.environments.calculator import calculator, calculator_call_text
    from lit_grpo.environments.rendering import ConversationRenderer

    renderer = ConversationRenderer(tokenizer)
    eos = tokenizer.eos_token_id
    conversation: list[dict[str, Any]] = [{"role": "user", "content": problem.question}]
    prompt, held_text = renderer.prompt(conversation)
    completion: list[int] = []
    trained: list[int] = []
    if use_tool:
        call_text = calculator_call_text(problem.expression)
        turn = renderer.encode(call_text) + [eos]
        turn_text = renderer.decode(turn)
        held_text += turn_text
        conversation.append({"role": "assistant", "content": call_text})
        tool_message = {"role": "tool", "name": "calculator", "content": calculator(problem.expression)}
        reply = renderer.continuation(conversation, [tool_message], held_text, turn_text)
        if reply.template_mismatch:
            raise ValueError("the chat template renders the tool call differently from its tokens; expected a "
                             "template that writes assistant content as given")
        completion += turn + reply.token_ids
        trained += [int(decide)] + [1] * (len(turn) - 1) + [0] * len(reply.token_ids)
    final = renderer.encode(f"#### {problem.result}") + [eos]
    return prompt, completion + final, trained + [1] * len(final)


def generate_rows(task: str, split: str, seed: int = 0) -> list[dict[str, str]]:
    """Rows ``{"question", "answer", "gold"}`` of one split of a task: a pure function of its arguments."""
    if split not in SPLITS:
        raise ValueError(f"split {split!r}: expected one of {', '.join(repr(s) for s in SPLITS)}")
    return [as_row(p) for p in generate_problems(task, seed)[split]]


def load_synthetic(source: str, split: str) -> list[dict[str, str]]:
    """Rows of a dataset named ``synthetic:<task>[:seed=<n>]`` (what ``load_gsm8k`` calls for such names)."""
    task, seed = parse_name(source)
    return generate_rows(task, split, seed)
