"""Rewards in the Python API: callables next to import paths, the reward contract checked before training
(``fn(completion, answer, **kwargs) -> float``), a function that scores no completion of the first batch stops the
run in one line naming it, later failures are counted and warned about once, and which callables survive a process
Lightning spawns."""

from __future__ import annotations

import copy
import functools
import logging
import os
import pickle
import threading

import pytest

from lit_grpo.data.rewards import (
    REWARD_CONTRACT,
    RewardFunctionError,
    RewardRunner,
    format_reward,
    resolve_reward,
    reward_name,
)

RELEASE = threading.Event()


def first_char_digit(completion: str, answer: str, **kwargs: object) -> float:
    """1 when the completion starts with a digit."""
    return float(completion[:1].isdigit())


def scaled(completion: str, answer: str, scale: float = 1.0, **kwargs: object) -> float:
    return scale * len(completion)


def always_raises(completion: str, answer: str, **kwargs: object) -> float:
    raise RuntimeError("no score today")


def returns_text(completion: str, answer: str, **kwargs: object) -> str:
    return "1.0"  # a number written as text is a bug in the reward, not a score


def raises_on_bad(completion: str, answer: str, **kwargs: object) -> float:
    if completion == "bad":
        raise ValueError("bad completion")
    return 1.0


def blocks(completion: str, answer: str, **kwargs: object) -> float:
    RELEASE.wait(60)
    return 1.0


async def async_reward(completion: str, answer: str, **kwargs: object) -> float:
    return 1.0


HERE = __name__


# --------------------------------------------------------------------------------------------- callables


def test_a_callable_is_a_reward_named_by_module_and_qualname() -> None:
    runner = RewardRunner([first_char_digit, ("format", 0.5)])
    result = runner(["1 apple\n#### 1", "apple"], ["1", "1"])
    name = f"{HERE}:first_char_digit"
    assert runner.specs == [(name, 1.0), ("format", 0.5)]
    assert result.per_function == {name: [1.0, 0.0], "format": [1.0, 0.0]}
    assert result.rewards == [1.0 + 0.5 * 1.0, 0.0]


def test_callables_with_weights_partials_and_the_same_function_by_path() -> None:
    half = functools.partial(scaled, scale=0.5)
    runner = RewardRunner([(first_char_digit, 2.0), (half, 1.0)])
    result = runner(["12", "abc"], ["1", "1"])
    assert result.rewards == [2.0 * 1 + 0.5 * 2, 2.0 * 0 + 0.5 * 3]
    assert reward_name(half) == repr(half)  # a partial has no qualified name of its own
    # a callable and its import path are the same reward: listed twice, refused
    with pytest.raises(ValueError, match="listed more than once"):
        RewardRunner([format_reward, "lit_grpo.data.rewards:format_reward"])
    assert resolve_reward(first_char_digit) is first_char_digit


def test_a_value_neither_spec_nor_callable_is_refused() -> None:
    with pytest.raises(ValueError, match="expected a spec string, a callable or a"):
        RewardRunner([3])
    with pytest.raises(ValueError, match=r"reward 3: .*or the callable itself"):
        resolve_reward(3)


# --------------------------------------------------------------------------------------------- the contract


@pytest.mark.parametrize(("spec", "name", "signature"), [
    ("os:getcwd", "os:getcwd", "()"),  # no argument at all
    ("builtins:len", "builtins:len", "(obj, /)"),  # one
    (os.getcwd, "posix:getcwd" if os.name == "posix" else "nt:getcwd", "()"),
    (lambda completion: 1.0, f"{HERE}:<lambda>", "(completion)"),
    (str.upper, "builtins:str.upper", "(self, /)"),
])
def test_a_reward_that_cannot_take_completion_and_answer_is_refused(spec, name: str, signature: str) -> None:
    with pytest.raises(ValueError) as info:
        RewardRunner([spec])
    message = str(info.value)
    assert "\n" not in message
    assert f"reward {name!r} has the signature {signature}" in message
    assert f"expected {REWARD_CONTRACT}" in message


def trl_style(prompts: list, completions: list, **kwargs: object) -> list[float]:
    return [1.0 for _ in completions]


def test_a_batched_trl_reward_is_refused_with_the_contract() -> None:
    with pytest.raises(ValueError, match=rf"reward '{HERE}:trl_style' has the signature .* of a batched TRL "
                                         r"reward_funcs function; the runner scores one completion per call"):
        RewardRunner([trl_style])


def returns_a_list(completion: str, answer: str, **kwargs: object) -> list[float]:
    return [0.5] * 100


