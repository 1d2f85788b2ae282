"""Sampled completions as a table, every ``log_completions_every_n_steps`` rollout batches, for each Lightning logger
that can take one: TensorBoard (a markdown table as text), Weights & Biases (a ``wandb.Table``), MLflow (a JSON
table artifact) and CSV (rows appended to ``completions.csv`` beside ``metrics.csv``). Other loggers get nothing.

A row is the first completion of a group: its prompt, the prompt's gold answer, the completion's thinking apart
from its answer where the text has ``</think>`` (all of it thinking, no answer, when the prompt opened a thought that
the completion never closed: ``lit_grpo.data.thinking``), the reward it was trained with and each reward function's
unweighted score of it (``reward/<name>``; not known for a batch formed by dynamic sampling over several rounds),
its advantage (eq. 2), its length in the model's tokens, whether it hit ``max_new_tokens`` and the step's staleness.
Bounded: the first :data:`MAX_ROWS` groups of the batch, each text cut at :data:`MAX_CHARS` characters, so that a
long run's logs stay small.
"""

from __future__ import annotations

import csv
import os
from collections.abc import Sequence
from typing import Any

from lit_grpo.core.batch import RolloutBatch
from lit_grpo.data.latex_answers import THINK_CLOSE, THINK_OPEN
from lit_grpo.data.thinking import prompt_opens_thought

#: the tag (TensorBoard, W&B) and file name stem (CSV, MLflow) of the table
KEY = "rollout/completions"
CSV_FILE = "completions.csv"
MLFLOW_FOLDER = "completions"  # the run's artifact folder of the tables, one JSON file per logged step
MAX_ROWS = 8
MAX_CHARS = 1000


def split_thinking(text: str, opened: bool = False) -> tuple[str, str]:
    """``(thinking, answer)`` of a completion: the text before ``</think>`` (without an opening ``<think>``) and
    the text after it. No ``</think>``: the whole text is the answer, or, where the prompt opened the thought
    (``opened``), the whole text is a thought that never ended and there is no answer."""
    head, sep, tail = text.partition(THINK_CLOSE)
    if not sep:
        return (text.strip(), "") if opened else ("", text.strip())
    return head.replace(THINK_OPEN, "", 1).strip(), tail.strip()


def _cut(text: str) -> str:
    return text if len(text) <= MAX_CHARS else text[: MAX_CHARS - 3] + "..."


def completion_table(batch: RolloutBatch, tokenizer: Any, step: int, staleness: int,  # noqa: ANN401
                     scores: Any = None) -> tuple[list[str], list[list[Any]]]:  # noqa: ANN401
    """``(columns, rows)`` of ``batch``'s table at ``step``: a row per group (its first completion), at most
    :data:`MAX_ROWS`. ``scores``: the data module's ``BatchScores`` of this batch (gold answers, each reward
    function's scores), or None."""
    scores = scores if scores is not None and scores.batch_index == batch.batch_index else None
    names = sorted(scores.per_function) if scores is not None else []
    columns = ["step", "prompt", "answer", "thinking", "completion", "reward", *(f"reward/{n}" for n in names),
               "advantage", "length", "truncated", "staleness"]
    mask = batch.token_mask
    rows = []
    for row in range(0, batch.num_sequences, batch.group_size)[:MAX_ROWS]:
        group = int(batch.group_index[row])
        prompt = batch.prompt_ids[group][batch.prompt_mask[group].bool()]
        tokens = batch.completion_ids[row][mask[row].bool()]
        prompt_text = tokenizer.decode(prompt, skip_special_tokens=True)  # as the data module reads it, uncut
        thinking, answer = split_thinking(tokenizer.decode(tokens, skip_special_tokens=True),
                                          prompt_opens_thought(prompt_text))
        gold = scores.answers[group] if scores is not None and group < len(scores.answers) else ""
        rows.append([step, _cut(prompt_text), _cut(gold), _cut(thinking),
                     _cut(answer), float(batch.rewards[row]), *(float(scores.per_function[n][row]) for n in names),
                     float(batch.advantages[row]), int(mask[row].sum()), bool(batch.truncated[row]), int(staleness)])
    return columns, rows


def markdown_table(columns: Sequence[str], rows: Sequence[Sequence[Any]]) -> str:
    """A markdown table (TensorBoard's text panel renders it): a cell's ``|`` escaped, its line breaks as ``<br>``,
    numbers to 3 decimals."""
    def cell(value: Any) -> str:  # noqa: ANN401
        text = f"{value:.3f}" if isinstance(value, float) else str(value)
        return text.replace("|", "\\|").replace("\n", "<br>")

    lines = ["| " + " | ".join(columns) + " |", "|" + "---|" * len(columns)]
    lines += ["| " + " | ".join(cell(v) for v in row) + " |" for row in rows]
    return "\n".join(lines)


def append_csv(path: str, columns: Sequence[str], rows: Sequence[Sequence[Any]]) -> None:
    """Append ``rows`` to the CSV file ``path``, with the header when the file is new (a later step's extra
    column, a reward function's, is left out of a file whose header lacks it)."""
    exists = os.path.isfile(path)
    header = columns
    if exists:
        with open(path, newline="") as f:
            header = next(csv.reader(f), list(columns))
    with open(path, "a", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=header, extrasaction="ignore", restval="")
        if not exists:
            writer.writeheader()
        writer.writerows(dict(zip(columns, row)) for row in rows)


def log_table(loggers: Sequence[Any], columns: list[str], rows: list[list[Any]], step: int) -> list[str]:
    """Write the table to each logger of ``loggers`` that takes one; returns the names of those written to."""
    from lightning.pytorch.loggers import CSVLogger, MLFlowLogger, TensorBoardLogger, WandbLogger

    written = []
    for logger in loggers:
        if isinstance(logger, TensorBoardLogger):
            logger.experiment.add_text(KEY, markdown_table(columns, rows), global_step=step)
        elif isinstance(logger, WandbLogger):
            logger.log_table(key=KEY, columns=columns, data=rows, step=step)
        elif isinstance(logger, MLFlowLogger):
            table = {c: [row[i] for row in rows] for i, c in enumerate(columns)}  # MLflow's table: by column
            logger.experiment.log_table(logger.run_id, table, f"{MLFLOW_FOLDER}/step_{step:08d}.json")
        elif isinstance(logger, CSVLogger):
            os.makedirs(logger.log_dir, exist_ok=True)
            append_csv(os.path.join(logger.log_dir, CSV_FILE), columns, rows)
        else:
            continue
        written.append(type(logger).__name__)
    return written


def log_sampled_completions(module: Any, batch: RolloutBatch, staleness: int) -> list[str]:  # noqa: ANN401
    """``batch``'s table (:func:`completion_table`) at the module's step, to the module's loggers (rank 0 calls it).
    The data module's scores of the batch, when it keeps them, add the gold answers and each reward function's
    column."""
    trainer = module.trainer
    scores = getattr(getattr(trainer, "datamodule", None), "batch_scores", None)
    columns, rows = completion_table(batch, module.tokenizer, module.global_step, staleness, scores)
    return log_table(module.loggers, columns, rows, module.global_step)
