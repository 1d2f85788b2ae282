"""Datasets by their columns: any file, ``datasets`` folder or Hub id whose rows name the problem and the gold answer
in columns of their own (DeepScaleR, MATH-500, AIME24: ``problem`` and ``answer``), a prompt template that carries
the task's instruction, and the chat template on or off. The data module's ``problem_column``, ``answer_column``,
``prompt_template``, ``chat_template`` and ``dataset_config`` make a :class:`RowFormat`; everything they do is here.

Rows come out as the data module's single-turn rows always are, ``{"question", "answer", "gold"}``: the question is
the prompt's user message (the template filled in), the answer the gold cell's text. Without a column named, a
dataset is GSM8K's format, checked as before (:func:`lit_grpo.data.gsm8k.validate_rows`). Every fault of a row is
one line naming the dataset, the row and the column, when the data module is built: before any model loads.

A template names columns in braces, ``"{problem}\\n\\nLet's think step by step and output the final answer within
\\\\boxed{}."``: ``{name}`` is the row's column ``name`` (a name as Python's identifiers are), ``{{`` and ``}}`` are
literal braces, and any other brace stays as written, so LaTeX such as ``\\boxed{}`` needs no escaping.
"""

from __future__ import annotations

import re
import threading
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

from lit_grpo.data.gsm8k import read_rows
from lit_grpo.data.prompt_order import used_rows
from lit_grpo.data.prompts import prompt_ids
from lit_grpo.data.rewards import RewardFn, RewardRunner
from lit_grpo.data.tasks import REASONING_GYM, load_task_rows

_PLACEHOLDER = re.compile(r"\{\{|\}\}|\{([A-Za-z_]\w*)\}")
# sources whose rows are made here in GSM8K's format: they have no columns to name
_OWN_FORMAT = ("bundled", "synthetic:", REASONING_GYM)


@dataclass(frozen=True)
class RowFormat:
    """How a dataset's rows become prompts and golds (the data module's options of the same names).

    Attributes:
        problem_column: the column holding the problem; ``None``: GSM8K's ``question``.
        answer_column: the column holding the gold answer, all of its text (after a ``####`` in it, for the
            ``math_verify`` reward); ``None``: GSM8K's ``answer``, whose gold follows ``####``. Naming either column
            reads the rows by their columns, the other one keeping its GSM8K name.
        prompt_template: the user message, with ``{column}`` placeholders; ``None``: the problem as it is.
        chat_template: format the prompt with the tokenizer's chat template; ``False``: plain text (a base model).
        dataset_config: a Hub dataset's config; ``None``: the dataset's default.
    """

    problem_column: str | None = None
    answer_column: str | None = None
    prompt_template: str | None = None
    chat_template: bool = True
    dataset_config: str | None = None

    @property
    def by_columns(self) -> bool:
        """Whether the rows are read by their columns rather than as GSM8K's."""
        return self.problem_column is not None or self.answer_column is not None

    @property
    def columns(self) -> tuple[str, str]:
        """The problem's and the gold's column."""
        return self.problem_column or "question", self.answer_column or "answer"

    def prompt_ids(self, tokenizer: Any, question: str, system_prompt: str | None) -> list[int]:
        """The prompt of a row's question (:func:`lit_grpo.data.prompts.prompt_ids`): a template wrote the whole
        message, so without a chat template it is not wrapped in ``Question: ... Answer:``."""
        return prompt_ids(tokenizer, question, system_prompt, self.chat_template,
                          plain_layout=self.prompt_template is None)


def placeholders(template: str) -> list[str]:
    """The column names a template's placeholders name, in order."""
    return [m.group(1) for m in _PLACEHOLDER.finditer(template) if m.group(1)]


