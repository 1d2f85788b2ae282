"""The synthetic arithmetic task (``synthetic:<task>``) and the warm-start recipe of ``arith-tiny-sft``."""

from __future__ import annotations

import pytest
import torch

from lit_grpo.data.gsm8k import load_gsm8k
from lit_grpo.data.rewards import correctness_reward
from lit_grpo.data.synthetic import (
    TASKS,
    TEST_SIZE,
    TRAIN_SIZE,
    Problem,
    final_answer,
    generate_problems,
    generate_rows,
    parse_name,
    worked_answer,
)
from lit_grpo.training.warm_start import WarmStartConfig, lr_factor, train_warm_start


def test_worked_answer_of_a_hand_example() -> None:
    # 47 + 38: units 7+8=15 (write 5, carry 1), tens 4+3+1=8 -> 85
    assert worked_answer(Problem((47, 38)).columns()) == "7+8=15\n4+3+1=8\n#### 85"
    # 999 + 1: the shorter operand is padded, every column carries
    assert worked_answer(Problem((999, 1)).columns()) == "9+1=10\n9+0+1=10\n9+0+1=10\n#### 1000"


def test_a_slip_propagates_to_the_final_answer() -> None:
    # a wrong units sum (14 instead of 15) changes the written answer, and later columns carry on from it
    columns = Problem((47, 38)).columns(totals={0: 14})
    assert [c.line for c in columns] == ["7+8=14", "4+3+1=8"]
    assert final_answer(columns) == 84


@pytest.mark.parametrize("task", sorted(TASKS))
def test_generator_is_deterministic_by_seed(task: str) -> None:
    first, again = generate_rows(task, "test", seed=0), generate_rows(task, "test", seed=0)
    assert first == again
    assert generate_rows(task, "test", seed=1) != first
    assert len(first) == TEST_SIZE and len(generate_rows(task, "train", seed=0)) == TRAIN_SIZE


@pytest.mark.parametrize("task", sorted(TASKS))
def test_splits_are_disjoint_and_in_range(task: str) -> None:
    splits = generate_problems(task, seed=0)
    train, test = ({p.operands for p in splits[s]} for s in ("train", "test"))
    assert len(test) == TEST_SIZE and len(train) == TRAIN_SIZE  # no duplicates inside a split
    assert not train & test
    low, high = 10 ** (TASKS[task] - 1), 10 ** TASKS[task] - 1
    assert all(low <= x <= high for pair in train | test for x in pair)


def test_rows_are_gsm8k_rows_that_the_reward_accepts() -> None:
    rows = load_gsm8k("synthetic:add_2digit:seed=3", "test")
    assert rows == generate_rows("add_2digit", "test", seed=3)
    for row in rows[:50]:
        a, b = (int(x) for x in row["question"].removeprefix("What is ").rstrip("?").split(" + "))
        assert row["gold"] == str(a + b)
        assert row["answer"].endswith(f"#### {a + b}")
    golds = [row["gold"] for row in rows[:5]]
    assert [correctness_reward(row["answer"], gold) for row, gold in zip(rows[:5], golds)] == [1.0] * 5
    assert [correctness_reward("#### 1", gold) for gold in golds] == [0.0] * 5


@pytest.mark.parametrize("bad", ["synthetic:sub_2digit", "synthetic:add_2digit:sed=1", "synthetic:add_2digit:seed=x",
                                 "gsm8k"])
def test_bad_names_are_rejected_with_the_valid_ones(bad: str) -> None:
    with pytest.raises(ValueError, match="synthetic:add_2digit"):
        parse_name(bad)


def test_bad_split_and_sizes_are_rejected() -> None:
    with pytest.raises(ValueError, match="'validation'"):
        generate_rows("add_2digit", "validation")
    with pytest.raises(ValueError, match="8100 problems"):
        generate_problems("add_2digit", test_size=8000, train_size=200)


def test_warm_start_is_a_pure_function_of_its_config() -> None:
    config = WarmStartConfig(steps=3, warmup_steps=1, batch_size=4, hidden_size=16, intermediate_size=32,
                             num_hidden_layers=1, num_attention_heads=2)
    losses: list[float] = []
    first, _ = train_warm_start(config, log=None, on_step=lambda step, model, loss: losses.append(loss))
    again, _ = train_warm_start(config, log=None)
    assert len(losses) == 3 and all(loss > 0 for loss in losses)
    for (name, a), (_, b) in zip(first.state_dict().items(), again.state_dict().items()):
        assert torch.equal(a, b), name
    assert config.key() != WarmStartConfig(steps=3, warmup_steps=1, batch_size=4, hidden_size=16,
                                           intermediate_size=32, num_hidden_layers=1, num_attention_heads=2,
                                           label_smoothing=0.0).key()


def test_warm_start_schedule_and_config_checks() -> None:
    config = WarmStartConfig(steps=100, warmup_steps=10)
    assert lr_factor(config, 0) == pytest.approx(0.1) and lr_factor(config, 9) == pytest.approx(1.0)
    assert lr_factor(config, 10) == pytest.approx(1.0) and lr_factor(config, 100) == pytest.approx(0.1)
    with pytest.raises(ValueError, match="stop_after"):
        WarmStartConfig(steps=10, stop_after=11)
