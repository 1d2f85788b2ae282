"""The ``math_verify`` reward on LaTeX answers of MATH, AIME and R1-style completions: a table of cases written by
hand, each expected value checked twice, against the reward and against math-verify's own judgement of the gold and
the extracted box (where the extraction rules, thinking and truncation, decide a case, there is no box to judge)."""

import sys
import threading

import pytest
from math_verify import parse, verify

from lit_grpo.data import latex_answers
from lit_grpo.data.latex_answers import boxed_answer, gold_problem
from lit_grpo.data.rewards import RewardRunner, correctness_reward, math_verify_reward, resolve_reward

R1 = "Okay, so I need to find the value.\n\nWait, let me check: \\boxed{5} is wrong.\n</think>\n\n"

# name: (completion, gold, expected score, the box the reward must judge: None where extraction decides alone)
CASES = {
    # fractions, roots, pi
    "frac_sqrt_braces": ("So the cosine is \\boxed{\\frac{\\sqrt3}{2}}.", "\\frac{\\sqrt{3}}{2}", 1.0,
                         "\\frac{\\sqrt3}{2}"),
    "frac_sqrt_wrong": ("\\boxed{\\frac{\\sqrt{3}}{3}}", "\\frac{\\sqrt{3}}{2}", 0.0, "\\frac{\\sqrt{3}}{3}"),
    "coefficient_root": ("The distance is $\\boxed{3\\sqrt{13}}$.", "3\\sqrt{13}", 1.0, "3\\sqrt{13}"),
    "coefficient_alone": ("\\boxed{3}", "3\\sqrt{13}", 0.0, "3"),
    "root_simplified": ("\\boxed{\\sqrt{8}}", "2\\sqrt{2}", 1.0, "\\sqrt{8}"),
    "two_is_not_root_two": ("\\boxed{2}", "\\sqrt{2}", 0.0, "2"),
    "root_two_rounded": ("\\boxed{1.414}", "\\sqrt{2}", 0.0, "1.414"),
    "four_is_not_four_pi": ("\\boxed{4}", "4\\pi", 0.0, "4"),
    "four_pi": ("\\boxed{4\\pi}", "4\\pi", 1.0, "4\\pi"),
    "pi": ("\\boxed{\\pi}", "\\pi", 1.0, "\\pi"),
    "dfrac": ("\\boxed{\\dfrac{1}{2}}", "\\frac{1}{2}", 1.0, "\\dfrac{1}{2}"),
    "frac_no_braces": ("\\boxed{\\frac94}", "\\frac{9}{4}", 1.0, "\\frac94"),
    "decimal_of_fraction": ("\\boxed{3.5}", "\\dfrac{7}{2}", 1.0, "3.5"),
    "negative_slash": ("\\boxed{-1/3}", "-\\frac{1}{3}", 1.0, "-1/3"),
    "polynomial_reordered": ("\\boxed{1+x^2}", "x^2+1", 1.0, "1+x^2"),
    "exponential": ("\\boxed{e^2}", "e^{2}", 1.0, "e^2"),
    # text choices
    "choice_text": ("The answer is \\boxed{\\text{(C)}}", "\\text{(C)}", 1.0, "\\text{(C)}"),
    "choice_letter": ("\\boxed{C}", "\\text{(C)}", 1.0, "C"),
    "choice_wrong": ("\\boxed{\\text{(B)}}", "\\text{(C)}", 0.0, "\\text{(B)}"),
    "text_word_wrong": ("\\boxed{\\text{Tuesday}}", "\\text{Monday}", 0.0, "\\text{Tuesday}"),
    # intervals, sets, tuples, matrices
    "interval": ("\\boxed{[2, 5)}", "[2,5)", 1.0, "[2, 5)"),
    "interval_open_end_wrong": ("\\boxed{(2,5)}", "[2,5)", 0.0, "(2,5)"),
    "interval_infinite": ("\\boxed{(-\\infty,3]}", "(-\\infty, 3]", 1.0, "(-\\infty,3]"),
    "set_reordered": ("\\boxed{\\{2, 1\\}}", "\\{1,2\\}", 1.0, "\\{2, 1\\}"),
    "list_reordered": ("\\boxed{3, 2}", "2, 3", 1.0, "3, 2"),
    "tuple": ("\\boxed{(1, 2)}", "(1,2)", 1.0, "(1, 2)"),
    "tuple_reversed": ("\\boxed{(2,1)}", "(1,2)", 0.0, "(2,1)"),
    "matrix": ("\\boxed{\\begin{pmatrix}1\\\\2\\end{pmatrix}}", "\\begin{pmatrix}1\\\\2\\end{pmatrix}", 1.0,
               "\\begin{pmatrix}1\\\\2\\end{pmatrix}"),
    # percent, thousands separators, units, integers
    "percent": ("\\boxed{10\\%}", "10\\%", 1.0, "10\\%"),
    "percent_as_decimal": ("\\boxed{0.1}", "10\\%", 1.0, "0.1"),
    "thousands_gold": ("\\boxed{1000}", "1,000", 1.0, "1000"),
    "thousands_latex": ("\\boxed{1{,}000}", "1000", 1.0, "1{,}000"),
    "trailing_zero": ("\\boxed{1000.0}", "1000", 1.0, "1000.0"),
    "dollars": ("\\boxed{\\$18}", "18", 1.0, "\\$18"),
    "units": ("\\boxed{12\\text{ cm}}", "12", 1.0, "12\\text{ cm}"),
    "assignment": ("\\boxed{x=5}", "5", 1.0, "x=5"),
    "aime_integer": ("Thus $m+n = \\boxed{204}$.", "204", 1.0, "204"),
    "aime_wrong": ("\\boxed{240}", "204", 0.0, "240"),
    # which box: the last one, after the thinking
    "last_box_counts": ("First \\boxed{3}, but recounting gives \\boxed{5}.", "5", 1.0, "5"),
    "r1_answer_after_think": (R1 + "The answer is $\\boxed{7}$.", "7", 1.0, "7"),
    "think_box_then_other": (R1 + "The answer is $\\boxed{7}$.", "5", 0.0, "7"),
    "closed_think_without_open": ("so \\boxed{3}</think>The answer is \\boxed{4}.", "4", 1.0, "4"),
    # decided by the extraction rules alone
    "unfinished_think": ("<think>\nLet me see, \\boxed{5} maybe", "5", 0.0, None),
    "think_reopened": ("<think>a</think> draft <think> so \\boxed{5}", "5", 0.0, None),
    "think_open_answer_inside_only": ("<think>\\boxed{5}</think>", "5", 0.0, None),
    "truncated_box": ("Therefore the answer is \\boxed{\\frac{1}{", "\\frac{1}{2}", 0.0, None),
    "truncated_after_draft": ("\\boxed{\\frac12} hmm, no: \\boxed{\\frac{1}{", "\\frac{1}{2}", 0.0, None),
    "no_box": ("The answer is 5.", "5", 0.0, None),
    "empty_box": ("\\boxed{}", "5", 0.0, None),
}


