"""Lightning's subcommands on the training CLI: `validate` and `test` report the `eval` section's Pass@k, the numbers
`python -m lit_grpo eval` reports for the same weights and settings, print them and log them to the trainer's
logger; `--ckpt_path` gives the weights; `predict` writes each prompt's completions with their rewards as JSONL. None
of them ends in a traceback."""

import json
import sys

import pytest
from conftest import TOY_REWARD, tiny_data, tiny_module, tiny_trainer

from lit_grpo.cli.commands import main
from lit_grpo.cli.plots import read_scalars

# a judge with spread for a random model (GSM8K correctness would be 0 everywhere, proving nothing)
DATA = ["--data.rewards", f"[{TOY_REWARD}]", "--data.num_generations", "3", "--data.max_new_tokens", "8",
        "--data.temperature", "1.0", "--data.system_prompt", "null", "--data.max_prompts", "8",
        "--trainer.accelerator", "cpu", "--trainer.enable_progress_bar", "false"]
EVAL = ["--eval.num_questions", "3", "--eval.num_samples", "4", "--eval.ks", "[1, 2]",
        "--eval.judge", "toy_rewards:has_digit", "--eval.questions_per_chunk", "2"]
EVAL_TOOL = ["--num_questions", "3", "--num_samples", "4", "--ks", "1,2", "--max_new_tokens", "8",
             "--no_system_prompt", "--device", "cpu", "--judge", "toy_rewards:has_digit",
             "--questions_per_chunk", "2"]


@pytest.fixture
def workdir(tmp_path, monkeypatch):
    monkeypatch.setattr(sys, "argv", ["lit_grpo"])
    monkeypatch.delenv("LIT_GRPO_DEBUG", raising=False)
    monkeypatch.setenv("PL_GLOBAL_SEED", "0")
    monkeypatch.delenv("PL_GLOBAL_SEED")
    monkeypatch.chdir(tmp_path)
    return tmp_path


def logger_args(root) -> list[str]:
    return ["--trainer.logger", "lightning.pytorch.loggers.TensorBoardLogger",
            f"--trainer.logger.save_dir={root}", "--trainer.logger.name=tb"]


def eval_tool(args, out) -> dict:
    main(["eval", *args, *EVAL_TOOL, "--output", str(out)])
    return {int(k): v for k, v in json.loads(out.read_text())["pass_at_k"].items()}


def test_validate_reports_and_logs_what_eval_reports(workdir, capsys):
    cli = main(["validate", "--model.model_name", "tiny-random-llama", *DATA, *EVAL, *logger_args(workdir / "v")])
    expected = eval_tool(["--model", "tiny-random-llama"], workdir / "eval.json")
    assert cli.results == pytest.approx(expected, abs=1e-12)
    assert 0 < cli.results[1] < 1  # the judge has spread: the comparison can fail
    out = capsys.readouterr().out
    assert "validate: bundled test split" in out and f"   1  {cli.results[1]:.4f}" in out
    scalars = read_scalars(workdir / "v")
    assert scalars["eval/pass@1"] == [(0, pytest.approx(cli.results[1]))]
    assert scalars["eval/pass@2"] == [(0, pytest.approx(cli.results[2]))]


def test_validate_and_test_read_the_checkpoint(workdir, capsys):
    trainer = tiny_trainer(workdir, max_steps=2)
    from lit_grpo.callbacks import WeightSync

    trainer.callbacks.append(WeightSync(every_n_batches=1))
    trainer.fit(tiny_module(lr=1e-2), datamodule=tiny_data())
    ckpt = workdir / "policy.ckpt"
    trainer.save_checkpoint(ckpt)
    expected = eval_tool(["--ckpt", str(ckpt)], workdir / "eval.json")
    base = eval_tool(["--model", "tiny-random-llama"], workdir / "base.json")
    assert expected != base  # the trained weights give other numbers: the checkpoint is what is measured
    for subcommand in ("validate", "test"):
        cli = main([subcommand, "--model.model_name", "tiny-random-llama", "--ckpt_path", str(ckpt), *DATA, *EVAL,
                    *logger_args(workdir / subcommand)])
        assert cli.results == pytest.approx(expected, abs=1e-12), subcommand
        # logged at the checkpoint's step, the axis the training run's own Pass@k is on
        assert read_scalars(workdir / subcommand)["eval/pass@1"] == [(2, pytest.approx(expected[1]))]
    assert "test: bundled test split, weights at step 2" in capsys.readouterr().out


