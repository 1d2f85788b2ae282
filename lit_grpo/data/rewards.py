"""Rule-based rewards for math answers, and a runner that keeps a bad reward function from stopping training.

Everything here is plain Python: rewards are scored on decoded text, on the CPU, outside the Lightning loop.

The reward contract: ``fn(completion: str, answer: str, **kwargs) -> float``. The runner calls ``fn(completion,
answer)`` (no keyword arguments yet; accept ``**kwargs`` so that later ones do not break a function) and needs a real
number back (``int``, ``float``, a NumPy scalar or a 0-d tensor; ``bool`` counts as 0 / 1; a string does not, even
``"1"``). A reward is named by a spec string (a built-in name or an import path: configs and the CLI) or, in the
Python API, given as the callable itself; :func:`resolve_reward` checks either against the contract before training.
A function may also carry ``fn.check_answer(answer: str) -> str | None``, what is wrong with a gold it cannot judge
(``None``: nothing): the data module asks it of every row before training (``math_verify`` does).

Answer extraction (:func:`extract_final_answer`) decides what a completion's final answer *is*; the
comparison (:func:`correctness_reward`) decides whether it equals the gold answer. Both are kept lenient
about presentation (``$1,000`` vs ``1000``, ``18.0`` vs ``18``) and strict about value, so the policy is
rewarded for the right number, and :func:`format_reward` separately rewards the GSM8K ``#### <number>`` form.
LaTeX golds (MATH, AIME: ``\\frac{\\sqrt{3}}{2}``, ``\\text{(C)}``) are the ``math_verify`` reward's
(:func:`math_verify_reward`, from :mod:`lit_grpo.data.latex_answers`).
"""

from __future__ import annotations

import copy
import functools
import inspect
import logging
import math
import pickle
import re
import reprlib
import threading
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from fractions import Fraction

from math_verify import parse, verify

from lit_grpo.core.import_paths import resolve_callable
from lit_grpo.data.latex_answers import last_closed_boxed
from lit_grpo.data.latex_answers import math_verify_reward as math_verify_reward  # the built-in of LaTeX golds

logger = logging.getLogger(__name__)

RewardFn = Callable[..., float]
#: a reward as the runner takes it: a spec string (built-in name or import path) or the function itself
RewardSpec = str | RewardFn
#: what the runner's calls look like, in the messages that refuse a reward
REWARD_CONTRACT = "fn(completion: str, answer: str, **kwargs) -> float"

# A number as written in prose or LaTeX: optional minus (not when glued to a preceding word or number, so
# "3-4" is two numbers), an integer with or without comma thousands separators (groups of exactly three
# digits, so "3, 4" and "3,4" stay two numbers), an optional decimal part, or a bare ".5".
_NUMBER = r"(?:(?<![\w.])-)?(?:(?:\d{1,3}(?:,\d{3})+(?!\d)|\d+)(?:\.\d+)?|(?<!\d)\.\d+)"
# A final answer token: a number, or a simple fraction "a/b" (what `\frac{a}{b}` is rewritten to).
_ANSWER_TOKEN = re.compile(rf"({_NUMBER})(?:\s*/\s*({_NUMBER}))?")
_FRAC = re.compile(rf"\\[dt]?frac\s*\{{\s*({_NUMBER})\s*\}}\s*\{{\s*({_NUMBER})\s*\}}")
# LaTeX spellings of a thousands separator inside a number: 1{,}000, 1\,000, 1\!000.
_LATEX_THOUSANDS = re.compile(r"(?<=\d)(?:\{,\}|\\[,!]\s*)(?=\d{3}(?!\d))")
_FORMAT_LINE = re.compile(r"(?:\A|\n)[ \t]*####[ \t]*-?(?:\d{1,3}(?:,\d{3})+|\d+)(?:\.\d+)?\Z")

