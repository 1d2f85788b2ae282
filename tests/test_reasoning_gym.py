"""reasoning-gym tasks as dataset rows and a single-turn environment (lit_grpo.environments.reasoning_gym): rows are
reasoning-gym's own, deterministic, plain data, the splits share no question, and the reward is the task's own
scorer on the answer reasoning-gym's extractor finds."""

import json
import sys
from decimal import Decimal
from fractions import Fraction

import pytest
import reasoning_gym

from lit_grpo.environments import reasoning_gym as rg
from lit_grpo.environments.protocol import check_reset, check_step, resolve_environment

# two numeric tasks and two whose answers are words; small sizes keep the file fast
TASKS = ["basic_arithmetic", "chain_sum", "letter_counting", "spell_backward"]
SIZES = ":size=60:test_size=20"


def spec(task: str, extra: str = "") -> str:
    return f"reasoning_gym:{task}{SIZES}{extra}"


def clear_caches() -> None:
    rg._train_rows.cache_clear()
    rg._test_rows.cache_clear()
    rg._score_answer.cache_clear()


def tagged(answer: str) -> str:
    return f"Let me work it out step by step.\n<answer>{answer}</answer>"


@pytest.mark.parametrize("task", TASKS)
def test_rows_are_deterministic_plain_and_disjoint(task):
    train, test = rg.load_rows(spec(task), "train"), rg.load_rows(spec(task), "test")
    clear_caches()  # generated again, not read back from the cache
    assert rg.load_rows(spec(task), "train") == train
    assert rg.load_rows(spec(task), "test") == test
    assert (len(train), len(test)) == (60, 20)
    assert not {row["question"] for row in train} & {row["question"] for row in test}
    assert len({row["question"] for row in test}) == len(test)
    for row in train + test:
        assert set(row) == {"question", "answer", "task", "config", "entry"}
        assert all(isinstance(value, str) for value in row.values())
        assert json.loads(json.dumps(row)) == row
        assert row["task"] == task
        assert rg.decode_entry(row["entry"])["question"] == row["question"]
    # the train rows are reasoning-gym's own dataset for that seed and size
    dataset = reasoning_gym.create_dataset(task, seed=0, size=60)
    assert [row["question"] for row in train] == [dataset[i]["question"] for i in range(60)]
    assert [row["answer"] for row in train] == [dataset[i]["answer"] for i in range(60)]


def test_the_seed_changes_the_rows():
    assert rg.load_rows(spec("chain_sum", ":seed=1"), "train") != rg.load_rows(spec("chain_sum", ":seed=2"), "train")
    assert rg.load_rows(spec("chain_sum", ":seed=1"), "test") != rg.load_rows(spec("chain_sum", ":seed=2"), "test")
    # adjacent seeds: one spec's test split is not the next spec's train split
    next_train = [row["question"] for row in rg.load_rows(spec("spell_backward", ":seed=4"), "train")]
    assert [row["question"] for row in rg.load_rows(spec("spell_backward", ":seed=3"), "test")] != next_train[:20]


@pytest.mark.parametrize("task", TASKS)
def test_environment_scores_with_the_tasks_own_scorer(task):
    row = json.loads(json.dumps(rg.load_rows(spec(task), "test")[0]))  # as a checkpoint or a subprocess carries it
    env = resolve_environment("lit_grpo.environments.reasoning_gym:ReasoningGymEnvironment")(row)
    first = env.reset()
    assert row["question"] in first and rg.ANSWER_FORMAT in first
    assert check_reset(first) == [{"role": "user", "content": first}]

    reply, reward, done = env.step(tagged(row["answer"]))
    assert (reply, reward, done) == (None, 1.0, True)
    checked = check_step(env.step(tagged(row["answer"])))
    assert (checked.reply, checked.reward, checked.done) == (None, 1.0, True)

    wrong = env.step(tagged(row["answer"] + "7"))[1]
    assert 0.0 <= wrong < 1.0
    # the gold answer in the text but not in the tags the extractor reads: nothing to score
    assert env.step(f"The answer is {row['answer']}.")[1] == 0.0
    assert env.step("")[1] == 0.0
    # reasoning-gym's extractor reads the last pair of tags
    assert env.step(f"<answer>{row['answer']}7</answer> no, wait: <answer>{row['answer']}</answer>")[1] == 1.0
    assert env.step(f"<answer>{row['answer']}</answer> no, wait: <answer>{row['answer']}7</answer>")[1] == wrong
    # the same number as the task's scorer gives the extracted answer
    scorer = reasoning_gym.get_score_answer_fn(task)
    entry = rg.decode_entry(row["entry"])
    assert rg.score_completion(tagged(row["answer"] + "7"), row) == scorer(row["answer"] + "7", entry)