def math_verify_judgement(gold: str, box: str) -> float:
    """math-verify's own judgement of a gold and a box, both read as LaTeX (``$...$``), as its docs call it."""
    return 1.0 if verify(parse(f"${gold}$"), parse(f"${box}$")) else 0.0


@pytest.mark.parametrize("name", list(CASES))
def test_the_reward_scores_each_case_as_expected(name):
    completion, gold, expected, _ = CASES[name]
    assert math_verify_reward(completion, gold) == expected


@pytest.mark.parametrize("name", [name for name, case in CASES.items() if case[3] is not None])
def test_each_expected_value_is_math_verifys_own_judgement(name):
    completion, gold, expected, box = CASES[name]
    assert boxed_answer(completion) == box  # the box the reward judges is the one written here
    assert math_verify_judgement(gold, box) == expected


def test_the_table_is_large_and_has_both_outcomes():
    assert len(CASES) >= 30
    scores = [case[2] for case in CASES.values()]
    assert scores.count(1.0) >= 10 and scores.count(0.0) >= 10


@pytest.mark.parametrize("name", [name for name, case in CASES.items() if case[3] is None])
def test_where_extraction_decides_there_is_no_box(name):
    assert boxed_answer(CASES[name][0]) in (None, "")


def test_the_numeric_correctness_reward_is_as_it_was():
    """``correctness`` (GSM8K's) still reads the first number of the box: the cases ``math_verify`` exists for."""
    assert correctness_reward("\\boxed{2}", "\\sqrt{2}") == 1.0
    assert correctness_reward("\\boxed{4}", "4\\pi") == 1.0
    assert math_verify_reward("\\boxed{2}", "\\sqrt{2}") == 0.0