BUILTIN_REWARDS: dict[str, str] = {
    "correctness": "lit_grpo.data.rewards:correctness_reward",
    "format": "lit_grpo.data.rewards:format_reward",
    "math_verify": "lit_grpo.data.rewards:math_verify_reward",
}


# ----------------------------------------------------------------------------------------------------------
# Answer extraction
# ----------------------------------------------------------------------------------------------------------


def _normalize_number(token: str) -> str:
    """``-1,234.50`` -> ``-1234.50``: separators go, sign and decimals (as written) stay; ``.5`` -> ``0.5``."""
    token = token.replace(",", "")
    if token.startswith("-."):
        return "-0" + token[1:]
    if token.startswith("."):
        return "0" + token
    return token


def _first_answer_token(text: str) -> str | None:
    """The first number (or ``a/b`` fraction) in ``text``, normalised."""
    match = _ANSWER_TOKEN.search(text)
    return _token_text(match) if match else None


def _last_answer_token(text: str) -> str | None:
    """The last number (or ``a/b`` fraction) in ``text``, normalised."""
    matches = list(_ANSWER_TOKEN.finditer(text))
    return _token_text(matches[-1]) if matches else None


def _token_text(match: re.Match[str]) -> str:
    numerator, denominator = match.group(1), match.group(2)
    if denominator is None:
        return _normalize_number(numerator)
    return f"{_normalize_number(numerator)}/{_normalize_number(denominator)}"


def _latex_to_plain(text: str) -> str:
    """Rewrites the LaTeX forms of numbers a model writes in an answer into plain text."""
    text = _LATEX_THOUSANDS.sub(",", text)
    return _FRAC.sub(r"\1/\2", text)


def extract_final_answer(text: str) -> str | None:
    """The final numeric answer of a solution, normalised, or ``None`` when it holds no number.

    Looked for in this order, a later rule applying only when the earlier ones find no number:

    1. the first number after the last ``####`` (the GSM8K convention);
    2. the first number in the last ``\\boxed{...}`` with balanced braces (the LaTeX convention);
       ``\\frac{a}{b}`` (also ``\\dfrac``/``\\tfrac``) of two numbers becomes the fraction ``"a/b"``;
    3. the last number anywhere in the text ("... so the answer is 7." -> ``"7"``).

    Normalisation keeps the value and drops presentation: comma thousands separators are removed
    (``1,234,567`` -> ``1234567``; ``3, 4`` stays two numbers), as are LaTeX ones (``1{,}000``, ``1\\,000``);
    currency and percent signs are dropped (``$18`` -> ``18``, ``25%`` -> ``25``, not ``0.25``, because GSM8K
    golds for percentage questions are the bare number); a sentence-ending period is not a decimal point;
    the minus sign and the decimals are kept as written (``-3``, ``18.0``): equality of values is the
    comparison's job, not this function's.
    """
    text = text.replace("\u2212", "-")  # Unicode minus sign
    if "####" in text:
        found = _first_answer_token(_latex_to_plain(text.rsplit("####", 1)[1]))
        if found is not None:
            return found
    boxed = last_closed_boxed(text)
    if boxed is not None:
        found = _first_answer_token(_latex_to_plain(boxed))
        if found is not None:
            return found
    return _last_answer_token(_latex_to_plain(text))


# ----------------------------------------------------------------------------------------------------------
# Rewards
# ----------------------------------------------------------------------------------------------------------


def _as_fraction(value: str) -> Fraction | None:
    """Exact value of a normalised answer (``"1/2"``, ``"-3"``, ``"18.0"``), or ``None`` if it has none."""
    try:
        return Fraction(value)
    except (ValueError, ZeroDivisionError):
        return None


def _numeric_equal(pred: str, gold: str) -> bool:
    """Fallback comparison: both are numbers whose values differ by at most 1e-9."""
    a, b = _as_fraction(pred), _as_fraction(gold)
    return a is not None and b is not None and abs(float(a) - float(b)) <= 1e-9