def render(template: str, row: dict[str, Any], described: str, index: int, section: str = "data.") -> str:
    """``template`` filled in with ``row``'s columns; a placeholder naming no column is one line (naming the option
    as ``<section>prompt_template``)."""
    def fill(match: re.Match[str]) -> str:
        name = match.group(1)
        if name is None:
            return match.group(0)[0]  # "{{" -> "{", "}}" -> "}"
        if name not in row:
            raise ValueError(f"{described}: row {index} has no column {name!r}, which {section}prompt_template names "
                             f"({{{name}}}); its columns: {', '.join(map(str, row))}")
        return str(row[name])

    return _PLACEHOLDER.sub(fill, template)


def check_row_format(fmt: RowFormat, dataset: str, environment: bool, tools: bool,
                     section: str = "data.") -> None:
    """Refuse a format that cannot apply, before any row is read: an empty column name, a template that names no
    column, columns or a template beside an environment (its rows are handed to it as they are), columns of a
    dataset made in GSM8K's format here, and no chat template where multi-turn rendering needs one. ``section``: how
    the lines name the options (``data.``, an evaluation's ``eval.``, the ``eval`` command's ``--``)."""
    for option in ("problem_column", "answer_column", "dataset_config"):
        value = getattr(fmt, option)
        if value is not None and (not isinstance(value, str) or not value.strip()):
            raise ValueError(f"{section}{option}={value!r}: expected a non-empty name, or null")
    template = fmt.prompt_template
    if template is not None and (not isinstance(template, str) or not placeholders(template)):
        raise ValueError(f"{section}prompt_template={template!r} names no column, so every prompt would be the same; "
                         f"expected the problem's column in braces, e.g. '{{problem}} Think step by step.'")
    named = [f"{section}{o}" for o in ("problem_column", "answer_column", "prompt_template")
             if getattr(fmt, o) is not None]
    if named and environment:
        raise ValueError(f"{' and '.join(named)} beside data.environment: an environment's rows are handed to it as "
                         f"they are, and its reset() writes the first message; expected them unset with an environment")
    if fmt.by_columns and isinstance(dataset, str) and dataset.startswith(_OWN_FORMAT):
        raise ValueError(f"{section}problem_column / {section}answer_column with dataset {dataset!r}, whose rows "
                         f"are made here in GSM8K's format (question, answer); expected a file, a datasets folder "
                         f"or a Hub id to name columns of")
    if not fmt.chat_template and (environment or tools):
        raise ValueError(f"{section}chat_template=false with multi-turn rollouts (data.environment or data.tools): "
                         f"their turns and tool schemas are rendered by the chat template; expected "
                         f"{section}chat_template: true")


def _cell(row: Any, index: int, column: str, option: str, described: str, numbers: bool, section: str) -> str:
    """One row's value of ``column`` as text, or one line naming the dataset, the row and the column."""
    if not isinstance(row, Mapping):
        raise ValueError(f"{described}: row {index} is a {type(row).__name__}; expected rows with named columns")
    if column not in row:
        raise ValueError(f"{described}: row {index} has no column {column!r} (its columns: "
                         f"{', '.join(map(str, row))}); expected {section}{option} to name a column of every row")
    value = row[column]
    if isinstance(value, bool) or not isinstance(value, (str, int, float) if numbers else str):
        kinds = "text or a number" if numbers else "text"
        raise ValueError(f"{described}: row {index} column {column!r} is a {type(value).__name__} ({value!r:.60}); "
                         f"expected {kinds}")
    text = str(value)
    if not text.strip():
        raise ValueError(f"{described}: row {index} column {column!r} is empty; expected the "
                         f"{'gold answer' if numbers else 'problem'}")
    return text


def column_rows(rows: list[Any], described: str, fmt: RowFormat, section: str = "data.") -> list[dict[str, str]]:
    """Rows read by their columns as ``{"question", "answer", "gold"}`` (the template filled in); the lines of a
    bad row name ``section``'s options."""
    problem, answer = fmt.columns
    out = []
    for index, row in enumerate(rows):
        question = _cell(row, index, problem, "problem_column", described, False, section)
        gold = _cell(row, index, answer, "answer_column", described, True, section)
        if fmt.prompt_template is not None:
            question = render(fmt.prompt_template, row, described, index, section)
        out.append({"question": question, "answer": gold, "gold": gold})
    if not out:
        raise ValueError(f"{described}: no rows")
    return out