def test_numeric_tasks_score_a_wrong_number_zero():
    for task in ("basic_arithmetic", "chain_sum"):
        row = rg.load_rows(spec(task), "train")[0]
        assert rg.score_completion(tagged(str(int(row["answer"]) + 1)), row) == 0.0


def test_entries_keep_tuples_and_fractions_that_scorers_compare():
    entry = {"question": "q", "answer": "a", "metadata": {"board": ((1, 2), (3, 4)), "ratio": Fraction(6, 4),
                                                          "by_id": {1: "x", 2: ["y", (5,)]}}}
    text = rg.encode_entry(entry)
    assert json.loads(text)  # plain JSON
    assert rg.decode_entry(text) == entry
    assert isinstance(rg.decode_entry(text)["metadata"]["board"][0], tuple)
    with pytest.raises(ValueError, match="set"):
        rg.encode_entry({"question": "q", "answer": "a", "metadata": {"seen": {1, 2}}})


def test_arc_scores_its_gold_board_after_the_row_travels():
    # ARC's scorer compares the parsed board with a tuple of tuples in the metadata: plain JSON lists score 0.05
    row = json.loads(json.dumps(rg.load_rows("reasoning_gym:rearc:size=2:test_size=1", "train")[0]))
    assert isinstance(rg.decode_entry(row["entry"])["metadata"]["output"], tuple)
    assert rg.score_completion(tagged(row["answer"]), row) == 1.0


def test_task_configuration_reaches_rows_and_scorer():
    task, options = rg.parse_spec("reasoning_gym:basic_arithmetic:max_terms=2:max_digits=1:operators=[\"+\"]:seed=5")
    assert task == "basic_arithmetic"
    assert options == {"size": 1000, "test_size": 200, "seed": 5, "max_terms": 2, "max_digits": 1, "operators": ["+"]}
    rows = rg.load_rows(spec("basic_arithmetic", ":max_terms=2:max_digits=1:operators=[\"+\"]"), "train")
    assert all(rg.decode_entry(row["entry"])["metadata"]["num_terms"] == 2 for row in rows)
    assert all("*" not in row["question"] and "/" not in row["question"] for row in rows)
    assert json.loads(rows[0]["config"]) == {"max_terms": 2, "max_digits": 1, "operators": ["+"]}
    # decimal_arithmetic's scorer reads its configuration: one decimal place tolerates an error up to 0.1, the
    # default three places only 0.001, so the row must be scored under the configuration that generated it
    row = rg.load_rows(spec("decimal_arithmetic", ":min_num_decimal_places=1:max_num_decimal_places=1"), "test")[0]
    close = str(Decimal(row["answer"]) + Decimal("0.05"))
    assert rg.score_completion(tagged(row["answer"]), row) == 1.0
    assert rg.score_completion(tagged(close), row) == 1.0
    assert reasoning_gym.get_score_answer_fn("decimal_arithmetic")(close, rg.decode_entry(row["entry"])) == 0.0


def test_a_task_with_few_questions_warns_then_refuses():
    small = "reasoning_gym:chain_sum:min_terms=2:max_terms=2:min_digits=1:max_digits=1"  # 200 distinct questions
    with pytest.warns(UserWarning, match="gave only"):
        test = rg.load_rows(f"{small}:size=300:test_size=150", "test")
    assert 0 < len(test) < 150
    with pytest.raises(ValueError, match="no question outside its 3000 train rows"):
        rg.load_rows(f"{small}:size=3000:test_size=5", "test")