def answers_match(pred: str, gold: str) -> bool:
    """Whether two normalised answers are the same value.

    math-verify decides when it can parse both (so ``18.0 == 18`` and ``1/2 == 0.5``); its own
    ``signal.alarm`` timeouts are off, since they raise outside the main thread and :class:`RewardRunner`
    already bounds each call. When either side does not parse, the values are compared as numbers.
    """
    gold_parsed = parse(gold, parsing_timeout=None)
    pred_parsed = parse(pred, parsing_timeout=None)
    if gold_parsed and pred_parsed:
        return bool(verify(gold_parsed, pred_parsed, timeout_seconds=None))
    return _numeric_equal(pred, gold)


def correctness_reward(completion: str, answer: str, **kwargs: object) -> float:
    """1.0 when the completion's final answer equals the gold answer, else 0.0.

    ``answer`` may be a full GSM8K solution (its number after ``####`` is the gold) or the bare gold (``"1,000"``).
    A gold with no number is a data error, not a wrong completion, so it raises ``ValueError``.
    """
    gold = extract_final_answer(answer)
    if gold is None:
        raise ValueError(f"gold answer {answer!r} contains no number; expected a number or '... #### <number>'")
    pred = extract_final_answer(completion)
    if pred is None:
        return 0.0
    return 1.0 if answers_match(pred, gold) else 0.0


def format_reward(completion: str, answer: str, **kwargs: object) -> float:
    """1.0 when the completion's last non-blank line is ``#### <number>``, else 0.0.

    The number is an integer or decimal, optionally negative and with comma thousands separators; spaces and
    tabs may surround it. Units, currency signs or text after the number fail: the format is what lets an
    exact-match grader read the answer, so it is rewarded only when it is exact.
    """
    return 1.0 if _FORMAT_LINE.search(completion.rstrip()) else 0.0


# ----------------------------------------------------------------------------------------------------------
# Resolving reward specs
# ----------------------------------------------------------------------------------------------------------

_SPEC_HELP = (
    "expected 'package.module:function', 'package.module.function' or a built-in name "
    f"({', '.join(repr(name) for name in BUILTIN_REWARDS)}) naming a callable {REWARD_CONTRACT}"
)


def reward_name(spec: RewardSpec) -> str:
    """The name a reward goes by in logs, metrics and errors: its spec string, or for a callable
    ``module:qualname`` (a ``functools.partial`` or a callable object without a qualified name: its ``repr``)."""
    if isinstance(spec, str):
        return spec.strip()
    qualname = getattr(spec, "__qualname__", None)
    # a method of a built-in type (``str.upper``) names its module through its class
    module = getattr(spec, "__module__", None) or getattr(getattr(spec, "__objclass__", None), "__module__", None)
    if isinstance(module, str) and isinstance(qualname, str):
        return f"{module}:{qualname}"
    return repr(spec)


def check_reward_signature(name: str, fn: RewardFn) -> None:
    """Refuse a reward the runner cannot call as ``fn(completion, answer)``: one whose signature does not bind two
    positional arguments (``os.getcwd``: none; ``len``: one), or a coroutine function (its calls return a coroutine,
    not a number). A callable whose signature Python cannot read (some builtins, such as ``max``) passes here; its
    calls on the first batch decide (:class:`RewardRunner` stops a run whose first batch it scores on no
    completion)."""
    target = fn.func if isinstance(fn, functools.partial) else fn
    if inspect.iscoroutinefunction(target) or inspect.iscoroutinefunction(type(target).__call__):
        raise ValueError(f"reward {name!r} is a coroutine function (async def): its calls return a coroutine, not a "
                         f"number; expected a plain function {REWARD_CONTRACT}")
    try:
        signature = inspect.signature(fn)
    except (TypeError, ValueError):
        return  # nothing to read: the first batch's calls decide
    try:
        signature.bind("completion", "answer")
    except TypeError as e:
        raise ValueError(f"reward {name!r} has the signature {signature} and cannot be called as fn(completion, "
                         f"answer) ({e}); expected {REWARD_CONTRACT}") from None
    if list(signature.parameters)[:2] == ["prompts", "completions"]:  # binds, but would get one string each
        raise ValueError(f"reward {name!r} has the signature {signature} of a batched TRL reward_funcs function; "
                         f"the runner scores one completion per call: expected {REWARD_CONTRACT}")


