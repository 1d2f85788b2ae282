"""Environment tasks outside the rollout batch: Pass@k of whole trajectories (the callback, ``validate``), ``predict``
writing each trajectory's messages and rewards, the callback refusing an ``eval.dataset`` the environment cannot
start before any training, and colocated vLLM kept awake across a batch's turns."""

import json
import sys

import pytest

from lit_grpo.cli.commands import main
from lit_grpo.data.datamodule import RolloutDataModule
from lit_grpo.data.multi_turn import EnvironmentStartError, MultiTurnOptions
from lit_grpo.data.rewards import RewardRunner
from lit_grpo.engines.base import SamplingConfig
from lit_grpo.evaluation.pass_at_k import PassAtKSettings, evaluate_pass_at_k
from lit_grpo.models.loading import load_model_and_tokenizer

VERDICTS = [1, 0, 1, 1, 0, 0, 0, 1, 1, 0]


@pytest.fixture
def tasks(tmp_path):
    path = tmp_path / "tasks.jsonl"
    path.write_text("".join(json.dumps({"pass": v, "target": i % 10}) + "\n" for i, v in enumerate(VERDICTS)))
    return path


@pytest.fixture(scope="module")
def tiny():
    return load_model_and_tokenizer("tiny-random-llama", "float32")


def runner_of(tokenizer, **data):
    data.setdefault("dataset", str(data.pop("path", "bundled")))
    module = RolloutDataModule(num_generations=2, max_new_tokens=4, system_prompt=None, **data)
    return module, module.trajectory_runner(tokenizer)


def test_pass_at_k_of_trajectories_is_the_environments_reward(tiny, tasks):
    policy, tokenizer = tiny
    data, runner = runner_of(tokenizer, path=tasks, environment="toy_environments:RowVerdict")
    settings = PassAtKSettings(num_samples=3, ks=(1, 3), sampling=SamplingConfig(max_new_tokens=4),
                               questions_per_chunk=4)
    results = evaluate_pass_at_k(policy, tokenizer, data.rows, settings, judge=RewardRunner(["correctness"]),
                                 trajectories=runner)
    # every sample of a task scores the row's verdict: Pass@1 = Pass@3 = the share of rows that pass
    assert results[1] == pytest.approx(sum(VERDICTS) / len(VERDICTS))
    assert results[3] == pytest.approx(sum(VERDICTS) / len(VERDICTS))


def test_pass_at_k_with_tools_only_is_the_judges_score_of_the_last_turn(tiny):
    policy, tokenizer = tiny
    data, runner = runner_of(tokenizer, tools=["toy_environments:add"], max_prompts=6)
    settings = PassAtKSettings(num_samples=2, ks=(1,), sampling=SamplingConfig(max_new_tokens=4))
    always = evaluate_pass_at_k(policy, tokenizer, data.rows, settings, judge=RewardRunner(["toy_rewards:always_one"]),
                                trajectories=runner)
    never = evaluate_pass_at_k(policy, tokenizer, data.rows, settings, judge=RewardRunner(["correctness"]),
                               trajectories=runner)
    assert always[1] == 1.0 and never[1] == 0.0  # a random model never answers GSM8K


def test_predict_writes_each_trajectorys_messages_and_rewards(tasks, tmp_path, monkeypatch):
    monkeypatch.setattr(sys, "argv", ["lit_grpo"])
    monkeypatch.chdir(tmp_path)
    out = tmp_path / "predictions.jsonl"
    main(["predict", "--model.model_name", "tiny-random-llama", "--data.dataset", str(tasks),
          "--data.environment", "toy_environments:GuessTheNumber", "--data.num_generations", "2",
          "--data.max_new_tokens", "4", "--data.system_prompt", "null", "--data.multi_turn.max_turns", "2",
          "--trainer.accelerator", "cpu", "--predictions.output", str(out), "--predictions.num_questions", "3",
          "--predictions.split", "train"])
    records = [json.loads(line) for line in out.read_text().splitlines()]
    assert len(records) == 3
    for record, target in zip(records, range(3)):
        assert record["task"]["target"] == target
        assert len(record["trajectories"]) == 2
        for trajectory in record["trajectories"]:
            messages = trajectory["messages"]
            assert messages[0] == {"role": "user", "content": "Guess my number (0-9)."}
            assert messages[1]["role"] == "assistant"
            assert 1 <= trajectory["turns"] <= 2
            assert trajectory["stop"] in ("done", "max_turns", "max_new_tokens", "max_total_tokens")
            assert trajectory["reward"] == trajectory["env_reward"] in (0.0, 1.0)