def test_a_gsm8k_solution_is_judged_by_its_gold_after_the_hashes():
    assert math_verify_reward("\\boxed{72}", "48 + 24 = 72\n#### 72") == 1.0
    assert math_verify_reward("\\boxed{\\pi}", "so #### \\pi") == 1.0
    assert math_verify_reward("\\boxed{71}", "48 + 24 = 72\n#### 72") == 0.0


def test_it_is_the_built_in_math_verify():
    import lit_grpo.data

    assert resolve_reward("math_verify") is math_verify_reward
    assert lit_grpo.data.math_verify_reward is math_verify_reward


@pytest.mark.parametrize("gold, problem", [("\\frac{", "cannot parse"), ("???", "cannot parse"), ("", "empty"),
                                           ("#### ", "empty")])
def test_golds_math_verify_cannot_parse_are_named(gold, problem):
    assert problem in gold_problem(gold)


@pytest.mark.parametrize("gold", ["\\pi", "204", "1,000", "\\text{(C)}", "[2,5)", "#### \\frac{1}{2}"])
def test_golds_it_parses_pass(gold):
    assert gold_problem(gold) is None


def test_the_runner_scores_it_on_its_reward_thread():
    """math-verify's own timeouts use ``signal.alarm``, which raises off the main thread: they are off, and the
    runner's per-call timeout bounds the call instead."""
    runner = RewardRunner(["math_verify"], timeout_s=30.0)
    result = runner(["\\boxed{\\frac{\\sqrt3}{2}}", "\\boxed{2}"], ["\\frac{\\sqrt{3}}{2}", "\\sqrt{2}"])
    assert result.rewards == [1.0, 0.0] and result.errors == 0 and result.timeouts == 0


def test_a_slow_judgement_is_cut_by_the_runners_timeout(monkeypatch):
    release = threading.Event()

    def slow_verify(*args, **kwargs):
        release.wait(5.0)
        return True

    monkeypatch.setattr(latex_answers, "verify", slow_verify)
    runner = RewardRunner(["math_verify"], timeout_s=0.2)
    try:
        result = runner(["\\boxed{1}"], ["1"])
    finally:
        release.set()
    assert result.rewards == [0.0] and result.timeouts == 1


def test_finding_the_box_is_linear_on_unbalanced_boxes():
    """Work counted, not timed: Python lines run in the module for a completion of unclosed boxes (a brace scan
    restarted at each box would be quadratic)."""
    def lines_run(text: str) -> int:
        count = 0

        def tracer(frame, event, arg):
            nonlocal count
            if frame.f_code.co_filename != latex_answers.__file__:
                return None
            count += event == "line"
            return tracer

        sys.settrace(tracer)
        try:
            assert boxed_answer(text) is None
        finally:
            sys.settrace(None)
        return count

    small, large = lines_run("\\boxed{" * 1_000), lines_run("\\boxed{" * 8_000)
    assert small > 1_000
    assert large <= 8 * small + 100
