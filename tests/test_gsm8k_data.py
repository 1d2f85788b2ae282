"""GSM8K loading: the bundled copy, local files, Hub ids (faked), and the errors for malformed sources."""

from __future__ import annotations

import gzip
import json
import os
from pathlib import Path

import pytest

from lit_grpo.data import load_gsm8k
from lit_grpo.data.gsm8k import gold_answer, validate_rows

SHARED = Path(__file__).resolve().parents[2] / "shared" / "data" / "gsm8k"  # ../shared beside the checkout

ROWS = [
    {"question": "How many apples?", "answer": "2 + 3 = <<2+3=5>>5\n#### 5"},
    {"question": "How much money?", "answer": "1000 + 234 = 1234\n#### 1,234"},
    {"question": "What is the change?", "answer": "3 - 7 = -4\n#### -4"},
]


def _write_jsonl(path: Path, rows: list[dict]) -> Path:
    text = "".join(json.dumps(row) + "\n" for row in rows)
    if path.name.endswith(".gz"):
        path.write_bytes(gzip.compress(text.encode()))
    else:
        path.write_text(text)
    return path


@pytest.fixture
def no_hub(monkeypatch: pytest.MonkeyPatch) -> None:
    """Makes any attempt to reach the Hub fail the test."""
    import datasets

    def fail(*args, **kwargs):
        raise AssertionError(f"unexpected Hub load {args} {kwargs}")

    monkeypatch.setattr(datasets, "load_dataset", fail)


# ---------------------------------------------------------------------------------------------- bundled copy


@pytest.mark.parametrize(("split", "count"), [("train", 7473), ("test", 1319)])
def test_bundled_row_counts_and_fields(split: str, count: int) -> None:
    rows = load_gsm8k("bundled", split)
    assert len(rows) == count
    assert all(set(row) == {"question", "answer", "gold"} for row in rows)
    assert all("," not in row["gold"] and row["gold"].lstrip("-").isdigit() for row in rows)


def test_bundled_train_first_row() -> None:
    first = load_gsm8k()[0]
    assert first["question"].startswith("Natalia sold clips to 48 of her friends in April")
    assert first["answer"].endswith("#### 72")
    assert first["gold"] == "72"


# CI always has ../shared beside the checkout, so there this test never skips
@pytest.mark.skipif(not SHARED.is_dir() and not os.environ.get("CI"), reason="needs the shared GSM8K source files")
@pytest.mark.parametrize("split", ["train", "test"])
def test_bundled_matches_source_files(split: str) -> None:
    source = [json.loads(line) for line in (SHARED / f"{split}.jsonl").read_text().splitlines()]
    bundled = load_gsm8k("bundled", split)
    assert len(bundled) == len(source)
    for i in (0, -1):
        assert bundled[i]["question"] == source[i]["question"]
        assert bundled[i]["answer"] == source[i]["answer"]


def test_bundled_gold_drops_thousands_separators() -> None:
    rows = load_gsm8k("bundled", "train")
    with_separator = [row for row in rows if "," in row["answer"].rsplit("####", 1)[1]]
    assert with_separator, "GSM8K train has golds written with thousands separators"
    for row in with_separator:
        assert row["gold"] == row["answer"].rsplit("####", 1)[1].strip().replace(",", "")


@pytest.mark.parametrize(
    ("answer", "gold"),
    [
        ("#### 1,000", "1000"),
        ("x\n#### 1,234,567", "1234567"),
        ("a #### 3 b\n#### -7", "-7"),
        ("####12.5 ", "12.5"),
        ("5", None),
    ],
)
def test_gold_answer(answer: str, gold: str | None) -> None:
    assert gold_answer(answer) == gold


# ----------------------------------------------------------------------------------------------- local files


@pytest.mark.parametrize("name", ["rows.jsonl", "rows.jsonl.gz"])
def test_local_jsonl(tmp_path: Path, name: str, no_hub: None) -> None:
    path = _write_jsonl(tmp_path / name, ROWS)
    rows = load_gsm8k(str(path))
    assert [row["gold"] for row in rows] == ["5", "1234", "-4"]
    assert rows[1]["answer"] == ROWS[1]["answer"]


def test_local_json_array(tmp_path: Path, no_hub: None) -> None:
    path = tmp_path / "rows.json"
    path.write_text(json.dumps(ROWS))
    assert [row["question"] for row in load_gsm8k(str(path), split="test")] == [r["question"] for r in ROWS]