def resolve_reward(spec: RewardSpec) -> RewardFn:
    """The reward function ``spec`` names (a built-in name or an import path) or is (a callable), checked to exist,
    be callable and accept the runner's call (:func:`check_reward_signature`), so that a typo or a function of the
    wrong shape fails at startup instead of training a whole run at reward 0."""
    if callable(spec) and not isinstance(spec, str):
        fn = spec
    elif not isinstance(spec, str) or not spec.strip():
        raise ValueError(f"reward {spec!r}: {_SPEC_HELP}, or the callable itself")
    else:
        spec = spec.strip()
        fn = resolve_callable(BUILTIN_REWARDS.get(spec, spec), "reward", _SPEC_HELP)
    check_reward_signature(reward_name(spec), fn)
    return fn


# ----------------------------------------------------------------------------------------------------------
# Running rewards
# ----------------------------------------------------------------------------------------------------------


@dataclass
class RewardResult:
    """Rewards of one batch of completions, with counts of the calls that failed.

    ``rewards[i]`` is the weighted sum over reward functions for completion ``i``; ``per_function[spec][i]``
    is one function's unweighted score (0.0 where it failed), for logging each reward separately.
    """

    rewards: list[float]
    errors: int = 0
    timeouts: int = 0
    per_function: dict[str, list[float]] = field(default_factory=dict)


class _Failure(Exception):
    """Why one reward call produced no score; ``timed_out`` tells a timeout from an error."""

    def __init__(self, message: str, timed_out: bool = False) -> None:
        super().__init__(message)
        self.timed_out = timed_out


def _call_in_thread(fn: RewardFn, completion: str, answer: str, timeout_s: float) -> object:
    """``fn(completion, answer)`` in a daemon thread, giving up after ``timeout_s`` seconds.

    A Python thread cannot be killed: one that times out keeps running in the background (using CPU and
    possibly touching shared state) until it returns, and is only abandoned. Being a daemon, it never keeps
    the process from exiting. A subprocess could be killed, but would cost far more per call than a
    reward function takes, and would need picklable functions.
    """
    outcome: dict[str, object] = {}

    def target() -> None:
        try:
            outcome["value"] = fn(completion, answer)
        except BaseException as e:  # reported to the caller, whatever it is
            outcome["error"] = e

    thread = threading.Thread(target=target, name="reward-call", daemon=True)
    thread.start()
    thread.join(timeout_s)
    if thread.is_alive():
        raise _Failure(f"still running after {timeout_s:g} s", timed_out=True)
    if "value" not in outcome:
        raise _Failure(repr(outcome.get("error", "exited without a result")))
    return outcome["value"]


def _as_score(value: object) -> float:
    """A reward function's return value as a finite float (a NaN would poison the group's advantages). Text is not
    a score, even text that reads as a number (``os.getcwd`` returns a path; ``"1"`` is a bug, not a reward)."""
    if isinstance(value, (str, bytes, bytearray)):
        raise _Failure(f"returned {type(value).__name__} {reprlib.repr(value)}, expected a number")
    try:
        score = float(value)  # type: ignore[arg-type]
    except (TypeError, ValueError, RuntimeError) as e:  # RuntimeError: a tensor of more than one element
        raise _Failure(f"returned {reprlib.repr(value)}, expected a number") from e
    if not math.isfinite(score):
        raise _Failure(f"returned {score}, expected a finite number")
    return score


def _name_of(spec: object) -> str:
    """:func:`reward_name` of a spec or callable; anything else (refused later) as its ``repr``."""
    return reward_name(spec) if isinstance(spec, str) or callable(spec) else repr(spec)


