"""Procedurally generated tasks from the reasoning-gym project, scored by reasoning-gym's own scorers.

``data.dataset: reasoning_gym:<task>`` names one of reasoning-gym's ~100 task generators (``basic_arithmetic``,
``chain_sum``, ``letter_counting``, ``spell_backward``, ...; the package's registry lists them). The questions, the
gold answers, the answer extraction (:func:`reasoning_gym.utils.extract_answer`: the text inside the last
``<answer>...</answer>`` pair) and the reward (the task's own ``score_answer(answer, entry)``, in [0, 1]) all come
from reasoning-gym (open-thought/reasoning-gym, Apache-2.0); this module only turns them into dataset rows and a
single-turn environment. Everything is generated locally: nothing is downloaded.

The spec is ``reasoning_gym:<task>`` with optional ``:key=value`` options: the split sizes and the seed
(:data:`OPTIONS`), and any field of the task's own configuration, its difficulty (:func:`task_options`), for example
``reasoning_gym:basic_arithmetic:size=500:seed=3:max_terms=3:max_digits=2``. The train rows are exactly
reasoning-gym's dataset for that configuration, seed and size; the test rows come from seeds derived from it
(:func:`split_seed`), and a test question that also appears among the train questions, or earlier in the test rows,
is dropped and replaced, so the two splits never share a question.

reasoning-gym is an optional extra: ``pip install -e ".[reasoning-gym]"`` in a checkout. It is imported only inside the
functions that need it.
"""

from __future__ import annotations

import dataclasses
import functools
import hashlib
import json
import warnings
from fractions import Fraction
from typing import Any

PREFIX = "reasoning_gym:"
#: how the model is told to write its answer: reasoning-gym's extractor reads the last <answer>...</answer> pair
ANSWER_FORMAT = "Give your final answer between <answer> and </answer> tags, with nothing else inside the tags."
#: the entry of reasoning-gym's ``reasoning_gym.utils.SYSTEM_PROMPTS`` a task is sampled with by default
SYSTEM_PROMPT_NAME = "default"
#: the spec's options and their defaults (``size``: train rows; ``test_size``: test rows; ``seed``: the train seed)
OPTIONS: dict[str, int] = {"size": 1000, "test_size": 200, "seed": 0}
SPLITS = ("train", "test")
INSTALL_HINT = 'pip install -e ".[reasoning-gym]" in a checkout, or pip install "reasoning-gym>=0.1.25,<0.2"'
#: how many extra seeds the test split may draw from to replace questions that are already in the train split
MAX_TEST_ROUNDS = 8

_TUPLE_TAG = "__tuple__"
_ITEMS_TAG = "__items__"
_FRACTION_TAG = "__fraction__"


class ReasoningGymMissing(ImportError, ValueError):
    """reasoning-gym is not installed. An ``ImportError`` for code that treats it as optional, and a ``ValueError``
    so that the CLI prints it as one line."""


def _import_reasoning_gym() -> Any:
    try:
        import reasoning_gym
    except ImportError as error:
        raise ReasoningGymMissing(f"data.dataset '{PREFIX}...' needs the reasoning-gym package ({error}); install "
                                  f"it with: {INSTALL_HINT}") from None
    return reasoning_gym


def system_prompt() -> str:
    """reasoning-gym's own default system prompt (``reasoning_gym.utils.SYSTEM_PROMPTS["default"]``, from
    open-thought/reasoning-gym, Apache-2.0): reason step by step, then give only the answer inside
    ``<answer>...</answer>``, the tags its extractor reads. A run of a task uses it when ``data.system_prompt`` is
    left at its default, GSM8K's, whose ``#### <answer>`` format the task does not score
    (:func:`lit_grpo.data.tasks.system_prompt_for`)."""
    _import_reasoning_gym()
    from reasoning_gym.utils import SYSTEM_PROMPTS

    return SYSTEM_PROMPTS[SYSTEM_PROMPT_NAME]


def task_names() -> list[str]:
    """The task names reasoning-gym registers (its ``reasoning_gym.factory.DATASETS``), sorted."""
    _import_reasoning_gym()
    from reasoning_gym.factory import DATASETS

    return sorted(DATASETS)