def test_local_parquet_keeps_only_gsm8k_fields(tmp_path: Path, no_hub: None) -> None:
    import pyarrow as pa
    import pyarrow.parquet as pq

    path = tmp_path / "rows.parquet"
    pq.write_table(pa.Table.from_pylist([{**row, "extra": 1} for row in ROWS]), path)
    rows = load_gsm8k(str(path))
    assert rows == [{**row, "gold": gold} for row, gold in zip(ROWS, ["5", "1234", "-4"])]


def test_directory_picks_the_split_file(tmp_path: Path, no_hub: None) -> None:
    _write_jsonl(tmp_path / "train.jsonl", ROWS)
    _write_jsonl(tmp_path / "test.jsonl", ROWS[:1])
    assert len(load_gsm8k(str(tmp_path), "train")) == 3
    assert len(load_gsm8k(str(tmp_path), "test")) == 1


# -------------------------------------------------------------------------------------------------- hub ids


def test_hub_id_goes_through_load_dataset(monkeypatch: pytest.MonkeyPatch) -> None:
    import datasets

    calls = []

    def fake_load_dataset(path, name=None, split=None, **kwargs):
        calls.append((path, name, split))
        return [{**row, "id": i} for i, row in enumerate(ROWS)]

    monkeypatch.setattr(datasets, "load_dataset", fake_load_dataset)
    rows = load_gsm8k("openai/gsm8k", split="test", config="socratic")
    assert calls == [("openai/gsm8k", "socratic", "test")]
    assert [row["gold"] for row in rows] == ["5", "1234", "-4"]
    assert set(rows[0]) == {"question", "answer", "gold"}


def test_hub_rows_are_validated(monkeypatch: pytest.MonkeyPatch) -> None:
    import datasets

    monkeypatch.setattr(datasets, "load_dataset", lambda *a, **k: [{"problem": "q", "solution": "#### 1"}])
    with pytest.raises(ValueError, match=r"someone/math.*row 0 is missing field 'question'"):
        load_gsm8k("someone/math")


# --------------------------------------------------------------------------------------------------- errors


def test_unknown_split_is_rejected_first(no_hub: None) -> None:
    with pytest.raises(ValueError, match=r"split 'validation'.*'train', 'test'"):
        load_gsm8k("/does/not/exist.jsonl", split="validation")


@pytest.mark.parametrize("source", ["missing.jsonl", "./data/missing", "/no/such/dir/gsm8k.parquet", "x.csv"])
def test_missing_path_is_not_sent_to_the_hub(source: str, no_hub: None) -> None:
    with pytest.raises(ValueError, match="no such file or directory") as info:
        load_gsm8k(source)
    assert source in str(info.value)


def test_unsupported_existing_file(tmp_path: Path, no_hub: None) -> None:
    path = tmp_path / "rows.csv"
    path.write_text("question,answer\n")
    with pytest.raises(ValueError, match=r"unsupported file type.*\.parquet"):
        load_gsm8k(str(path))


@pytest.mark.parametrize(
    ("bad_row", "message"),
    [
        ({"question": "q"}, r"row 1 is missing field 'answer'"),
        ({"answer": "#### 3"}, r"row 1 is missing field 'question'"),
        ({"question": "q", "answer": "three"}, r"row 1 field 'answer' has no '####' final answer"),
        ({"question": "q", "answer": 3}, r"row 1 field 'answer' is a int"),
    ],
)
def test_malformed_row_names_source_row_and_field(tmp_path: Path, bad_row: dict, message: str) -> None:
    path = _write_jsonl(tmp_path / "bad.jsonl", [ROWS[0], bad_row, ROWS[1]])
    with pytest.raises(ValueError, match=message) as info:
        load_gsm8k(str(path))
    assert str(path) in str(info.value)
    assert "'#### <number>'" in str(info.value)  # says what is expected


def test_invalid_json_line_is_named(tmp_path: Path) -> None:
    path = tmp_path / "bad.jsonl"
    path.write_text(json.dumps(ROWS[0]) + "\n{not json\n")
    with pytest.raises(ValueError, match=r"line 2 is not valid JSON"):
        load_gsm8k(str(path))


def test_validate_rows_rejects_empty_and_non_objects() -> None:
    with pytest.raises(ValueError, match=r"src: no rows"):
        validate_rows([], "src")
    with pytest.raises(ValueError, match=r"src: row 0 is a list"):
        validate_rows([["q", "a"]], "src")
