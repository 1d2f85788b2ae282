"""Answer extraction, the built-in rewards, reward resolution, and the runner's error/timeout accounting."""

from __future__ import annotations

import importlib
import sys
import textwrap

import pytest

import lit_grpo.data.latex_answers as latex_answers
import lit_grpo.data.rewards as rewards_module
from lit_grpo.data import RewardRunner, correctness_reward, extract_final_answer, format_reward, resolve_reward

USER_MODULE = "lit_grpo_test_user_rewards"


@pytest.fixture(scope="module")
def user_rewards(tmp_path_factory: pytest.TempPathFactory):
    """An importable module of user reward functions, including misbehaving ones."""
    root = tmp_path_factory.mktemp("user_rewards")
    (root / f"{USER_MODULE}.py").write_text(
        textwrap.dedent(
            """
            import threading

            RELEASE = threading.Event()
            SLOW_FINISHED = threading.Event()
            NOT_CALLABLE = 3


            def length(completion, answer, **kwargs):
                return len(completion)


            def boom(completion, answer, **kwargs):
                if completion == "bad":
                    raise RuntimeError("boom")
                return 1.0


            def slow(completion, answer, **kwargs):
                if completion == "slow":
                    RELEASE.wait(60)
                    SLOW_FINISHED.set()
                return 1.0


            def not_a_number(completion, answer, **kwargs):
                return float("nan") if completion == "nan" else "high"


            class Scorer:
                @staticmethod
                def score(completion, answer, **kwargs):
                    return 0.25
            """
        )
    )
    sys.path.insert(0, str(root))
    module = importlib.import_module(USER_MODULE)
    yield module
    module.RELEASE.set()
    sys.path.remove(str(root))
    sys.modules.pop(USER_MODULE, None)


# ----------------------------------------------------------------------------------------- extract_final_answer


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("so she pays 1000 + 234\n#### 1,234", "1234"),
        ("#### 1,234,567", "1234567"),
        ("We get \\boxed{42}.", "42"),
        ("\\boxed{\\frac{1}{2}}", "1/2"),  # a LaTeX fraction of numbers becomes a plain fraction
        ("\\boxed{\\dfrac{-3}{4}}", "-3/4"),
        ("the answer is 7.", "7"),  # a sentence-ending period is not a decimal point
        ("The temperature fell to -12 degrees", "-12"),
        ("It costs $3.75 each", "3.75"),
        ("about .5 of it", "0.5"),
        ("25% of them", "25"),  # percent sign dropped, the number kept as written
        ("no number here", None),
        ("", None),
        ("3, 4", "4"),  # ", " followed by one digit is not a thousands separator
        ("from 3-4", "4"),  # a hyphen between numbers is not a minus sign
        ("value is \u22125", "-5"),  # Unicode minus
        ("\\boxed{1{,}000} dollars", "1000"),
    ],
)
def test_extract_final_answer(text: str, expected: str | None) -> None:
    assert extract_final_answer(text) == expected


def test_extract_priority_hashes_then_boxed_then_last_number() -> None:
    assert extract_final_answer("\\boxed{5} ... 9\n#### 3 apples, not 4") == "3"  # first number after ####
    assert extract_final_answer("a #### 1 then #### 2") == "2"  # the last ####
    assert extract_final_answer("\\boxed{5} and \\boxed{6}, 9 in total") == "6"  # last boxed beats last number
    assert extract_final_answer("\\boxed{x = 5} so 9") == "5"  # first number in the box
    assert extract_final_answer("#### none\n\\boxed{8}") == "8"  # #### with no number falls through
    assert extract_final_answer("\\boxed{3} then \\boxed{4") == "3"  # a truncated box is skipped
    assert extract_final_answer("\\boxed{a{b}c 5}") == "5"  # nested braces balance


