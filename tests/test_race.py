"""The race against TRL (experiments/race/): both sides and the evaluator see the same prompt tokens and the same
reward, rows that the race cannot run are refused, and the report reads time-to-accuracy off the curves."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

pytest.importorskip("reasoning_gym")
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "experiments" / "race"))

import race_config  # noqa: E402
import race_report as report  # noqa: E402
from race_config import RaceConfig, reward, system_prompt_of, train_rows, user_message  # noqa: E402
from side_trl import ROW_KEYS, messages, task_reward  # noqa: E402

TASK = "reasoning_gym:letter_counting:min_words=3:max_words=5:size=200:test_size=20"


@pytest.fixture(scope="module")
def tokenizer():
    from lit_grpo.models.loading import load_model_and_tokenizer

    return load_model_and_tokenizer("tiny-random-llama", "float32")[1]


def test_lit_grpo_trl_and_the_evaluator_prompt_with_the_same_tokens(tokenizer):
    """Ours renders the task through its environment and trajectory runner; TRL applies the chat template to
    the conversation the race gives it; the evaluator builds the prompt directly. All three must be the same ids."""
    from lit_grpo.data.datamodule import RolloutDataModule
    from lit_grpo.data.prompts import prompt_ids

    config = RaceConfig(task=TASK, steps=2, eval_every=1, prompts_per_step=2)
    data = RolloutDataModule(dataset=TASK, num_generations=2, system_prompt=system_prompt_of("oneshot", TASK))
    runner = data.trajectory_runner(tokenizer)
    for row in train_rows(config):
        ours = runner.prompt(row)
        trl = tokenizer.apply_chat_template(messages(config, row), add_generation_prompt=True, tokenize=True,
                                            return_dict=True)["input_ids"]
        evaluator = prompt_ids(tokenizer, user_message(row), system_prompt_of("oneshot", TASK))
        assert ours == list(trl) == evaluator


def test_the_trl_reward_is_the_tasks_own_score():
    """TRL's batched reward, given the rows' columns as TRL passes them, scores each completion as the task's
    scorer does: a right answer 1, a wrong one 0, no tags 0."""
    rows = train_rows(RaceConfig(task=TASK, steps=2, eval_every=1, prompts_per_step=2))
    texts = [f"<answer>{rows[0]['answer']}</answer>", f"<answer>{int(rows[1]['answer']) + 1}</answer>",
             rows[2]["answer"]]
    columns = {key: [str(row.get(key, "")) for row in rows[:3]] for key in ROW_KEYS}
    scores = task_reward([None] * 3, [[{"role": "assistant", "content": t}] for t in texts], **columns)
    assert scores == [reward(t, row) for t, row in zip(texts, rows)] == [1.0, 0.0, 0.0]


def test_both_sides_train_on_the_same_rows_in_lit_grpos_order():
    """Step s's prompts are rows [s P, (s + 1) P) of the data module's seeded epoch order, different per seed."""
    from lit_grpo.data.datamodule import RolloutDataModule

    config = RaceConfig(task=TASK, steps=3, eval_every=1, prompts_per_step=2, seed=5)
    data = RolloutDataModule(dataset=TASK, prompts_per_step=2, num_generations=8, seed=5)
    assert train_rows(config) == [data.rows[i] for i in data.epoch_order(0)[:6]]
    assert train_rows(config) != train_rows(RaceConfig(task=TASK, steps=3, eval_every=1, prompts_per_step=2))


@pytest.mark.parametrize(("options", "message"), [
    ({"side": "vllm"}, "side 'vllm'"),
    ({"side": "trl", "sync_every": 4}, "on-policy"),
    ({"steps": 7, "eval_every": 5}, "multiple of eval_every"),
    ({"side": "trl", "packing": True}, "lit_grpo's options"),
    ({"side": "trl", "micro_batch_tokens": 4096}, "lit_grpo's options"),
])
def test_rows_the_race_cannot_run_are_refused(options, message):
    with pytest.raises(ValueError, match=message):
        RaceConfig(**options)


def test_row_names():
    assert [RaceConfig(side="trl").row, RaceConfig().row, RaceConfig(sync_every=4).row,
            RaceConfig(max_staleness=1).row] == ["trl", "ours", "ours-v4", "ours-k1"]


def test_the_oneshot_prompt_shows_a_train_answer_in_tags():
    example = race_config.load_rows(TASK, "train")[0]
    prompt = system_prompt_of("oneshot", TASK)
    assert f"<answer>{example['answer']}</answer>" in prompt and example["question"] in prompt
    with pytest.raises(ValueError, match="unknown prompt 'fewshot'"):
        system_prompt_of("fewshot", TASK)


def fake_run(row: str, seed: int, accuracies: list[float], seconds_per_step: float) -> dict:
    steps = [5 * i for i in range(len(accuracies))]
    return {"row": row, "config": {**RaceConfig().to_json(), "seed": seed, "steps": steps[-1], "eval_every": 5},
            "train_seconds": {str(s): s * seconds_per_step for s in steps if s},
            "eval": {str(s): {"accuracy": a, "mean_score": a} for s, a in zip(steps, accuracies)},
            "peak_rss_mib": 2048.0}


def test_time_to_accuracy_is_read_at_the_first_step_that_reaches_it():
    run = fake_run("ours", 0, [0.05, 0.3, 0.55, 0.5], 10.0)
    assert report.time_to(run, 0.5) == 100.0  # step 10, at 10 s a step
    assert report.time_to(run, 0.05) == 0.0
    assert report.time_to(run, 0.6) is None


def test_the_table_gives_each_rows_ratio_to_trl():
    runs = {"letter_counting": {"trl": [fake_run("trl", s, [0.0, 0.2, 0.6], 40.0) for s in (0, 1)],
                                "ours": [fake_run("ours", 0, [0.0, 0.6, 0.6], 10.0)]}}
    text = report.table(runs)
    trl_line = next(line for line in text.splitlines() if line.startswith("| TRL"))
    ours_line = next(line for line in text.splitlines() if line.startswith("| lit_grpo, on-policy"))
    assert "| 400 s |" in trl_line and "| 0.600 ± 0.000 | 0.600 ± 0.000 |" in trl_line
    assert "| 50 s | 0.12x |" in ours_line  # step 5 at 10 s/step, against TRL's step 10 at 40 s/step


@pytest.mark.parametrize(("precision", "effective"), [("32", "no"), ("bf16", "bf16")])
def test_trl_runs_in_the_precision_the_race_states(tmp_path, precision, effective):
    """TRL's GRPOConfig turns bf16 on when it is left unset, and accelerate then autocasts every TRL forward on a CPU
    to bfloat16: the race sets the precision itself, and the trainer TRL builds reports the one asked for."""
    from datasets import Dataset
    from side_trl import EFFECTIVE_PRECISION, checked_precision, grpo_config
    from trl import GRPOTrainer

    from lit_grpo.models.loading import load_model_and_tokenizer

    config = RaceConfig(side="trl", task=TASK, steps=1, eval_every=1, prompts_per_step=1, num_generations=2,
                        precision=precision)
    args = grpo_config(config, str(tmp_path))
    assert (args.bf16, args.fp16) == (precision == "bf16", False)
    model, tokenizer = load_model_and_tokenizer("tiny-random-llama", "float32")
    model.save_pretrained(tmp_path / "policy")
    tokenizer.save_pretrained(tmp_path / "policy")
    model.config._name_or_path = str(tmp_path / "policy")
    dataset = Dataset.from_list([{"prompt": "abc"}, {"prompt": "abd"}])
    trainer = GRPOTrainer(model=model, reward_funcs=lambda completions, **_: [0.0] * len(completions), args=args,
                          train_dataset=dataset, processing_class=tokenizer)
    assert trainer.accelerator.mixed_precision == effective == EFFECTIVE_PRECISION[precision]
    assert checked_precision(trainer, config) == effective
    with pytest.raises(RuntimeError, match="mixed precision"):
        checked_precision(trainer, RaceConfig(side="trl", task=TASK, precision="bf16" if precision == "32" else "32"))


def committed_runs(row_prefix: str) -> list[tuple[Path, dict]]:
    import json

    results = Path(__file__).resolve().parents[1] / "experiments" / "results" / "race"
    return [(p, json.loads(p.read_text())) for p in sorted(results.glob(f"*/{row_prefix}*_seed*.json"))]


def test_every_committed_trl_run_records_its_precision():
    """Each committed TRL run names its options, bf16 and fp16 among them, and what accelerate ran: float32 rows
    (``precision`` 32) with mixed precision ``no``, bf16 rows (their own label) with ``bf16``."""
    runs = committed_runs("trl")
    assert runs, "no committed TRL run"
    for path, run in runs:
        precision = run["config"].get("precision")
        assert precision in ("32", "bf16"), f"{path.name}: no precision recorded"
        expected = {"32": (False, "no"), "bf16": (True, "bf16")}[precision]
        assert (run["trl_options"].get("bf16"), run.get("trl_effective_precision")) == expected, path
        assert run["trl_options"].get("fp16") is False, path
        assert run["row"] == ("trl" if precision == "32" else "trl-bf16"), path


def test_both_sides_of_the_committed_race_whiten_alike():
    """The race uses TRL's advantage (Bessel-corrected std) on the lit_grpo side too."""
    for path, run in committed_runs("ours"):
        assert run["config"].get("advantage_std") == "bessel", path