def test_validate_uses_the_eval_sections_split(workdir, capsys):
    cli = main(["validate", "--model.model_name", "tiny-random-llama", *DATA, *EVAL, "--eval.split", "train",
                "--trainer.logger", "false"])
    train = eval_tool(["--model", "tiny-random-llama", "--split", "train"], workdir / "train.json")
    assert cli.results == pytest.approx(train, abs=1e-12)
    assert "validate: bundled train split" in capsys.readouterr().out


@pytest.mark.parametrize("args, expected", [
    (["--ckpt_path", "last"], ["ckpt_path 'last'", "validate reads a checkpoint file", "name the file"]),
    (["--trainer.devices", "2"], ["validate runs in one process", "trainer.devices 1"]),
])
def test_validate_refusals_are_one_line(args, expected, workdir, capsys):
    with pytest.raises(SystemExit) as exit_:
        main(["validate", "--model.model_name", "tiny-random-llama", *DATA, *EVAL, "--trainer.logger", "false",
              *args])
    assert exit_.value.code == 2
    lines = [line for line in capsys.readouterr().err.splitlines() if line.strip()]
    assert len(lines) == 1 and lines[0].startswith("error: "), lines
    for text in expected:
        assert text in lines[0]


def test_predict_writes_completions_with_rewards(workdir, capsys):
    from toy_rewards import digit_fraction

    out = workdir / "preds" / "out.jsonl"
    main(["predict", "--model.model_name", "tiny-random-llama", *DATA, "--trainer.logger", "false",
          "--predictions.output", str(out), "--predictions.num_questions", "3"])
    records = [json.loads(line) for line in out.read_text().splitlines()]
    from lit_grpo.data.gsm8k import load_gsm8k

    rows = load_gsm8k("bundled", split="test")[:3]
    assert [r["question"] for r in records] == [row["question"] for row in rows]
    for record, row in zip(records, rows):
        assert record["answer"] == row["answer"]
        assert len(record["completions"]) == len(record["rewards"]) == 3  # data.num_generations
        # the rewards are data.rewards of each completion against the row's answer
        assert record["rewards"] == pytest.approx([digit_fraction(c, row["answer"]) for c in record["completions"]])
    assert f"wrote 3 prompts x 3 completions to {out}" in capsys.readouterr().out
    # the same weights, rows and seed give the same file
    again = workdir / "again.jsonl"
    main(["predict", "--model.model_name", "tiny-random-llama", *DATA, "--trainer.logger", "false",
          "--predictions.output", str(again), "--predictions.num_questions", "3"])
    assert again.read_text() == out.read_text()


def test_predict_on_a_questions_file(workdir):
    questions = workdir / "q.jsonl"
    questions.write_text(json.dumps({"question": "What is 2 + 3?"}) + "\n\n"
                         + json.dumps({"question": "What is 4 + 4?", "answer": "#### 8"}) + "\n")
    out = workdir / "out.jsonl"
    main(["predict", "--model.model_name", "tiny-random-llama", *DATA, "--trainer.logger", "false",
          "--predictions.questions", str(questions), "--predictions.output", str(out)])
    first, second = [json.loads(line) for line in out.read_text().splitlines()]
    assert first["question"] == "What is 2 + 3?" and "rewards" not in first and "answer" not in first
    assert len(first["completions"]) == 3
    assert second["answer"] == "#### 8" and len(second["rewards"]) == 3


def test_predict_bad_questions_file_is_one_line(workdir, capsys):
    questions = workdir / "q.jsonl"
    questions.write_text('{"question": "ok"}\n{"prompt": "no question"}\n')
    with pytest.raises(SystemExit) as exit_:
        main(["predict", "--model.model_name", "tiny-random-llama", *DATA, "--trainer.logger", "false",
              "--predictions.questions", str(questions)])
    assert exit_.value.code == 2
    lines = [line for line in capsys.readouterr().err.splitlines() if line.strip()]
    assert len(lines) == 1 and f"{questions}:2" in lines[0] and "predictions.questions" in lines[0], lines


def test_every_offered_subcommand_runs(workdir, capsys):
    from lit_grpo.cli.lightning_cli import GRPOCLI

    with pytest.raises(SystemExit):
        main(["--help"])
    help_text = capsys.readouterr().out
    offered = set(GRPOCLI.subcommands())
    assert offered == {"fit", "validate", "test", "predict"}  # each is run by a test of this file or the suite
    for name in offered:
        assert name in help_text
    assert not hasattr(GRPOCLI, "fit")  # fit is the Trainer's own
    assert all(callable(getattr(GRPOCLI, name)) for name in offered - {"fit"})
