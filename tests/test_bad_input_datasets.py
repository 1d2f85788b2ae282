"""A dataset read by its columns refuses a bad row or option in one line, exit status 2, before the model loads: a
row without the named column (the dataset, the row and the column named), a template naming a column rows lack or
none at all, a gold math-verify cannot parse beside the ``math_verify`` reward, a Hub dataset offline with nothing
cached, and options that cannot apply (columns of a dataset made here, columns beside an environment, no chat
template for tools)."""

import json

import pytest
from cli_runner import refusal_line
from test_cli_errors import TINY_RUN

from lit_grpo.data.datamodule import RolloutDataModule

ROWS = [{"problem": "1+1?", "answer": "2"}, {"problem": "Area of the unit circle?", "answer": "\\pi"},
        {"problem": "2+2?", "answer": "4"}, {"problem": "3+3?", "answer": "6"}]
BY_COLUMNS = ["--data.problem_column", "problem", "--data.answer_column", "answer", "--data.rewards", "[math_verify]",
              "--data.max_prompts", "null", "--data.system_prompt", "null"]


def fit_line(tmp_path, monkeypatch, capsys, rows: list[dict] | None, *extra: str) -> str:
    """The refusal of a tiny fit on ``rows`` (written to ``rows.jsonl``; ``None``: no file) with ``extra``."""
    if rows is not None:
        (tmp_path / "rows.jsonl").write_text("".join(json.dumps(row) + "\n" for row in rows))
    args = ["fit", "--model.model_name", "tiny-random-llama", *TINY_RUN, f"--trainer.default_root_dir={tmp_path}",
            "--data.dataset", str(tmp_path / "rows.jsonl"), *BY_COLUMNS, *extra]
    return refusal_line(args, tmp_path, monkeypatch, capsys)


def test_a_row_without_the_problem_column(tmp_path, monkeypatch, capsys):
    rows = [*ROWS[:2], {"question": "2+2?", "answer": "4"}, ROWS[3]]
    line = fit_line(tmp_path, monkeypatch, capsys, rows)
    assert f"{tmp_path / 'rows.jsonl'}: row 2 has no column 'problem' (its columns: question, answer)" in line
    assert "expected data.problem_column to name a column of every row" in line


def test_a_row_without_the_answer_column(tmp_path, monkeypatch, capsys):
    line = fit_line(tmp_path, monkeypatch, capsys, ROWS, "--data.answer_column", "solution")
    assert "rows.jsonl: row 0 has no column 'solution' (its columns: problem, answer)" in line
    assert "data.answer_column" in line


def test_a_template_naming_a_column_rows_lack(tmp_path, monkeypatch, capsys):
    line = fit_line(tmp_path, monkeypatch, capsys, ROWS, "--data.prompt_template", "{problem} (level {level})")
    assert "rows.jsonl: row 0 has no column 'level', which data.prompt_template names ({level})" in line


def test_a_gold_math_verify_cannot_parse(tmp_path, monkeypatch, capsys):
    rows = [*ROWS[:2], {"problem": "?", "answer": "\\frac{1}{"}, ROWS[3]]
    line = fit_line(tmp_path, monkeypatch, capsys, rows)
    assert "row 2's gold '\\\\frac{1}{' is LaTeX math-verify cannot parse" in line
    assert "the reward 'math_verify' cannot judge a completion against it" in line


def test_a_hub_dataset_offline_with_nothing_cached(tmp_path, monkeypatch, capsys):
    """conftest sets HF_HUB_OFFLINE=1 before the Hub's libraries load; nothing is cached under this name."""
    line = fit_line(tmp_path, monkeypatch, capsys, None, "--data.dataset", "nobody-xyz/no-such-dataset-123")
    assert "dataset nobody-xyz/no-such-dataset-123 (its default config, split 'train') is not in the Hugging Face " \
           "cache, and HF_HUB_OFFLINE=1 forbids downloading it" in line
    assert "Dataset.save_to_disk" in line


# the same refusals as the data module raises them (the command line's line is its message, as above)
@pytest.mark.parametrize("options, texts", [
    ({"dataset": "bundled"}, ["data.problem_column / data.answer_column with dataset 'bundled'"]),
    ({"dataset": "reasoning_gym:basic_arithmetic:size=20:test_size=4", "rewards": []},
     ["data.problem_column and data.answer_column beside data.environment"]),
    ({"chat_template": False, "tools": ["lit_grpo.environments.calculator:calculator"]},
     ["data.chat_template=false with multi-turn rollouts", "expected data.chat_template: true"]),
    ({"problem_column": ""}, ["data.problem_column='': expected a non-empty name"]),
    ({"prompt_template": "Solve it within \\boxed{}."},
     ["data.prompt_template='Solve it within \\\\boxed{}.' names no column, so every prompt would be the same"]),
    ({"rows": [*ROWS[:3], {"problem": "?", "answer": " "}]},
     ["rows.jsonl: row 3 column 'answer' is empty; expected the gold answer"]),
    ({"rows": [*ROWS[:3], {"problem": "?", "answer": ["4"]}]},
     ["rows.jsonl: row 3 column 'answer' is a list (['4']); expected text or a number"]),
])
def test_the_data_module_refuses(options, texts, tmp_path):
    rows = options.pop("rows", ROWS)
    (tmp_path / "rows.jsonl").write_text("".join(json.dumps(row) + "\n" for row in rows))
    kwargs = {"dataset": str(tmp_path / "rows.jsonl"), "problem_column": "problem", "answer_column": "answer",
              "rewards": ["math_verify"], "num_generations": 2, **options}
    with pytest.raises(ValueError) as err:
        RolloutDataModule(**kwargs)
    line = str(err.value)
    assert "\n" not in line
    for text in texts:
        assert text in line, (text, line)