def test_a_long_non_number_is_shortened_in_the_one_line() -> None:
    with pytest.raises(RewardFunctionError) as info:
        RewardRunner([returns_a_list])(["a"], ["1"])
    assert "returned [0.5, 0.5, 0.5, 0.5, 0.5, 0.5, ...], expected a number" in str(info.value)


def test_a_coroutine_function_is_refused() -> None:
    with pytest.raises(ValueError, match=rf"reward '{HERE}:async_reward' is a coroutine function"):
        RewardRunner([async_reward])


def test_a_builtin_without_a_signature_is_judged_by_its_first_batch() -> None:
    runner = RewardRunner(["builtins:max"])  # Python cannot read max's signature: nothing to refuse yet
    with pytest.raises(RewardFunctionError, match=r"reward 'builtins:max' failed on all 2 completions of the first "
                                                  r"batch \(returned str '1', expected a number\)"):
        runner(["0", "x"], ["1", "1"])  # max("0", "1") is the string "1"


# --------------------------------------------------------------------------------------------- first batch


def test_a_reward_raising_on_every_completion_of_the_first_batch_stops_in_one_line() -> None:
    runner = RewardRunner(["format", always_raises], timeout_s=None)
    with pytest.raises(RewardFunctionError) as info:
        runner(["a", "b", "c"], ["1", "1", "1"])
    message = str(info.value)
    assert "\n" not in message
    assert f"reward '{HERE}:always_raises' failed on all 3 completions of the first batch" in message
    assert "RuntimeError('no score today')" in message


def test_a_reward_returning_text_stops_at_the_first_batch() -> None:
    runner = RewardRunner([returns_text])  # in the runner's threads, as in training
    with pytest.raises(RewardFunctionError, match=rf"reward '{HERE}:returns_text' failed on all 2 completions .*"
                                                  r"returned str '1.0', expected a number"):
        runner(["a", "b"], ["1", "1"])


def test_later_failures_are_counted_and_warned_about_once(caplog: pytest.LogCaptureFixture) -> None:
    runner = RewardRunner([raises_on_bad, "format"])
    with caplog.at_level(logging.WARNING, logger="lit_grpo.data.rewards"):
        first = runner(["good", "bad"], ["1", "1"])  # fails on some of the first batch: a warning, no stop
        later = runner(["bad", "bad"], ["1", "1"])  # all of a later batch: counted, no stop, no second warning
    assert (first.errors, later.errors) == (1, 2)
    assert first.rewards == [1.0, 0.0] and later.rewards == [0.0, 0.0]
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warnings) == 1
    assert f"reward '{HERE}:raises_on_bad' failed: ValueError('bad completion')" in warnings[0]
    assert "rollout/reward_errors" in warnings[0]


def test_timeouts_alone_do_not_stop_the_first_batch(caplog: pytest.LogCaptureFixture) -> None:
    runner = RewardRunner([blocks], timeout_s=0.05)
    try:
        with caplog.at_level(logging.WARNING, logger="lit_grpo.data.rewards"):
            result = runner(["a", "b"], ["1", "1"])
    finally:
        RELEASE.set()  # let the abandoned calls end
    assert (result.errors, result.timeouts) == (0, 2)
    assert any("timed out" in r.getMessage() for r in caplog.records)


def test_the_first_batch_rule_can_be_switched_off() -> None:
    result = RewardRunner([always_raises], stop_if_first_call_fails=False)(["a"], ["1"])
    assert (result.rewards, result.errors) == ([0.0], 1)


# --------------------------------------------------------------------------------------------- processes


def test_a_runner_of_module_level_functions_pickles_for_a_spawned_process() -> None:
    runner = RewardRunner([first_char_digit, functools.partial(scaled, scale=2.0), "correctness"])
    copy = pickle.loads(pickle.dumps(runner))
    texts, answers = ["1 #### 1", "x"], ["1", "1"]
    assert copy(texts, answers) == RewardRunner([first_char_digit, functools.partial(scaled, scale=2.0),
                                                "correctness"])(texts, answers)


def test_a_reward_that_cannot_be_pickled_is_named() -> None:
    def nested(completion: str, answer: str, **kwargs: object) -> float:
        return 1.0

    runner = RewardRunner([first_char_digit, nested])
    with pytest.raises(TypeError) as info:
        pickle.dumps(runner)
    message = str(info.value)
    assert "\n" not in message
    assert f"reward '{HERE}:test_a_reward_that_cannot_be_pickled_is_named.<locals>.nested' cannot be pickled" in message
    assert "strategy 'ddp'" in message
    clone = copy.deepcopy(runner)  # a copy in this process needs no pickling: the functions are shared
    assert [fn for _, fn, _ in clone.functions] == [first_char_digit, nested]
    assert clone(["1"], ["1"]).rewards == [2.0]