def _parse_specs(specs: Sequence[RewardSpec | tuple[RewardSpec, float]],
                 allow_empty: bool = False) -> list[tuple[RewardSpec, float]]:
    """``["correctness", (my_fn, 0.5)]`` -> ``[("correctness", 1.0), (my_fn, 0.5)]``, validated (an empty list only
    with ``allow_empty``: an environment's reward needs no function)."""
    if isinstance(specs, str) or callable(specs) or not (specs or (allow_empty and isinstance(specs, list))):
        raise ValueError(f"rewards {specs!r}: expected a non-empty list of specs, callables or (spec, weight) pairs")
    parsed = []
    for item in specs:
        if isinstance(item, str) or callable(item):
            item = (item, 1.0)
        if not isinstance(item, (tuple, list)) or len(item) != 2:
            raise ValueError(f"reward {item!r}: expected a spec string, a callable or a (spec, weight) pair")
        spec, weight = item
        if isinstance(weight, bool) or not isinstance(weight, (int, float)) or not math.isfinite(weight):
            raise ValueError(f"reward {_name_of(spec)!r}: weight {weight!r} is not a finite number")
        parsed.append((spec, float(weight)))
    names = [_name_of(spec) for spec, _ in parsed]
    duplicates = sorted({name for name in names if names.count(name) > 1})
    if duplicates:
        raise ValueError(f"rewards {duplicates} are listed more than once; list each once with its total weight")
    return parsed


class RewardFunctionError(RuntimeError):
    """A reward function scored none of the completions of the first batch: it is broken, not unlucky."""


