"""GSM8K problems as ``{"question", "answer", "gold"}`` rows, from the bundled copy, a local file, or the Hub.

The bundled copy (``assets/``) makes training and tests work with no network; local files and Hub ids are for
other copies or GSM8K-format variants. Every source goes through :func:`validate_rows`, so a malformed
file fails at load time with the row and field at fault, not mid-training inside a reward function.
"""

from __future__ import annotations

import gzip
import io
import json
import re
from collections.abc import Iterable, Iterator, Mapping
from importlib import resources
from pathlib import Path
from typing import Any

from lit_grpo.data.hf_datasets import describe_hub, hub_config, is_saved_dataset, read_hub, read_saved

SPLITS: tuple[str, ...] = ("train", "test")
FILE_SUFFIXES: tuple[str, ...] = (".jsonl", ".jsonl.gz", ".json", ".parquet")

_EXPECTED_ROW = (
    "expected GSM8K rows: objects with string fields 'question' and 'answer', the answer ending in '#### <number>'"
)
_THOUSANDS_SEPARATOR = re.compile(r"(?<=\d),(?=\d{3}(?!\d))")
# Suffixes that mark a source as meant to be a file even when it names no supported format.
_FILE_LIKE_SUFFIXES = (*FILE_SUFFIXES, ".gz", ".csv", ".txt", ".arrow")


def gold_answer(answer: str) -> str | None:
    """The final answer after the last ``####`` without thousands separators (``"1,000"`` -> ``"1000"``)."""
    if "####" not in answer:
        return None
    gold = answer.rsplit("####", 1)[1].strip()
    return _THOUSANDS_SEPARATOR.sub("", gold) or None


def _validated_row(row: Any, index: int, source: str, numeric_gold: bool = True) -> dict[str, str]:
    """One row reduced to the three fields, or a ``ValueError`` naming the source, row and field at fault."""
    if not isinstance(row, Mapping):
        raise ValueError(f"{source}: row {index} is a {type(row).__name__}; {_EXPECTED_ROW}")
    for name in ("question", "answer"):
        value = row.get(name)
        if value is None or (isinstance(value, str) and not value.strip()):
            raise ValueError(f"{source}: row {index} is missing field {name!r}; {_EXPECTED_ROW}")
        if not isinstance(value, str):
            raise ValueError(f"{source}: row {index} field {name!r} is a {type(value).__name__}; {_EXPECTED_ROW}")
    gold = gold_answer(row["answer"])
    if gold is None or numeric_gold and not any(ch.isdigit() for ch in gold):
        raise ValueError(
            f"{source}: row {index} field 'answer' has no '####' final answer "
            f"(ends with {row['answer'][-40:]!r}); {_EXPECTED_ROW}"
        )
    return {"question": row["question"], "answer": row["answer"], "gold": gold}


def validate_rows(rows: Iterable[Any], source: str, numeric_gold: bool = True) -> list[dict[str, str]]:
    """Checks GSM8K rows and returns them as ``{"question", "answer", "gold"}`` dicts (other fields dropped).

    ``numeric_gold``: the gold after ``####`` must hold a number, as the ``correctness`` reward needs; ``False`` when
    every reward judges golds of its own form and checks them itself (``math_verify``: ``#### \\pi``)."""
    validated = [_validated_row(row, i, source, numeric_gold) for i, row in enumerate(rows)]
    if not validated:
        raise ValueError(f"{source}: no rows; {_EXPECTED_ROW}")
    return validated


def _json_lines(lines: Iterable[str], source: str) -> Iterator[Any]:
    """Parses JSON lines, skipping blank ones, with the line number in any parse error."""
    for number, line in enumerate(lines, start=1):
        if not line.strip():
            continue
        try:
            yield json.loads(line)
        except json.JSONDecodeError as e:
            message = f"{source}: line {number} is not valid JSON ({e.msg}); expected one JSON object a line"
            raise ValueError(message) from e


def _read_json(path: Path) -> list[Any]:
    """A ``.json`` file: either one JSON array of row objects or JSON lines (both are common for ``.json``)."""
    text = path.read_text(encoding="utf-8")
    if not text.lstrip().startswith("["):
        return list(_json_lines(text.splitlines(), str(path)))
    try:
        return json.loads(text)
    except json.JSONDecodeError as e:
        raise ValueError(f"{path}: not valid JSON ({e.msg}); expected an array of row objects or JSON lines") from e


def _read_jsonl(path: Path) -> list[Any]:
    opener = gzip.open if path.name.endswith(".gz") else open
    with opener(path, "rt", encoding="utf-8") as f:
        return list(_json_lines(f, str(path)))


def _read_parquet(path: Path) -> list[Any]:
    import pyarrow.parquet as pq

    return pq.read_table(path).to_pylist()