def test_extract_is_linear_on_unbalanced_boxes() -> None:
    # work is counted, not timed: Python lines executed in the rewards module and the brace scan's
    # (lit_grpo.data.latex_answers; a scan restarted at each box is quadratic there); regex scans run in C and are
    # not counted, but none here can backtrack
    files = {rewards_module.__file__, latex_answers.__file__}

    def lines_run(text: str) -> int:
        count = 0

        def tracer(frame, event, arg):  # noqa: ANN001, ANN202
            nonlocal count
            if frame.f_code.co_filename not in files:
                return None
            if event == "line":
                count += 1
            return tracer

        sys.settrace(tracer)
        try:
            assert extract_final_answer(text) is None
        finally:
            sys.settrace(None)
        return count

    small, large = lines_run("\\boxed{" * 1_000), lines_run("\\boxed{" * 8_000)
    assert small > 1_000  # the scan really is counted
    assert large <= 8 * small + 100  # quadratic work would be ~64 times more


# ------------------------------------------------------------------------------------------------- rewards


@pytest.mark.parametrize(
    ("completion", "answer", "expected"),
    [
        ("... so 72 clips.\n#### 72", "Natalia sold 48+24 = <<48+24=72>>72 clips.\n#### 72", 1.0),
        ("#### 71", "#### 72", 0.0),
        ("She earns $1,000 in total.", "1000", 1.0),  # separators on the completion side
        ("#### 1000", "x\n#### 1,000", 1.0),  # separators on the gold side
        ("The answer is 18.0", "18", 1.0),
        ("The answer is 18.5", "18", 0.0),
        ("\\boxed{\\frac{1}{2}}", "0.5", 1.0),
        ("#### -4", "#### -4", 1.0),
        ("#### 4", "#### -4", 0.0),
        ("I do not know.", "#### 5", 0.0),
        ("#### 100000001", "100000000", 0.0),
    ],
)
def test_correctness_reward(completion: str, answer: str, expected: float) -> None:
    assert correctness_reward(completion, answer) == expected


def test_correctness_falls_back_to_numbers_when_math_verify_cannot_parse(monkeypatch: pytest.MonkeyPatch) -> None:
    from lit_grpo.data import rewards

    monkeypatch.setattr(rewards, "parse", lambda *args, **kwargs: [])
    assert correctness_reward("#### 18.0", "18") == 1.0
    assert correctness_reward("#### 1/2", "0.5") == 1.0
    assert correctness_reward("#### 18.000001", "18") == 0.0
    assert correctness_reward("#### 5/0", "5") == 0.0


def test_correctness_works_outside_the_main_thread() -> None:
    import threading

    results = []
    thread = threading.Thread(target=lambda: results.append(correctness_reward("#### 18.0", "18")))
    thread.start()
    thread.join(30)
    assert results == [1.0]


def test_correctness_rejects_a_gold_without_a_number() -> None:
    with pytest.raises(ValueError, match="contains no number"):
        correctness_reward("#### 3", "three")


@pytest.mark.parametrize(
    ("completion", "expected"),
    [
        ("Reasoning.\n#### 72", 1.0),
        ("Reasoning.\n   ####   1,234  \n\n", 1.0),
        ("#### -3.5", 1.0),
        ("The answer is 72", 0.0),
        ("#### 72\nHope that helps!", 0.0),
        ("#### 72 dollars", 0.0),
        ("#### $72", 0.0),
        ("so 3 #### 72", 0.0),  # #### must start the line
        ("####", 0.0),
    ],
)
def test_format_reward(completion: str, expected: float) -> None:
    assert format_reward(completion, "#### 72") == expected


# --------------------------------------------------------------------------------------------- resolve_reward


def test_resolve_builtins_and_paths(user_rewards) -> None:
    assert resolve_reward("correctness") is correctness_reward
    assert resolve_reward("format") is format_reward
    assert resolve_reward("lit_grpo.data.rewards:format_reward") is format_reward
    assert resolve_reward("lit_grpo.data.rewards.correctness_reward") is correctness_reward
    assert resolve_reward(f"{USER_MODULE}:length") is user_rewards.length
    assert resolve_reward(f"{USER_MODULE}:Scorer.score")("x", "y") == 0.25


