"""The committed results stay light and reproducible: every sweep's raw curves are one gzip'd compact JSON file
(``curves.json.gz``, read and written by ``experiments/curves_file.py``), no committed JSON file is large, every
stored summary is what its runs give, every table the docs quote from a result is the one its script computes from
the committed JSON (``experiments/doc_tables.py``'s markers: a number edited by hand fails), and what the README's
commands write into the working directory is ignored by git while the committed results are not."""

from __future__ import annotations

import dataclasses
import gzip
import json
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "experiments"))
sys.path.insert(0, str(ROOT / "experiments" / "race"))

import corrections_study as study  # noqa: E402
import doc_tables  # noqa: E402
import fig2_miniature as fig2  # noqa: E402
import race_report  # noqa: E402
import reproduce  # noqa: E402
from curves_file import CURVES_FILE, read_curves, write_curves  # noqa: E402
from miniature_stats import summary  # noqa: E402

RESULTS = ROOT / "experiments" / "results"
#: the sweeps whose raw curves are committed: folder -> how its summary is computed from its runs
SWEEPS = {
    "corrections_study": lambda runs: study.summarise([study.deduplicated(r) for r in runs]),
    "fig2_miniature": lambda runs: summary(runs, list(fig2.SUITES["rec"].rows)),
    "fig2_paper": lambda runs: summary(runs, list(fig2.SUITES["paper"].rows)),
}
#: a committed JSON file above this many bytes is raw curves that belong compressed
LARGEST_JSON = 200_000


def committed(*folders: str) -> list[Path]:
    out = subprocess.run(["git", "ls-files", "-z", "--", *folders], cwd=ROOT, capture_output=True, check=True).stdout
    return [ROOT / name for name in out.decode().split("\0") if name]


def test_the_curves_file_is_compact_gzip_json_with_the_same_bytes_for_the_same_data(tmp_path):
    data = {"summary": {"a": {"pass@1_end": 0.75}}, "runs": [{"row": "a", "series": {"pass@1": [[0, 0.2], [20, 0.1]]}}]}
    first, second = tmp_path / "one" / CURVES_FILE, tmp_path / CURVES_FILE
    first.parent.mkdir()
    write_curves(first, data)
    write_curves(second, data)
    assert read_curves(first) == data
    text = gzip.decompress(first.read_bytes()).decode()
    assert text == json.dumps(data, separators=(",", ":"))  # compact: no indent, no spaces
    assert first.read_bytes() == second.read_bytes()  # no time stamp nor file name in the gzip header


@pytest.mark.parametrize("sweep", sorted(SWEEPS))
def test_each_sweeps_curves_are_committed_compressed_and_its_summary_is_what_its_runs_give(sweep):
    folder = RESULTS / sweep
    assert folder / CURVES_FILE in committed(str(folder.relative_to(ROOT)))
    assert not (folder / "curves.json").exists()
    saved = read_curves(folder / CURVES_FILE)
    again = SWEEPS[sweep](saved["runs"])
    # every value the file stored is recomputed from its runs (an older file may store fewer keys than today's)
    assert list(again) == list(saved["summary"])
    for key, stored in saved["summary"].items():
        assert {k: again[key][k] for k in stored} == stored, key


def test_no_committed_result_is_large_raw_json():
    large = sorted(str(p.relative_to(ROOT)) for p in committed("experiments", "benchmarks")
                   if p.suffix == ".json" and p.is_file() and p.stat().st_size > LARGEST_JSON)
    assert large == [], f"compress these with experiments/curves_file.py: {large}"


def demo_record() -> dict:
    return json.loads(reproduce.DEMO_SEEDS.read_text())


def miniature_table(suite: str) -> str:
    """What ``fig2_miniature.py --suite <suite> --plot-only`` writes into docs/miniature.md."""
    runs = read_curves(fig2.SUITES[suite].out / CURVES_FILE)["runs"]
    return fig2.doc_table(suite, summary(runs, list(fig2.SUITES[suite].rows)))


def corrections_tables() -> dict[str, str]:
    """What ``corrections_study.py --plot-only`` writes into docs/corrections-study.md."""
    runs = read_curves(study.OUT / CURVES_FILE)["runs"]
    return study.doc_tables(study.summarise([study.deduplicated(r) for r in runs]))