def _read_file(path: Path) -> list[Any]:
    """Rows of a local file, by suffix."""
    name = path.name.lower()
    if name.endswith((".jsonl", ".jsonl.gz")):
        return _read_jsonl(path)
    if name.endswith(".json"):
        return _read_json(path)
    if name.endswith(".parquet"):
        return _read_parquet(path)
    raise ValueError(f"{path}: unsupported file type; expected one of {', '.join(FILE_SUFFIXES)}")


def _file_in_directory(directory: Path, split: str) -> Path:
    """``<dir>/<split>.<suffix>`` or ``<dir>/gsm8k_<split>.<suffix>``, as laid out by GSM8K's own repository."""
    candidates = [directory / f"{stem}{suffix}" for stem in (split, f"gsm8k_{split}") for suffix in FILE_SUFFIXES]
    for candidate in candidates:
        if candidate.is_file():
            return candidate
    names = ", ".join(c.name for c in candidates)
    raise ValueError(f"{directory}: no file for split {split!r}; expected one of {names}")


def _read_bundled(split: str) -> list[Any]:
    """The package's own copy, read through ``importlib.resources`` so it also works from a wheel or zip."""
    asset = resources.files("lit_grpo.data").joinpath("assets").joinpath(f"gsm8k_{split}.jsonl.gz")
    with asset.open("rb") as raw, gzip.GzipFile(fileobj=raw) as gz:
        return list(_json_lines(io.TextIOWrapper(gz, encoding="utf-8"), f"bundled GSM8K {split}"))


def _looks_like_path(source: str) -> bool:
    """Whether a source is meant as a filesystem path (a Hub id is ``owner/name`` with no such markers)."""
    return source.startswith(("/", "./", "../", "~", "\\")) or source.lower().endswith(_FILE_LIKE_SUFFIXES)


def load_gsm8k(source: str = "bundled", split: str = "train", config: str | None = None,
               numeric_gold: bool = True) -> list[dict[str, str]]:
    """GSM8K rows ``{"question": str, "answer": str, "gold": str}``, checked by :func:`validate_rows`.

    ``source`` is ``"bundled"`` (the copy shipped in the package), a local path (a ``.jsonl``,
    ``.jsonl.gz``, ``.json`` or ``.parquet`` file holding one split, a folder written by ``save_to_disk``, or a
    directory holding ``<split>.jsonl`` and the like), or else a Hub dataset id such as ``"openai/gsm8k"``, loaded
    with ``datasets.load_dataset(source, config, split=split)`` (:mod:`lit_grpo.data.hf_datasets`). ``config`` is
    used only for Hub ids (``None``: the dataset's default; GSM8K's ``main`` for its own ids); ``split`` picks the
    file of the bundled copy or a directory, and is checked but otherwise unused for a single file.
    ``"synthetic:<task>"`` names a generated task in the same format (see :mod:`lit_grpo.data.synthetic`).
    ``numeric_gold``: see :func:`validate_rows`.
    """
    if split not in SPLITS:
        raise ValueError(f"split {split!r}: expected one of {', '.join(repr(s) for s in SPLITS)}")
    if not isinstance(source, str) or not source.strip():
        raise ValueError(f"source {source!r}: expected 'bundled', a local file or directory path, or a Hub dataset id")
    if source == "bundled":
        return validate_rows(_read_bundled(split), f"bundled GSM8K {split}", numeric_gold)
    if source.startswith("synthetic:"):  # generated tasks in GSM8K's format (lit_grpo.data.synthetic)
        from lit_grpo.data.synthetic import load_synthetic

        return validate_rows(load_synthetic(source, split), f"{source} {split}", numeric_gold)
    rows, described = read_rows(source, split, config)
    return validate_rows(rows, described, numeric_gold)


def read_rows(source: str, split: str, config: str | None = None) -> tuple[list[Any], str]:
    """The rows of a local file, a directory's split, a ``save_to_disk`` folder or a Hub dataset, as they are
    (unchecked), and the source in words for messages: what :func:`load_gsm8k` checks as GSM8K, what
    :mod:`lit_grpo.data.columns` reads by its columns, and environments' tasks read as plain dicts. ``latex:<task>``
    names a LaTeX-answer set generated here (:mod:`lit_grpo.data.latex_tasks`), in DeepScaleR's columns."""
    if source.startswith("latex:"):
        from lit_grpo.data.latex_tasks import load_latex_task

        return load_latex_task(source, split), f"{source} {split}"
    path = Path(source).expanduser()
    if is_saved_dataset(path):
        return read_saved(path, split), str(path)
    if path.is_dir():
        path = _file_in_directory(path, split)
    if path.is_file():
        return _read_file(path), str(path)
    if _looks_like_path(source):
        raise ValueError(f"source {source!r}: no such file or directory; expected an existing path or a Hub dataset id")
    config = hub_config(source, config)
    return read_hub(source, config, split), describe_hub(source, config, split)