def test_the_reasoning_warm_start_spells_each_word_and_its_total_is_the_tasks_answer():
    """The longer race's warm-start target (``warm_start.reasoning_target``): every word spelled with its count of
    the letter, the total equal to the row's gold answer on every train row (the task counts case-insensitively),
    and the tagged total last, where the task's scorer reads it."""
    from warm_start import reasoning_target

    rows = race_config.load_rows(TASK, "train")
    for row in rows:
        target = reasoning_target(row)
        assert target.endswith(f"<answer>{row['answer']}</answer>") and reward(target, row) == 1.0
    word = rows[0]["question"].split(": ")[1].strip('"?').split()[0]
    assert f"{word}: {'-'.join(word)}, " in reasoning_target(rows[0])
    with pytest.raises(ValueError, match="written for letter_counting questions"):
        reasoning_target({"question": "What is 2 + 3?", "answer": "5"})
    with pytest.raises(ValueError, match="but its answer is 9"):
        reasoning_target({**rows[0], "answer": "9"})


def test_a_race_of_its_own_keeps_its_runs_apart_and_the_table_names_the_throughput_options():
    import race

    long = RaceConfig(race="letter_counting_reasoning", packing=True, micro_batch_tokens=4096, max_new_tokens=256)
    assert race.run_path(long).parent.name == "letter_counting_reasoning"
    assert race.run_path(RaceConfig()).parent.name == "letter_counting"
    run = fake_run("ours", 0, [0.5, 0.6, 0.7], 10.0)
    run["config"].update(long.to_json(), steps=10)
    run["train_steps"] = [{"completion_length": 100.0}, {"completion_length": 120.0}]
    line = next(li for li in report.table({"x": {"ours": [run]}}).splitlines() if li.startswith("| lit_grpo"))
    assert line.startswith("| lit_grpo, on-policy (v = 1), packed, micro_batch_tokens 4096 |")
    assert "| 110.0 |" in line and "up to 256 new tokens" in report.table({"x": {"ours": [run]}})


def test_a_stopped_run_is_left_out_of_the_table_and_its_curve_sums_its_logged_steps(tmp_path):
    import json

    run = fake_run("trl", 0, [0.4, 0.5], 30.0)  # evaluated at steps 0 and 5 of a 30-step run: never finished
    run["config"]["steps"] = 30
    run["train_steps"] = [{"step": s, "seconds_trl_step_time": 10.0 * s} for s in range(1, 8)]
    (tmp_path / "task").mkdir()
    (tmp_path / "task" / "trl_seed0.partial.json").write_text(json.dumps(run))
    assert report.load_runs(tmp_path) == {}
    (stopped,) = report.load_partial(tmp_path)["task"]
    assert report.partial_curve(stopped) == ([0, 5], [0.0, 150.0], [0.4, 0.5])  # 10 + 20 + ... + 50 s