@pytest.mark.parametrize(("bad", "named"), [
    ("reasoning_gym:basic_arithmetc", "'basic_arithmetc'"),
    ("reasoning_gym:", "''"),
    ("gsm8k", "'gsm8k'"),
    ("reasoning_gym:chain_sum:colour=red", "'colour=red'"),
    ("reasoning_gym:chain_sum:size", "'size'"),
    ("reasoning_gym:chain_sum:size=0", "size='0'"),
    ("reasoning_gym:chain_sum:seed=-1", "seed='-1'"),
    ("reasoning_gym:chain_sum:test_size=ten", "test_size='ten'"),
    ("reasoning_gym:chain_sum:seed=1:seed=2", "'seed' given twice"),
])
def test_bad_specs_say_what_is_wrong_in_one_line(bad, named):
    with pytest.raises(ValueError) as caught:
        rg.parse_spec(bad)
    message = str(caught.value)
    assert named in message and "\n" not in message
    with pytest.raises(ValueError):
        rg.load_rows(bad, "train")


def test_unknown_task_lists_real_names():
    with pytest.raises(ValueError, match="basic_arithmetic") as caught:
        rg.parse_spec("reasoning_gym:arithmetic")
    assert "'arithmetic'" in str(caught.value)


def test_bad_split_and_bad_configuration_values():
    with pytest.raises(ValueError, match="split 'validation'"):
        rg.load_rows(spec("chain_sum"), "validation")
    with pytest.raises(ValueError, match="max_terms must be >= min_terms"):
        rg.load_rows("reasoning_gym:basic_arithmetic:min_terms=3:max_terms=2", "train")
    with pytest.raises(ValueError, match="lacks entry"):
        rg.ReasoningGymEnvironment({"question": "q", "task": "chain_sum"})


def test_missing_package_names_the_extra(monkeypatch):
    monkeypatch.setitem(sys.modules, "reasoning_gym", None)  # import reasoning_gym now raises ImportError
    with pytest.raises(rg.ReasoningGymMissing, match=r'pip install -e "\.\[reasoning-gym\]"') as caught:
        rg.parse_spec("reasoning_gym:chain_sum")
    assert isinstance(caught.value, ValueError) and isinstance(caught.value, ImportError)


def test_a_reasoning_gym_dataset_brings_its_environment_and_trains():
    """``data.dataset: reasoning_gym:<task>`` alone: the rows are the task's, the environment its scorer, no reward
    function is added, and a fit step's rewards are the scorer's."""
    import lightning as L
    from conftest import MetricsRecorder, tiny_module
    from lit_grpo.callbacks import WeightSync

    from lit_grpo.data.datamodule import RolloutDataModule
    from lit_grpo.environments.reasoning_gym import ReasoningGymEnvironment

    data = RolloutDataModule(dataset="reasoning_gym:basic_arithmetic:size=20", prompts_per_step=2, num_generations=2,
                             micro_batch_size=4, max_new_tokens=4, system_prompt=None)
    assert data.environment_factory is ReasoningGymEnvironment
    assert data.reward_runner.functions == [] and len(data.rows) == 20
    assert data.rows == rg.load_rows("reasoning_gym:basic_arithmetic:size=20", "train")
    recorder = MetricsRecorder()
    trainer = L.Trainer(max_steps=1, accelerator="cpu", logger=False, enable_checkpointing=False,
                        enable_progress_bar=False, callbacks=[WeightSync(), recorder])
    trainer.fit(tiny_module(max_completion_length=4), data)
    (metrics,) = recorder.steps
    assert metrics["rollout/turns"] == 1.0 and metrics["rollout/env_errors"] == 0.0
    assert metrics["rollout/reward_mean"] == 0.0  # four random tokens hold no <answer> tag: the scorer gives 0


# ---- the task's own prompt and scoring by default ------------------------------------------------------------------
TASK = "reasoning_gym:basic_arithmetic:size=20:test_size=4"


def both_formats(answer: str) -> str:
    """A right answer in reasoning-gym's tags and in GSM8K's ``####`` form: a GSM8K reward would score it too."""
    return f"3 + 4 = 7\n#### {answer}\n<answer>{answer}</answer>"