#: every table a doc quotes from a committed result: (doc, the name of its markers, the table its script computes)
DOC_TABLES = {
    "race": ("docs/race.md", "race-table", lambda: race_report.table(race_report.load_runs(RESULTS / "race"))),
    "demo": ("README.md", reproduce.DEMO_TABLE, lambda: reproduce.demo_table(demo_record())),
    "miniature": ("docs/miniature.md", fig2.DOC_TABLES["rec"], lambda: miniature_table("rec")),
    "paper": ("docs/miniature.md", fig2.DOC_TABLES["paper"], lambda: miniature_table("paper")),
    **{name: ("docs/corrections-study.md", name, lambda name=name: corrections_tables()[name])
       for name in ("corrections-pass-table", "corrections-diagnostics-table")},
}


@pytest.mark.parametrize("table", sorted(DOC_TABLES))
def test_each_table_a_doc_quotes_is_what_its_script_computes_from_the_committed_json(table):
    doc, name, compute = DOC_TABLES[table]
    quoted = doc_tables.quoted((ROOT / doc).read_text(), name)
    computed = compute()
    assert quoted.count("\n|") >= 2, f"{doc}'s {name} should be a Markdown table: {quoted!r}"
    assert quoted == computed, f"{doc}'s {name} differs from what its script computes; rerun the script"


def test_the_readmes_per_seed_numbers_are_the_seeds_last_pass_at_1():
    """The prose after the README's table lists each seed's Pass@1 at step 150, as --measure-demo prints them."""
    seeds = demo_record()["seeds"]
    values = ", ".join(f"{seeds[s]['eval/pass@1']['150']:.3f}" for s in ("0", "1", "2", "3", "4"))
    assert reproduce.last_pass_by_seed(demo_record()).endswith(f"4: {seeds['4']['eval/pass@1']['150']:.3f}")
    readme = " ".join((ROOT / "README.md").read_text().split())  # the sentence wraps
    assert f"every seed above 0.9 ({values})" in readme


def test_the_race_report_writes_its_table_between_the_doc_tables_markers():
    assert (race_report.BEGIN, race_report.END) == doc_tables.markers("race-table")


def edited(text: str, name: str) -> str:
    """``text`` with one digit of table ``name`` changed, as a hand edit would."""
    table = doc_tables.quoted(text, name)
    i = next(i for i, c in enumerate(table) if c.isdigit() and table[i - 1] in "0123456789.")
    changed = table[:i] + str((int(table[i]) + 1) % 10) + table[i + 1:]
    return doc_tables.replaced(text, name, changed)


def copy_with_a_hand_edit(doc: str, names: list[str], tmp_path: Path) -> tuple[Path, bytes]:
    committed_text = (ROOT / doc).read_text()
    text = committed_text
    for name in names:
        text = edited(text, name)
    assert text != committed_text
    copy = tmp_path / Path(doc).name
    copy.write_text(text)
    return copy, committed_text.encode()


def test_the_race_report_rewrites_a_hand_edited_table(tmp_path, monkeypatch):
    copy, committed_bytes = copy_with_a_hand_edit("docs/race.md", ["race-table"], tmp_path)
    monkeypatch.setattr(race_report, "figure", lambda *args: None)  # the committed figure stays as it is
    race_report.report(RESULTS / "race", copy)
    assert copy.read_bytes() == committed_bytes


def test_measure_demo_writes_the_readmes_table(tmp_path, monkeypatch, capsys):
    copy, committed_bytes = copy_with_a_hand_edit("README.md", [reproduce.DEMO_TABLE], tmp_path)
    monkeypatch.setattr(reproduce, "README", copy)
    monkeypatch.setattr(reproduce, "measure_demo", lambda seeds, runs: demo_record())  # the committed runs
    assert reproduce.main(["--measure-demo", "0", "1", "2", "3", "4"]) == 0
    assert copy.read_bytes() == committed_bytes
    assert reproduce.last_pass_by_seed(demo_record()) in capsys.readouterr().out