def parse_spec(spec: str) -> tuple[str, dict[str, Any]]:
    """``reasoning_gym:<task>[:key=value]...`` as ``(task, options)``: every option of :data:`OPTIONS` (integers,
    defaults filled in), then any field of the task's own configuration that the spec sets (its difficulty, e.g.
    ``max_digits=2``), the value read as JSON (``2``, ``0.5``, ``true``, ``["+", "-"]``) or else kept as text.

    Raises ``ValueError`` (one line) for a spec without the prefix, an unknown task, or an unknown, repeated or
    invalid option, and :class:`ReasoningGymMissing` when reasoning-gym is not installed.
    """
    if not isinstance(spec, str) or not spec.startswith(PREFIX):
        raise ValueError(f"dataset spec {spec!r} does not start with {PREFIX!r}; expected "
                         f"'{PREFIX}<task>[:size=N][:test_size=N][:seed=S][:<task option>=value]'")
    task, *parts = spec[len(PREFIX):].split(":")
    names = task_names()
    if task not in names:
        close = [name for name in names if task and (task in name or name in task)][:5]
        shown = ", ".join(close or names[:8])
        raise ValueError(f"unknown reasoning-gym task {task!r} in {spec!r}; expected one of reasoning-gym's "
                         f"{len(names)} tasks, for example {shown}")
    fields = task_options(task)
    options: dict[str, Any] = dict(OPTIONS)
    given: set[str] = set()
    for part in parts:
        key, sep, value = part.partition("=")
        if not sep or (key not in OPTIONS and key not in fields):
            raise ValueError(f"unknown option {part!r} in {spec!r}; expected key=value with key one of "
                             f"{', '.join([*OPTIONS, *fields])}")
        if key in given:
            raise ValueError(f"option {key!r} given twice in {spec!r}; expected each option once")
        given.add(key)
        options[key] = _count(key, value, spec) if key in OPTIONS else _option_value(value)
    return task, options


def task_options(task: str) -> list[str]:
    """The fields of ``task``'s reasoning-gym configuration that a spec may set (all but ``seed`` and ``size``,
    which :data:`OPTIONS` sets per split)."""
    _import_reasoning_gym()
    from reasoning_gym.factory import DATASETS

    config_class = DATASETS[task][1]
    return [field.name for field in dataclasses.fields(config_class) if field.name not in ("seed", "size")]


def _count(key: str, value: str, spec: str) -> int:
    smallest = 0 if key == "seed" else 1
    try:
        number = int(value)
    except ValueError:
        number = smallest - 1
    if number < smallest:
        raise ValueError(f"option {key}={value!r} in {spec!r}; expected an integer >= {smallest}")
    return number


def _option_value(text: str) -> Any:
    try:
        return json.loads(text)
    except ValueError:
        return text


def _config(options: dict[str, Any]) -> dict[str, Any]:
    """The task configuration fields among ``options`` (those not in :data:`OPTIONS`)."""
    return {key: value for key, value in options.items() if key not in OPTIONS}


def split_seed(seed: int, split: str, round_index: int = 0) -> int:
    """The generator seed of one split: ``seed`` itself for train (reasoning-gym's own dataset for that seed); for
    test, a 32-bit seed hashed from ``(seed, round_index)``, so that no spec's test split is another's train split
    by construction of adjacent seeds (``seed=3`` test is not ``seed=4`` train)."""
    if split == "train":
        return seed
    digest = hashlib.sha256(f"lit_grpo reasoning_gym test {seed} {round_index}".encode()).hexdigest()
    return int(digest[:8], 16)


def encode_entry(entry: dict[str, Any]) -> str:
    """A reasoning-gym entry (question, answer, metadata) as a JSON string that :func:`decode_entry` turns back into
    an equal entry. Plain JSON would turn tuples into lists and integer keys into strings, and has no fractions
    (gsm_symbolic keeps some in its metadata); some scorers compare against these (the ARC tasks compare boards as
    tuples of tuples), so they are tagged."""
    return json.dumps(_tagged(entry), sort_keys=True)


def decode_entry(text: str) -> dict[str, Any]:
    """The entry that :func:`encode_entry` wrote, tuples and non-string keys restored."""
    return json.loads(text, object_hook=_untag)


def _tagged(value: Any) -> Any:
    if isinstance(value, tuple):
        return {_TUPLE_TAG: [_tagged(item) for item in value]}
    if isinstance(value, list):
        return [_tagged(item) for item in value]
    if isinstance(value, dict):
        if all(isinstance(key, str) for key in value):
            return {key: _tagged(item) for key, item in value.items()}
        return {_ITEMS_TAG: [[_tagged(key), _tagged(item)] for key, item in value.items()]}
    if isinstance(value, Fraction):
        return {_FRACTION_TAG: str(value)}
    if value is None or isinstance(value, str | int | float | bool):
        return value
    raise ValueError(f"reasoning-gym entry holds a {type(value).__name__} ({value!r:.60}); expected JSON-like data")


def _untag(value: dict[str, Any]) -> Any:
    if len(value) == 1 and _TUPLE_TAG in value:
        return tuple(value[_TUPLE_TAG])
    if len(value) == 1 and _ITEMS_TAG in value:
        return {_hashable(key): item for key, item in value[_ITEMS_TAG]}
    if len(value) == 1 and _FRACTION_TAG in value:
        return Fraction(value[_FRACTION_TAG])
    return value


def _hashable(key: Any) -> Any:
    return tuple(_hashable(item) for item in key) if isinstance(key, list) else key


def _row(task: str, config: str, entry: dict[str, Any]) -> dict[str, str]:
    answer = entry.get("answer")
    return {"question": str(entry["question"]), "answer": "" if answer is None else str(answer), "task": task,
            "config": config, "entry": encode_entry(entry)}


