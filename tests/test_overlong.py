"""DAPO's soft overlong punishment (eq. 13): the pure function at its three regions and their boundaries, its
refusals, and the data option that adds it to each completion's reward."""

from __future__ import annotations

import pytest
import torch

from lit_grpo.data.dynamic_sampling import OverlongPenalty
from lit_grpo.engines.base import Completion
from lit_grpo.math.overlong import soft_overlong_penalty


def test_the_three_regions_and_their_boundaries_by_hand():
    # L_max = 10, L_cache = 4: no penalty up to 6 tokens, then (6 - |y|) / 4, and -1 past 10
    lengths = torch.tensor([0, 5, 6, 7, 8, 9, 10, 11, 40])
    expected = [0.0, 0.0, 0.0, -0.25, -0.5, -0.75, -1.0, -1.0, -1.0]
    assert soft_overlong_penalty(lengths, max_length=10, buffer=4).tolist() == expected
    # the factor scales every region (verl's penalty_factor)
    assert soft_overlong_penalty(lengths, 10, 4, factor=0.5).tolist() == [0.5 * v for v in expected]


def test_a_one_token_buffer_punishes_only_the_last_token():
    # L_max = 5, L_cache = 1: 4 tokens are free, the 5th costs (4 - 5) / 1 = -1
    assert soft_overlong_penalty(torch.tensor([3, 4, 5]), 5, 1, factor=2.0).tolist() == [0.0, 0.0, -2.0]


@pytest.mark.parametrize("buffer", [0, 10, 12, True, 2.5])
def test_a_buffer_outside_the_length_limit_is_refused(buffer):
    with pytest.raises(ValueError, match="buffer"):
        soft_overlong_penalty(torch.tensor([1]), 10, buffer)


@pytest.mark.parametrize("kwargs, match", [
    ({"buffer": -1}, "overlong_penalty.buffer must be an integer >= 0"),
    ({"buffer": 2.0}, "overlong_penalty.buffer"),
    ({"factor": -0.5}, "overlong_penalty.factor must be a finite number >= 0"),
    ({"factor": float("nan")}, "overlong_penalty.factor"),
])
def test_bad_options_are_refused_in_one_line(kwargs, match):
    with pytest.raises(ValueError, match=match):
        OverlongPenalty(**kwargs)


def test_the_data_option_refuses_a_buffer_not_below_max_new_tokens():
    from conftest import tiny_data

    with pytest.raises(ValueError, match=r"overlong_penalty.buffer=8 must be below max_new_tokens=8"):
        tiny_data(max_new_tokens=8, overlong_penalty={"buffer": 8})
    with pytest.raises(ValueError, match="overlong_penalty.*factor"):
        tiny_data(overlong_penalty={"buffer": 2, "factor": -1})


def test_the_data_module_adds_the_penalty_to_each_completions_reward():
    from conftest import tiny_data

    from lit_grpo import models

    data = tiny_data(max_new_tokens=8, overlong_penalty={"buffer": 4, "factor": 0.5}, rewards=["toy_rewards:has_digit"])
    data.tokenizer = models.tiny_tokenizer()
    digit = data.tokenizer.convert_tokens_to_ids("0")
    # lengths 3, 5, 7, 8 against L_max = 8, L_cache = 4: penalties 0, -0.25, -0.75, -1 (times 0.5)
    group = [Completion([digit] * n, [0.0] * n, truncated=n == 8) for n in (3, 5, 7, 8)]
    scored = data.score_groups([0], [group])
    assert scored.rewards == [1.0, 1.0 - 0.125, 1.0 - 0.375, 1.0 - 0.5]
    # off by default: the rewards alone
    plain = tiny_data(max_new_tokens=8, rewards=["toy_rewards:has_digit"])
    plain.tokenizer = data.tokenizer
    assert plain.score_groups([0], [group]).rewards == [1.0] * 4