@pytest.mark.parametrize("suite", ["rec", "paper"])
def test_the_miniature_script_rewrites_its_table_only_for_the_committed_folder(suite, tmp_path, monkeypatch):
    copy, committed_bytes = copy_with_a_hand_edit("docs/miniature.md", list(fig2.DOC_TABLES.values()), tmp_path)
    hand_edited = copy.read_bytes()
    committed_out, work = tmp_path / "committed", tmp_path / "elsewhere"
    for out in (committed_out, work):
        out.mkdir()
        (out / CURVES_FILE).write_bytes((fig2.SUITES[suite].out / CURVES_FILE).read_bytes())
    monkeypatch.setitem(fig2.SUITES, suite, dataclasses.replace(fig2.SUITES[suite], out=committed_out))
    monkeypatch.setattr(fig2, "DOC", copy)
    monkeypatch.setattr(fig2, f"plot_{suite}", lambda *args: None)
    fig2.main(["--suite", suite, "--plot-only", "--out", str(work)])
    assert copy.read_bytes() == hand_edited  # a sweep elsewhere leaves the doc alone
    fig2.main(["--suite", suite, "--plot-only"])
    text, committed_text = copy.read_text(), committed_bytes.decode()
    name = fig2.DOC_TABLES[suite]
    assert doc_tables.quoted(text, name) == doc_tables.quoted(committed_text, name)
    other = next(n for n in fig2.DOC_TABLES.values() if n != name)
    assert doc_tables.quoted(text, other) != doc_tables.quoted(committed_text, other)  # the other suite's stays


def test_the_corrections_study_rewrites_its_tables(tmp_path, monkeypatch):
    copy, committed_bytes = copy_with_a_hand_edit("docs/corrections-study.md", list(corrections_tables()), tmp_path)
    out = tmp_path / "committed"
    out.mkdir()
    (out / CURVES_FILE).write_bytes((study.OUT / CURVES_FILE).read_bytes())
    monkeypatch.setattr(study, "OUT", out)
    monkeypatch.setattr(study, "DOC", copy)
    monkeypatch.setattr(study, "plot", lambda *args: None)
    study.main(["--plot-only"])
    assert copy.read_bytes() == committed_bytes


def test_a_table_is_replaced_between_its_markers_and_the_rest_kept():
    text = "intro\n<!-- t -->\n| a |\n|---|\n| 1 |\n<!-- /t -->\noutro\n"
    assert doc_tables.quoted(text, "t") == "| a |\n|---|\n| 1 |"
    assert doc_tables.replaced(text, "t", "| a |\n|---|\n| 2 |") == text.replace("| 1 |", "| 2 |")
    assert doc_tables.replaced(text, "t", doc_tables.quoted(text, "t")) == text


@pytest.mark.parametrize(("text", "message"), [
    ("no markers\n", "marker '<!-- t -->' appears 0 times; expected exactly once"),
    ("<!-- t -->\n| 1 |\n<!-- /t -->\n<!-- t -->\n", "marker '<!-- t -->' appears 2 times"),
    ("<!-- /t -->\n| 1 |\n<!-- t -->\n", "each on a line of their own, in that order"),
    ("<!-- t --> | 1 |\n<!-- /t -->\n", "each on a line of their own, in that order"),
])
def test_misplaced_markers_are_refused(text, message):
    with pytest.raises(ValueError, match=re.escape(message)):
        doc_tables.quoted(text, "t")


def ignored(path: str) -> bool:
    """Whether .gitignore's rules ignore ``path``, tracked or not."""
    return subprocess.run(["git", "check-ignore", "-q", "--no-index", path], cwd=ROOT).returncode == 0


@pytest.mark.parametrize("path", ["pass_at_k.json", "out/demo_policy/model.safetensors", "demo.png", "demo.yaml",
                                  "preds.jsonl", "runs/demo_cpu/tensorboard"])
def test_what_the_readmes_commands_write_is_ignored(path):
    assert ignored(path)


@pytest.mark.parametrize("path", ["experiments/results/corrections_study/curves.json.gz",
                                  "experiments/results/demo_cpu.png", "experiments/results/demo_cpu_seeds.json",
                                  "experiments/results/demo_tools/seeds.json", "configs/demo_cpu.yaml", "docs/cli.md",
                                  "lit_grpo/data/assets/gsm8k_test.jsonl.gz"])
def test_committed_results_and_sources_are_not_ignored(path):
    assert not ignored(path)