def scripted_groups(data, tokenizer, texts: list[str]):  # noqa: ANN001, ANN201
    """The data module's trajectories of its first rows, one per text, the model's turn being that text."""
    from lit_grpo.engines.base import Completion, Rollouts

    turns = [tokenizer(text, add_special_tokens=False)["input_ids"] + [tokenizer.eos_token_id] for text in texts]

    def sample(prompts, n, sampling, seed):  # noqa: ANN001, ANN202
        return Rollouts([[Completion(turns[i], [0.0] * len(turns[i]), False) for _ in range(n)]
                         for i in range(len(prompts))])

    runner = data.trajectory_runner(tokenizer)
    return runner.run([data.rows[i] for i in range(len(texts))], data.num_generations, sample, data.sampling,
                      0).groups


@pytest.fixture(scope="module")
def tokenizer():
    from lit_grpo.models.loading import load_model_and_tokenizer

    return load_model_and_tokenizer("tiny-random-llama", "float32")[1]


def test_a_task_is_prompted_with_reasoning_gyms_own_system_prompt(tokenizer):
    """``data.system_prompt`` left at its default (GSM8K's, which asks for '#### <answer>') becomes reasoning-gym's
    own prompt, which asks for the ``<answer>`` tags the scorer reads; a prompt the user set is kept."""
    from reasoning_gym.utils import SYSTEM_PROMPTS

    from lit_grpo.data.datamodule import RolloutDataModule
    from lit_grpo.data.prompts import DEFAULT_SYSTEM_PROMPT

    data = RolloutDataModule(dataset=TASK, num_generations=2)
    assert data.system_prompt == SYSTEM_PROMPTS["default"]
    assert rg.system_prompt() == SYSTEM_PROMPTS["default"]
    prompt = tokenizer.decode(data.trajectory_runner(tokenizer).prompt(data.rows[0]))
    assert SYSTEM_PROMPTS["default"].strip() in prompt and "####" not in prompt
    assert prompt.count("<answer>") >= 1 and data.rows[0]["question"] in prompt
    assert RolloutDataModule(dataset=TASK, num_generations=2, system_prompt=None).system_prompt is None
    assert RolloutDataModule(dataset=TASK, num_generations=2, system_prompt="Be brief.").system_prompt == "Be brief."
    assert RolloutDataModule(num_generations=2).system_prompt == DEFAULT_SYSTEM_PROMPT  # GSM8K keeps its own


def test_a_right_answer_scores_the_tasks_one_through_the_data_modules_scoring(tokenizer):
    """By default a trajectory's reward is the task's score alone: a right answer scores 1, never 1 + a GSM8K
    reward's; ``add_rewards_to_environment`` adds them, on purpose only."""
    from lit_grpo.data.datamodule import RolloutDataModule

    data = RolloutDataModule(dataset=TASK, num_generations=2)
    rows = [0, 1]
    texts = [both_formats(data.rows[0]["answer"]), both_formats(str(int(data.rows[1]["answer"]) + 1))]
    scored = data.score_groups(rows, scripted_groups(data, tokenizer, texts))
    assert scored.rewards == [1.0, 1.0, 0.0, 0.0]

    added = RolloutDataModule(dataset=TASK, num_generations=2, rewards=["correctness"],
                              add_rewards_to_environment=True)
    scored = added.score_groups(rows, scripted_groups(added, tokenizer, texts))
    assert scored.rewards == [2.0, 2.0, 0.0, 0.0]  # the task's 1 and correctness's 1, asked for


def test_predict_samples_with_the_training_prompt(tmp_path, monkeypatch):
    """``predict`` on a reasoning-gym task: the conversation starts with the system prompt training samples with
    (reasoning-gym's own), and each trajectory's reward is the task's score alone."""
    from reasoning_gym.utils import SYSTEM_PROMPTS

    from lit_grpo.cli.lightning_cli import main

    monkeypatch.setattr(sys, "argv", ["lit_grpo"])
    monkeypatch.chdir(tmp_path)
    out = tmp_path / "predictions.jsonl"
    main(["predict", "--model.model_name", "tiny-random-llama", "--data.dataset", TASK, "--data.num_generations",
          "2", "--data.max_new_tokens", "4", "--trainer.accelerator", "cpu", "--predictions.output", str(out),
          "--predictions.num_questions", "2"])
    records = [json.loads(line) for line in out.read_text().splitlines()]
    assert len(records) == 2
    for record in records:
        for trajectory in record["trajectories"]:
            assert trajectory["messages"][0] == {"role": "system", "content": SYSTEM_PROMPTS["default"]}
            assert trajectory["reward"] == trajectory["env_reward"]
