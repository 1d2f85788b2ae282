"""The paper's section 5.2 as configs (configs/deepscaler): both Table 1 rows parse offline with the paper's settings,
the CPU twin trains and prints one Pass@1 line per evaluation set, the LaTeX sets made for it are disjoint and
judged right by math-verify, and an evaluation samples with a budget of its own or the training's."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from lit_grpo.cli.plots import read_scalars
from lit_grpo.data.latex_tasks import TASKS, load_latex_task
from lit_grpo.data.rewards import math_verify_reward
from lit_grpo.engines.base import SamplingConfig

ROOT = Path(__file__).resolve().parents[1]
OFFLINE = dict(os.environ, HF_HUB_OFFLINE="1", HF_DATASETS_OFFLINE="1", OMP_NUM_THREADS="1")


def print_config(tmp_path: Path, row: str, *extra: str) -> dict:
    proc = subprocess.run(
        [sys.executable, "-m", "lit_grpo", "fit", "--config", str(ROOT / "configs/deepscaler/base.yaml"),
         "--config", str(ROOT / f"configs/deepscaler/{row}.yaml"), *extra, "--print_config"],
        cwd=tmp_path, env=OFFLINE, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return yaml.safe_load(proc.stdout)


@pytest.mark.parametrize(("row", "v"), [("v10_i1", 10), ("v1_i1", 1)])
def test_both_rows_print_their_config_offline_with_the_papers_settings(tmp_path, row, v):
    config = print_config(tmp_path, row)
    model, data = config["model"], config["data"]
    assert config["sync"]["every_n_batches"] == v and model["iterations_per_batch"] == 1
    assert model["model_name"] == "deepseek-ai/DeepSeek-R1-Distill-Qwen-1.5B"
    assert (model["optimizer"]["lr"], model["beta"]) == (1e-6, 0.001)
    assert data["dataset"] == "agentica-org/DeepScaleR-Preview-Dataset" and data["rewards"] == ["math_verify"]
    assert (data["num_generations"], data["max_new_tokens"], data["temperature"]) == (16, 4096, 0.7)
    assert (data["problem_column"], data["answer_column"]) == ("problem", "answer")
    assert "\\boxed{}" in data["prompt_template"] and data["system_prompt"] is None
    assert data["engine"] == "server" and data["engine_options"]["kind"] == "vllm"
    assert config["trainer"]["devices"] == 7  # the eighth GPU serves
    assert model["packing"] and model["gradient_checkpointing"] and model["attn_implementation"] == "flash_attention_2"
    evaluations = {c["init_args"]["name"]: c["init_args"] for c in config["trainer"]["callbacks"]
                   if c["class_path"].endswith("PassAtKEvaluation")}
    assert set(evaluations) == {"aime24", "math500"}
    aime = evaluations["aime24"]
    assert (aime["dataset"], aime["num_samples"], aime["ks"], aime["judge"]) == \
        ("HuggingFaceH4/aime_2024", 32, [1], "math_verify")
    assert evaluations["math500"]["dataset"] == "HuggingFaceH4/MATH-500"
    # the evaluations' budget is their own, not the training's 4,096
    assert {e["max_new_tokens"] for e in evaluations.values()} == {32768}


def test_the_eval_sections_budget_is_its_own_when_set(tmp_path):
    """``eval.max_new_tokens`` was linked to ``data.max_new_tokens`` (refused when set); now it is the
    evaluation's, and left null it is the training's."""
    assert print_config(tmp_path, "v1_i1")["eval"]["max_new_tokens"] is None
    config = print_config(tmp_path, "v1_i1", "--eval.max_new_tokens", "8192", "--eval.temperature", "0.6")
    assert (config["eval"]["max_new_tokens"], config["eval"]["temperature"]) == (8192, 0.6)
    assert config["data"]["max_new_tokens"] == 4096


def test_an_evaluation_follows_the_trainings_sampling_where_it_names_none():
    from lit_grpo.callbacks import PassAtKEvaluation

    training = SamplingConfig(max_new_tokens=48, temperature=0.7, top_p=0.9)
    follows = PassAtKEvaluation("a", "latex:radicals", num_questions=2, num_samples=2, problem_column="problem",
                                answer_column="answer")
    own = PassAtKEvaluation("b", "latex:radicals", num_questions=2, num_samples=2, problem_column="problem",
                            answer_column="answer", max_new_tokens=96, temperature=0.6)
    for callback in (follows, own):
        callback.follow_training(training)
    assert follows.settings.sampling == training
    assert own.settings.sampling == SamplingConfig(max_new_tokens=96, temperature=0.6, top_p=0.9)
    # read by its columns: the question is the problem, the gold the LaTeX answer
    assert follows.rows[0]["question"].startswith("Simplify $\\sqrt{") and "\\sqrt{" in follows.rows[0]["answer"]


@pytest.mark.parametrize("task", [*TASKS, "mixed"])
def test_the_latex_sets_are_disjoint_and_math_verify_judges_their_golds(task):
    train, test = (load_latex_task(f"latex:{task}", split) for split in ("train", "test"))
    assert not {r["problem"] for r in train} & {r["problem"] for r in test}
    assert len({r["problem"] for r in train}) == len(train)
    for row in test:  # the gold itself, boxed, is right; a different value is wrong
        assert math_verify_reward(f"so \\boxed{{{row['answer']}}}", row["answer"]) == 1.0
    assert math_verify_reward("\\boxed{12345}", test[0]["answer"]) == 0.0
    assert load_latex_task(f"latex:{task}", "test") == test  # a pure function of the name
    assert load_latex_task(f"latex:{task}:seed=1", "test") != test


def test_a_bad_latex_name_is_one_line():
    with pytest.raises(ValueError, match=r"^dataset 'latex:cubes': unknown LaTeX task 'cubes'; expected one of "):
        load_latex_task("latex:cubes", "train")
    with pytest.raises(ValueError, match=r"expected latex:<task> or latex:<task>:seed=<n>, got 'sed=1'"):
        load_latex_task("latex:radicals:sed=1", "train")


def test_an_evaluation_sets_bad_row_is_one_line_before_any_model_loads(tmp_path):
    (tmp_path / "bad.jsonl").write_text('{"problem": "1+1?", "answer": "2"}\n{"problem": "2+2?"}\n')
    proc = subprocess.run(
        [sys.executable, "-m", "lit_grpo", "fit", "--config", str(ROOT / "configs/deepscaler/cpu_smollm2.yaml"),
         "--trainer.callbacks+=lit_grpo.callbacks.PassAtKEvaluation", "--trainer.callbacks.name=bad",
         "--trainer.callbacks.dataset=bad.jsonl", "--trainer.callbacks.problem_column=problem",
         "--trainer.callbacks.answer_column=answer", "--model.model_name", "/nonexistent/model"],
        cwd=tmp_path, env=OFFLINE, capture_output=True, text=True, timeout=300)
    assert proc.returncode != 0
    lines = [line for line in proc.stderr.splitlines() if line.strip()]
    # the evaluation's row is refused, not the model (which does not exist) nor the training data
    assert len(lines) == 1 and lines[0].startswith(
        "error: bad.jsonl: row 1 has no column 'answer' (its columns: problem); expected "
        "PassAtKEvaluation(name='bad').answer_column to name a column of every row"), lines


@pytest.mark.slow
def test_the_cpu_twin_trains_two_steps_and_prints_a_pass_at_1_line_per_set(tmp_path):
    proc = subprocess.run(
        [sys.executable, "-m", "lit_grpo", "fit", "--config", str(ROOT / "configs/deepscaler/cpu_smollm2.yaml")],
        cwd=tmp_path, env=OFFLINE, capture_output=True, text=True, timeout=1500)
    assert proc.returncode == 0, proc.stderr[-4000:]
    out = proc.stdout + proc.stderr
    for name, questions, samples in (("radicals", 4, 4), ("fractions", 8, 1)):
        assert re.search(rf"{name}: step 2: pass@1 \d\.\d{{3}} on {questions} latex:{name} test questions "
                         rf"\(x{samples} samples\)", out), out[-3000:]
    scalars = read_scalars(tmp_path / "runs" / "deepscaler_cpu")
    assert len(scalars["train/loss"]) == 2
    assert "eval/radicals/pass@1" in scalars and "eval/fractions/pass@1" in scalars