class RewardRunner:
    """Scores completions with a weighted sum of reward functions, surviving functions that fail or hang.

    Specs are resolved and checked against the reward contract at construction, so a wrong name or signature fails
    before any model is loaded. At call time a function that raises, returns a non-number, or runs longer than
    ``timeout_s`` scores 0.0 for that completion and is counted in :class:`RewardResult` (the data module logs the
    running counts as ``rollout/reward_errors`` and ``rollout/reward_timeouts``); the first failure of each function
    is a warning naming it, and the other completions and functions are unaffected. One exception to that: with
    ``stop_if_first_call_fails``, a function that yields a score on none of the completions of the runner's first
    call (each raised or returned a non-number; timeouts alone do not count, a slow first call can be a cold cache)
    raises :class:`RewardFunctionError` naming it: a function that fails on every completion is broken, and a run
    that went on would train at reward 0. ``timeout_s=None`` calls functions directly in the caller's thread, with
    no time limit: faster, but a hanging function then hangs training.

    Processes: Lightning's default launch (``ddp``, or an external launcher) runs the user's script in every rank,
    so each rank builds its own runner and any callable works. A process-spawning launch (``ddp_spawn``) pickles the
    runner: its callables must then be picklable (functions defined at the top level of an importable module, or a
    ``functools.partial`` of one; not lambdas or nested functions), and one that is not fails the pickling in one
    line naming it.
    """

    def __init__(self, specs: Sequence[RewardSpec | tuple[RewardSpec, float]], timeout_s: float | None = 5.0,
                 stop_if_first_call_fails: bool = True, allow_empty: bool = False) -> None:
        if timeout_s is not None and not timeout_s > 0:
            raise ValueError(f"timeout_s={timeout_s!r}: expected a positive number of seconds or None")
        parsed = _parse_specs(specs, allow_empty)
        self.timeout_s = timeout_s
        self.stop_if_first_call_fails = stop_if_first_call_fails
        self.functions = [(reward_name(spec), resolve_reward(spec), weight) for spec, weight in parsed]
        #: ``(name, weight)`` per function, in order: the names are the keys of ``RewardResult.per_function``
        self.specs = [(name, weight) for name, _, weight in self.functions]
        self._warned: set[str] = set()
        self._calls = 0

    def __getstate__(self) -> dict[str, object]:
        """Pickled for a spawned process (``ddp_spawn``): a reward that cannot be pickled is named in one line,
        instead of a pickling traceback about a local object."""
        for name, fn, _ in self.functions:
            try:
                pickle.dumps(fn)
            except Exception as e:
                raise TypeError(f"reward {name!r} cannot be pickled for a process that Lightning spawns ({e}); define "
                                "it at the top level of an importable module, or use a launch that runs the script "
                                "in every process (strategy 'ddp')") from None
        return dict(self.__dict__)

    def __deepcopy__(self, memo: dict[int, object]) -> RewardRunner:
        """A copy in this process: functions are shared, as ``copy.deepcopy`` shares them, whether or not they could
        be pickled (the check of :meth:`__getstate__` is for other processes only)."""
        clone = object.__new__(type(self))
        memo[id(self)] = clone
        clone.__dict__.update(copy.deepcopy(self.__dict__, memo))
        return clone

    def _score(self, spec: str, fn: RewardFn, completion: str, answer: str) -> float:
        """One function on one completion; raises :class:`_Failure` when it yields no score."""
        if self.timeout_s is None:
            try:
                value = fn(completion, answer)
            except Exception as e:
                raise _Failure(repr(e)) from e
        else:
            value = _call_in_thread(fn, completion, answer, self.timeout_s)
        return _as_score(value)

    def _report(self, spec: str, failure: _Failure) -> None:
        """Warns once per function, so a function that fails on every completion does not flood the log."""
        kind = "timed out" if failure.timed_out else "failed"
        if spec in self._warned:
            logger.debug("reward %r %s: %s", spec, kind, failure)
            return
        self._warned.add(spec)
        metric = "rollout/reward_timeouts" if failure.timed_out else "rollout/reward_errors"
        logger.warning("reward %r %s: %s (scored 0.0 and counted in %s; further failures of it are logged at DEBUG)",
                       spec, kind, failure, metric)

    def __call__(self, completions: Sequence[str], answers: Sequence[str]) -> RewardResult:
        if len(completions) != len(answers):
            raise ValueError(f"{len(completions)} completions but {len(answers)} answers; expected one answer each")
        first_call = self._calls == 0 and len(completions) > 0
        self._calls += bool(completions)
        result = RewardResult(rewards=[0.0] * len(completions), per_function={s: [] for s, _, _ in self.functions})
        # per function, the errors (not timeouts) of a first call, and the functions that scored some completion
        errors: dict[str, list[_Failure]] = {s: [] for s, _, _ in self.functions}
        scored: set[str] = set()
        for i, (completion, answer) in enumerate(zip(completions, answers)):
            for spec, fn, weight in self.functions:
                try:
                    score = self._score(spec, fn, completion, answer)
                    scored.add(spec)
                except _Failure as failure:
                    score = 0.0
                    result.timeouts += failure.timed_out
                    result.errors += not failure.timed_out
                    if failure.timed_out or not (first_call and self.stop_if_first_call_fails):
                        self._report(spec, failure)
                    else:  # an error of the first call: reported below, or it stops the run
                        errors[spec].append(failure)
                result.per_function[spec].append(score)
                result.rewards[i] += weight * score
        if first_call and self.stop_if_first_call_fails:
            self._check_first_call(len(completions), errors, scored)
        return result

    def _check_first_call(self, n: int, errors: dict[str, list[_Failure]], scored: set[str]) -> None:
        """Stop when a function scored no completion of the first call and at least one of its calls was an error;
        otherwise warn about the functions that failed on some (once each, like any later failure)."""
        for spec, failures in errors.items():
            if failures and spec not in scored:
                raise RewardFunctionError(
                    f"reward {spec!r} failed on all {n} completions of the first batch ({failures[0]}), so it would "
                    f"train the whole run at reward 0; expected a function {REWARD_CONTRACT} that returns a number")
            if failures:
                self._report(spec, failures[0])