def numeric_gold(functions: list[tuple[str, RewardFn, float]]) -> bool:
    """GSM8K's gold must hold a number unless every reward judges golds of its own form and checks them itself."""
    return not functions or not all(hasattr(fn, "check_answer") for _, fn, _ in functions)


def load_rows(dataset: str, split: str, fmt: RowFormat, functions: list[tuple[str, RewardFn, float]],
              environment: bool, section: str = "data.") -> list[dict[str, Any]]:
    """The rows of ``dataset``'s ``split`` in ``fmt`` (``functions``: the data module's reward functions, as
    ``RewardRunner.functions``)."""
    if environment or not fmt.by_columns:
        rows = load_task_rows(dataset, split, environment, fmt.dataset_config, numeric_gold(functions))
        if fmt.prompt_template is not None:  # GSM8K's rows: their question, answer and gold are the columns
            rows = [{**row, "question": render(fmt.prompt_template, row, dataset, i, section)}
                    for i, row in enumerate(rows)]
        return rows
    raw, described = read_rows(dataset, split, fmt.dataset_config)
    return column_rows(raw, described, fmt, section)


def _bounded_check(check: Callable[[str], str | None], answer: str, timeout_s: float | None) -> str | None:
    """``check(answer)`` given at most ``timeout_s`` seconds, as each reward call is: a gold math-verify does not
    parse in that time would time out in every call, scoring 0 all run long (the thread left behind is a daemon)."""
    if timeout_s is None:
        return check(answer)
    outcome: dict[str, Any] = {}

    def run() -> None:
        try:
            outcome["problem"] = check(answer)
        except Exception as e:  # raised below, in the caller's thread
            outcome["error"] = e

    thread = threading.Thread(target=run, name="gold-check", daemon=True)
    thread.start()
    thread.join(timeout_s)
    if "error" in outcome:
        raise outcome["error"]
    if "problem" not in outcome:
        return f"was not parsed within the reward's {timeout_s:g} s (data.reward_timeout_s)"
    return outcome["problem"]


def check_answers(rows: list[dict[str, Any]], numbered: dict[int, int], dataset: str, runner: RewardRunner) -> None:
    """Ask every reward that checks golds (``fn.check_answer``: ``math_verify``) about each row's answer, refusing
    the first it cannot judge in one line; ``numbered`` maps a row's ``id`` to its index in the dataset."""
    checks = [(name, fn.check_answer) for name, fn, _ in runner.functions if hasattr(fn, "check_answer")]
    for row in rows:
        answer = str(row.get("answer", ""))
        for name, check in checks:
            problem = _bounded_check(check, answer, runner.timeout_s)
            if problem is not None:
                raise ValueError(f"dataset {dataset!r}: row {numbered[id(row)]}'s gold {answer[-60:]!r} {problem}, so "
                                 f"the reward {name!r} cannot judge a completion against it; expected a gold it reads "
                                 f"(fix the row or leave it out)")


def run_rows(dataset: str, split: str, fmt: RowFormat, runner: RewardRunner, environment: bool,
             max_prompts: int | None, seed: int, prompts_per_step: int) -> list[dict[str, Any]]:
    """The rows a run draws its prompts from (:func:`lit_grpo.data.prompt_order.used_rows`), each checked: by
    :func:`load_rows` as read, then their golds by ``runner``'s rewards that check golds (only the rows the run
    uses: math-verify's parse of a LaTeX gold costs milliseconds to a tenth of a second)."""
    rows = load_rows(dataset, split, fmt, runner.functions, environment)
    used = used_rows(rows, max_prompts, seed, dataset, prompts_per_step)
    if not environment:
        check_answers(used, {id(row): i for i, row in enumerate(rows)}, dataset, runner)
    return used


__all__ = ["RowFormat", "check_answers", "check_row_format", "column_rows", "load_rows", "numeric_gold",
           "placeholders", "render", "run_rows"]