@pytest.mark.parametrize(
    ("spec", "message"),
    [
        ("no_such_package_xyz.rewards:fn", "cannot import module 'no_such_package_xyz.rewards'"),
        (f"{USER_MODULE}:missing", "has no attribute 'missing'"),
        (f"{USER_MODULE}.missing", "has no attribute 'missing'"),
        (f"{USER_MODULE}:NOT_CALLABLE", "is a int, not callable"),
        ("correctnes", "expected 'package.module:function'"),
        ("", "expected 'package.module:function'"),
    ],
)
def test_resolve_errors_name_the_spec(user_rewards, spec: str, message: str) -> None:
    with pytest.raises(ValueError, match="package.module:function") as info:
        resolve_reward(spec)
    assert repr(spec) in str(info.value)
    assert message in str(info.value)


# ---------------------------------------------------------------------------------------------- RewardRunner


def test_runner_resolves_specs_at_construction() -> None:
    with pytest.raises(ValueError, match="no_such_module_abc"):
        RewardRunner(["correctness", "no_such_module_abc:fn"])
    with pytest.raises(ValueError, match="non-empty list"):
        RewardRunner([])
    with pytest.raises(ValueError, match="more than once"):
        RewardRunner(["format", ("format", 2.0)])
    with pytest.raises(ValueError, match="not a finite number"):
        RewardRunner([("format", float("inf"))])
    with pytest.raises(ValueError, match="timeout_s"):
        RewardRunner(["format"], timeout_s=0)


def test_runner_weights_and_per_function_scores() -> None:
    runner = RewardRunner([("correctness", 2.0), ("format", 0.5)])
    result = runner(["work\n#### 5", "the answer is 5", "#### 4", "nothing"], ["5", "#### 5", "5", "5"])
    assert result.rewards == [2.5, 2.0, 0.5, 0.0]
    assert result.per_function == {"correctness": [1.0, 1.0, 0.0, 0.0], "format": [1.0, 0.0, 1.0, 0.0]}
    assert (result.errors, result.timeouts) == (0, 0)


def test_runner_counts_an_exception_and_keeps_scoring(user_rewards) -> None:
    runner = RewardRunner([f"{USER_MODULE}:boom", (f"{USER_MODULE}:length", 0.5)])
    result = runner(["ok", "bad", "fine"], ["1", "1", "1"])
    assert result.per_function[f"{USER_MODULE}:boom"] == [1.0, 0.0, 1.0]
    assert result.rewards == [2.0, 1.5, 3.0]  # the failing function scores 0, the other still counts
    assert (result.errors, result.timeouts) == (1, 0)


def test_runner_counts_non_numeric_results_as_errors(user_rewards) -> None:
    # a function that scores no completion of the first call stops the run (test_reward_functions.py); counting
    # is what is tested here
    runner = RewardRunner([f"{USER_MODULE}:not_a_number"], stop_if_first_call_fails=False)
    result = runner(["nan", "x"], ["1", "1"])
    assert result.rewards == [0.0, 0.0]
    assert result.errors == 2


def test_runner_counts_a_timeout_and_does_not_hang(user_rewards) -> None:
    runner = RewardRunner([f"{USER_MODULE}:slow", "format"], timeout_s=0.2)
    result = runner(["#### 1", "slow", "#### 2"], ["1", "1", "2"])
    # no clock: the slow call blocks until RELEASE is set, so the runner returned without waiting for it
    assert not user_rewards.SLOW_FINISHED.is_set()
    user_rewards.RELEASE.set()  # let the abandoned call finish
    assert result.rewards == [2.0, 0.0, 2.0]
    assert (result.errors, result.timeouts) == (0, 1)


def test_runner_without_timeout_calls_inline(user_rewards) -> None:
    result = RewardRunner([f"{USER_MODULE}:boom"], timeout_s=None)(["bad", "ok"], ["1", "1"])
    assert result.rewards == [0.0, 1.0]
    assert result.errors == 1


def test_runner_rejects_mismatched_lengths() -> None:
    with pytest.raises(ValueError, match="2 completions but 1 answers"):
        RewardRunner(["format"])(["a", "b"], ["1"])