def _dataset(task: str, config: str, **counts: int) -> Any:
    """reasoning-gym's dataset for ``task`` with the configuration fields ``config`` (JSON) and ``counts``."""
    reasoning_gym = _import_reasoning_gym()
    fields = json.loads(config)
    try:
        return reasoning_gym.create_dataset(task, **fields, **counts)
    except Exception as error:  # noqa: BLE001 (reasoning-gym validates its configurations with assertions)
        raise ValueError(f"reasoning-gym task {task!r} rejected its configuration {fields or '(defaults)'} "
                         f"{counts or ''}: {type(error).__name__}: {error}; expected values its configuration "
                         f"accepts (some tasks, like composite, need fields a spec cannot set)") from None


def _generate(task: str, config: str, seed: int, size: int) -> list[dict[str, Any]]:
    dataset = _dataset(task, config, seed=seed, size=size)
    return [dataset[index] for index in range(size)]


@functools.lru_cache(maxsize=16)
def _train_rows(task: str, config: str, seed: int, size: int) -> tuple[dict[str, str], ...]:
    return tuple(_row(task, config, entry) for entry in _generate(task, config, split_seed(seed, "train"), size))


@functools.lru_cache(maxsize=16)
def _test_rows(task: str, config: str, seed: int, size: int, test_size: int) -> tuple[dict[str, str], ...]:
    taken = {row["question"] for row in _train_rows(task, config, seed, size)}
    test: list[dict[str, str]] = []
    for round_index in range(MAX_TEST_ROUNDS):
        for entry in _generate(task, config, split_seed(seed, "test", round_index), test_size):
            if entry["question"] not in taken and len(test) < test_size:
                taken.add(entry["question"])  # each test question once: a repeat would count twice in Pass@k
                test.append(_row(task, config, entry))
        if len(test) == test_size:
            break
    else:
        if not test:
            raise ValueError(f"reasoning-gym task {task!r} (configuration {config}) has no question outside its {size} "
                             f"train rows; expected a smaller size= or a harder configuration")
        warnings.warn(f"reasoning-gym task {task!r} gave only {len(test)} test questions not in its {size} train "
                      f"rows (asked for {test_size}); the task has few distinct questions", stacklevel=3)
    return tuple(test)


def load_rows(spec: str, split: str) -> list[dict[str, str]]:
    """The rows of one split of ``spec``: ``{"question", "answer", "task", "config", "entry"}``, all strings.

    ``answer`` is the gold answer as reasoning-gym states it (empty for tasks scored by checking a solution, which
    have none), ``config`` the task configuration fields the spec set (JSON, ``{}`` for none: a few scorers read
    them), ``entry`` the whole reasoning-gym entry with its metadata (:func:`encode_entry`), so a row stays plain
    data that a checkpoint or another process can carry and still be scored. Deterministic: the same spec gives the
    same rows; train and test share no question.
    """
    if split not in SPLITS:
        raise ValueError(f"split {split!r}; expected one of {', '.join(SPLITS)}")
    task, options = parse_spec(spec)
    config = json.dumps(_config(options), sort_keys=True)
    if split == "train":
        rows = _train_rows(task, config, options["seed"], options["size"])
    else:
        rows = _test_rows(task, config, options["seed"], options["size"], options["test_size"])
    return [dict(row) for row in rows]


@functools.lru_cache(maxsize=64)
def _score_answer(task: str, config: str) -> Any:
    """The task's ``score_answer`` under the configuration the rows were generated with, built once per task,
    configuration and process (reasoning-gym's ``get_score_answer_fn`` when the configuration is the default). A
    few scorers read the configuration (decimal_arithmetic's precision, puzzle24's number range), none the seed or
    the size."""
    if config == "{}":
        return _import_reasoning_gym().get_score_answer_fn(task)
    return _dataset(task, config).score_answer


def extract_answer(completion: str) -> str | None:
    """The answer in ``completion`` as reasoning-gym reads it (the last ``<answer>...</answer>``), or None."""
    _import_reasoning_gym()
    from reasoning_gym.utils import extract_answer as extract

    return extract(completion)


def score_completion(completion: str, row: dict[str, Any]) -> float:
    """The reward of ``completion`` for ``row``: the task's own ``score_answer`` on the extracted answer, 0.0 when
    the completion holds no ``<answer>`` tags."""
    answer = extract_answer(completion)
    if answer is None:
        return 0.0
    entry = decode_entry(row["entry"])
    return float(_score_answer(row["task"], row.get("config", "{}"))(answer, entry))


class ReasoningGymEnvironment:
    """A reasoning-gym task as a single-turn environment: the question (with :data:`ANSWER_FORMAT`) as the first
    message, one model turn, scored by :func:`score_completion`, then done."""

    def __init__(self, row: dict[str, Any]) -> None:
        missing = [key for key in ("question", "task", "entry") if key not in row]
        if missing:
            raise ValueError(f"reasoning-gym row lacks {', '.join(missing)} (has {', '.join(map(str, row))}); "
                             f"expected a row from lit_grpo.environments.reasoning_gym.load_rows")
        self.row = row

    def reset(self) -> str:
        """The question, then how to write the answer."""
        return f"{self.row['question']}\n\n{ANSWER_FORMAT}"

    def step(self, completion: str) -> tuple[None, float, bool]:
        """No reply, the task's score of the completion, done."""
        return None, score_completion(completion, self.row), True
