"""The sampled-completions table (lit_grpo/training/completion_table.py): its rows from a rollout batch, and a real
fit writing it to TensorBoard, a CSV logger, an offline W&B run and a local MLflow run at once."""

from __future__ import annotations

import csv
import json

import pytest
import torch
from conftest import TOY_REWARD, tiny_data, tiny_module, tiny_trainer
from lit_grpo.callbacks import WeightSync

from lit_grpo.core.batch import RolloutBatch
from lit_grpo.data.batch_rewards import BatchScores
from lit_grpo.models.loading import tiny_tokenizer
from lit_grpo.training.completion_table import (
    CSV_FILE,
    KEY,
    MAX_CHARS,
    MAX_ROWS,
    MLFLOW_FOLDER,
    completion_table,
    markdown_table,
    split_thinking,
)


def test_thinking_is_set_apart_from_the_answer_where_the_text_closes_it():
    assert split_thinking("<think>add 12 and 30</think> 42") == ("add 12 and 30", "42")
    assert split_thinking("12 + 30 = 42</think>\n#### 42") == ("12 + 30 = 42", "#### 42")
    assert split_thinking("#### 42") == ("", "#### 42")  # no thinking
    assert split_thinking("<think>unfinished") == ("", "<think>unfinished")  # cut before the end of its thought


def test_a_markdown_cell_keeps_pipes_and_line_breaks_inside_it():
    table = markdown_table(["a", "b"], [["x | y\nz", 0.12345]])
    assert table.splitlines() == ["| a | b |", "|---|---|", "| x \\| y<br>z | 0.123 |"]


def _encode(tokenizer, text: str) -> list[int]:  # noqa: ANN001
    return tokenizer(text, add_special_tokens=False)["input_ids"]


def handmade_batch(tokenizer, num_prompts: int, group: int = 2) -> RolloutBatch:  # noqa: ANN001
    """``num_prompts`` prompts ``q<i>?``, each with ``group`` completions; the first of group i is
    ``<think>i</think>A<i>`` (one padding column after the longest), rewards and advantages distinct per row."""
    prompts = [_encode(tokenizer, f"q{i}?") for i in range(num_prompts)]
    texts = [f"<think>{i}</think>A{i}" if j == 0 else "x" for i in range(num_prompts) for j in range(group)]
    ids = [_encode(tokenizer, t) for t in texts]
    width = max(map(len, ids)) + 1
    completion = torch.zeros(len(ids), width, dtype=torch.long)
    mask = torch.zeros(len(ids), width, dtype=torch.long)
    for row, tokens in enumerate(ids):
        completion[row, : len(tokens)], mask[row, : len(tokens)] = torch.tensor(tokens), 1
    prompt_width = max(map(len, prompts))
    prompt_ids = torch.zeros(num_prompts, prompt_width, dtype=torch.long)
    prompt_mask = torch.zeros(num_prompts, prompt_width, dtype=torch.long)
    for row, tokens in enumerate(prompts):
        prompt_ids[row, prompt_width - len(tokens):], prompt_mask[row, prompt_width - len(tokens):] = \
            torch.tensor(tokens), 1
    rows = len(ids)
    return RolloutBatch(prompt_ids=prompt_ids, prompt_mask=prompt_mask,
                        group_index=torch.arange(num_prompts).repeat_interleave(group), completion_ids=completion,
                        completion_mask=mask, rewards=torch.arange(rows, dtype=torch.float) / 10,
                        advantages=torch.arange(rows, dtype=torch.float) - 1, group_mask=torch.ones(rows),
                        truncated=torch.arange(rows) == 2, group_size=group, batch_index=7, rollout_step=5)


def test_a_row_per_group_with_the_prompt_gold_answer_rewards_advantage_length_and_staleness():
    tokenizer = tiny_tokenizer()
    batch = handmade_batch(tokenizer, 3)
    scores = BatchScores(batch_index=7, answers=["10", "11", "12"],
                         per_function={"correctness": [1.0, 0.0] * 3, "format": [0.5, 0.0] * 3})
    columns, rows = completion_table(batch, tokenizer, step=9, staleness=4, scores=scores)
    assert columns == ["step", "prompt", "answer", "thinking", "completion", "reward", "reward/correctness",
                       "reward/format", "advantage", "length", "truncated", "staleness"]
    length = len(_encode(tokenizer, "<think>1</think>A1"))
    assert rows[1] == [9, "q1?", "11", "1", "A1", pytest.approx(0.2), 1.0, 0.5, 1.0, length, True, 4]
    assert [row[1] for row in rows] == ["q0?", "q1?", "q2?"]  # the first completion of each group
    # the scores of another batch (the data module's last one is not this one) are not shown as this one's
    columns, rows = completion_table(batch, tokenizer, 9, 4, BatchScores(8, ["10"], {"correctness": [1.0]}))
    assert "reward/correctness" not in columns and rows[0][2] == ""