def test_validate_samples_the_environment(tasks, tmp_path, monkeypatch, capsys):
    monkeypatch.setattr(sys, "argv", ["lit_grpo"])
    monkeypatch.chdir(tmp_path)
    cli = main(["validate", "--model.model_name", "tiny-random-llama", "--data.dataset", str(tasks),
                "--data.environment", "toy_environments:RowVerdict", "--data.max_new_tokens", "4",
                "--data.system_prompt", "null", "--trainer.accelerator", "cpu", "--eval.dataset", str(tasks),
                "--eval.num_samples", "2", "--eval.ks", "[1]", "--eval.questions_per_chunk", "5"])
    assert cli.results[1] == pytest.approx(sum(VERDICTS) / len(VERDICTS))
    assert f"{len(VERDICTS)} questions x 2 samples" in capsys.readouterr().out


def test_an_eval_dataset_the_environment_cannot_start_is_refused_before_training(tasks, tmp_path):
    import lightning as L
    from lit_grpo.callbacks import GSM8KPassAtK, WeightSync

    from lit_grpo.training.module import GRPOModule

    module = GRPOModule(model_name="tiny-random-llama", temperature=1.0, max_completion_length=4)
    data = RolloutDataModule(dataset=str(tasks), environment="toy_environments:GuessTheNumber", num_generations=2,
                             max_new_tokens=4, system_prompt=None, prompts_per_step=2)
    steps = []

    class Count(L.Callback):
        def on_train_batch_start(self, *args):
            steps.append(1)

    evaluation = GSM8KPassAtK(dataset="synthetic:add_2digit", num_samples=2, num_questions=2, at_start=True)
    trainer = L.Trainer(max_steps=1, accelerator="cpu", logger=False, enable_checkpointing=False,
                        enable_progress_bar=False, callbacks=[WeightSync(), evaluation, Count()])
    with pytest.raises(EnvironmentStartError, match=r"synthetic:add_2digit test.*KeyError: 'target'.*point it at") \
            as error:
        trainer.fit(module, data)
    assert error.value.key == "eval.dataset"  # the command line's error line names the option
    assert steps == []
    # with evaluation off, the same dataset is never started: the fit trains
    off = GSM8KPassAtK(dataset="synthetic:add_2digit", every_n_optimizer_steps=None, at_end=False)
    trainer = L.Trainer(max_steps=1, accelerator="cpu", logger=False, enable_checkpointing=False,
                        enable_progress_bar=False, callbacks=[WeightSync(), off, Count()])
    trainer.fit(module, data)
    assert steps == [1]


def test_colocated_vllm_stays_awake_across_the_turns_of_a_batch(monkeypatch):
    import lit_grpo.engines.vllm_engine as vllm_engine

    events = []

    class FakeLLM:
        def sleep(self, level):
            events.append("sleep")

        def wake_up(self):
            events.append("wake")

        def generate(self, requests, params, **kwargs):
            events.append("generate")
            return [None] * len(requests)

    engine = object.__new__(vllm_engine.VLLMEngine)
    engine.llm, engine.enable_sleep_mode, engine._asleep, engine._held_awake = FakeLLM(), True, True, 0
    engine._tokens_prompt_cls = lambda prompt_token_ids: prompt_token_ids
    engine.sampling_params = lambda n, sampling, seed: None
    engine.lora_request = lambda: None
    monkeypatch.setattr(vllm_engine, "to_group", lambda out, n: [])
    sampling = SamplingConfig(max_new_tokens=2)
    engine.generate([[1, 2]], 1, sampling, 0)
    assert events == ["wake", "generate", "sleep"]  # one call: asleep after it, as before
    events.clear()
    with engine.awake():
        for turn in range(3):
            engine.generate([[1, 2]], 1, sampling, turn)
        assert events == ["wake", "generate", "generate", "generate"]  # the KV cache is kept between turns
    assert events[-1] == "sleep" and events.count("sleep") == 1


def test_multi_turn_options_reach_the_runner(tiny):
    _, tokenizer = tiny
    _, runner = runner_of(tokenizer, tools=["toy_environments:add"], max_prompts=2,
                          multi_turn=MultiTurnOptions(max_turns=2, tool_timeout_s=3.0))
    assert runner.options.max_turns == 2 and runner.tools.timeout_s == 3.0
    assert runner.tools.schemas[0]["function"]["name"] == "add"