def test_the_table_is_bounded_in_rows_and_in_characters():
    tokenizer = tiny_tokenizer()
    _, rows = completion_table(handmade_batch(tokenizer, MAX_ROWS + 3), tokenizer, 1, 0)
    assert len(rows) == MAX_ROWS
    long = handmade_batch(tokenizer, 1)
    text = "y" * (MAX_CHARS * 2)
    ids = torch.tensor([_encode(tokenizer, text), _encode(tokenizer, text)])
    long = RolloutBatch(**{**long.__dict__, "completion_ids": ids, "completion_mask": torch.ones_like(ids)})
    columns, rows = completion_table(long, tokenizer, 1, 0)
    assert len(rows[0][4]) == MAX_CHARS and rows[0][4].endswith("...")
    assert rows[0][columns.index("length")] == MAX_CHARS * 2  # the completion's length, not the cell's


def _tensorboard_texts(folder) -> dict[int, str]:  # noqa: ANN001
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(str(folder), size_guidance={"tensors": 0})
    acc.Reload()
    return {e.step: e.tensor_proto.string_val[0].decode() for e in acc.Tensors(f"{KEY}/text_summary")}


def test_a_fit_writes_the_table_to_tensorboard_csv_an_offline_wandb_run_and_mlflow(tmp_path, monkeypatch):
    pytest.importorskip("wandb", reason="the dev extra installs it")
    pytest.importorskip("mlflow", reason="the dev extra installs mlflow-skinny")
    from lightning.pytorch.loggers import CSVLogger, MLFlowLogger, TensorBoardLogger, WandbLogger

    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_SILENT", "true")
    monkeypatch.setenv("MLFLOW_ALLOW_FILE_STORE", "true")  # a local folder, no tracking server
    loggers = [TensorBoardLogger(tmp_path, name="tb"), CSVLogger(tmp_path, name="csv"),
               WandbLogger(save_dir=str(tmp_path), project="p", offline=True),
               MLFlowLogger(experiment_name="e", tracking_uri=f"file:{tmp_path / 'mlruns'}")]
    trainer = tiny_trainer(tmp_path, max_steps=2, callbacks=[WeightSync(every_n_batches=1)], logger=loggers,
                           log_every_n_steps=1)
    data = tiny_data(rewards=["correctness", TOY_REWARD])
    trainer.fit(tiny_module(log_completions_every_n_steps=1), datamodule=data)
    run_dir = loggers[2].experiment.dir
    trainer.loggers[2].experiment.finish()

    groups = data.prompts_per_step  # one row per group, fewer than MAX_ROWS here
    texts = _tensorboard_texts(loggers[0].log_dir)
    assert sorted(texts) == [1, 2]  # every step (log_completions_every_n_steps=1), at the module's step
    header = ("| step | prompt | answer | thinking | completion | reward | reward/correctness | "
              f"reward/{TOY_REWARD} | advantage | length | truncated | staleness |")
    assert texts[1].splitlines()[0] == header and len(texts[1].splitlines()) == 2 + groups

    with open(tmp_path / "csv" / "version_0" / CSV_FILE, newline="") as f:
        rows = list(csv.DictReader(f))
    assert (tmp_path / "csv" / "version_0" / "metrics.csv").is_file()  # beside Lightning's own file
    assert [r["step"] for r in rows] == ["1"] * groups + ["2"] * groups
    # each row's prompt is a question of the data set (chat-templated; the tiny tokenizer keeps ASCII only) and
    # its answer that question's gold answer
    gold = {"".join(c for c in str(row["question"]) if c.isascii()): str(row["answer"]) for row in data.rows}
    assert all([a for q, a in gold.items() if q in r["prompt"]] == [r["answer"]] for r in rows)
    assert all(float(r["reward"]) == pytest.approx(float(r["reward/correctness"]) + float(r[f"reward/{TOY_REWARD}"]))
               for r in rows)

    tables = sorted((tmp_path / "wandb").rglob("completions_*.table.json"))
    assert run_dir and len(tables) == 2
    table = json.loads(tables[0].read_text())
    assert table["columns"] == header.strip("| ").split(" | ") and len(table["data"]) == groups

    tables = sorted((tmp_path / "mlruns").rglob(f"artifacts/{MLFLOW_FOLDER}/step_*.json"))
    assert [p.name for p in tables] == ["step_00000001.json", "step_00000002.json"]
    table = json.loads(tables[1].read_text())
    assert table["columns"] == header.strip("| ").split(" | ") and [row[0] for row in table["data"]] == [2] * groups
