"""Tables that the experiment scripts write into the docs, between a pair of markers: ``<!-- name -->``, the table,
``<!-- /name -->``, each marker on a line of its own. The prose around them is written by hand; the tables are
computed from the committed results, so a number typed into one by hand is overwritten on the next write (and
``tests/test_committed_results.py`` fails on it before that).
"""

from __future__ import annotations

from pathlib import Path


def markers(name: str) -> tuple[str, str]:
    """The opening and closing markers of table ``name``."""
    return f"<!-- {name} -->", f"<!-- /{name} -->"


def _split(text: str, name: str) -> tuple[str, str, str]:
    """(up to the opening marker, the table, from the closing marker's line break on)."""
    begin, end = markers(name)
    for marker in (begin, end):
        if text.count(marker) != 1:
            raise ValueError(f"marker {marker!r} appears {text.count(marker)} times; expected exactly once")
    start, stop = text.index(begin) + len(begin), text.index(end)
    if not (start < stop and text[start] == "\n" and text[stop - 1] == "\n"):
        raise ValueError(f"table {name!r}: expected {begin!r} and {end!r} each on a line of their own, in that order")
    return text[:start - len(begin)], text[start + 1:stop - 1], text[stop + len(end):]


def quoted(text: str, name: str) -> str:
    """The table ``name`` that ``text`` holds between its markers (without the markers' line breaks)."""
    return _split(text, name)[1]


def replaced(text: str, name: str, table: str) -> str:
    """``text`` with table ``name`` replaced by ``table``; everything outside the markers kept byte for byte."""
    before, _, after = _split(text, name)
    begin, end = markers(name)
    return f"{before}{begin}\n{table}\n{end}{after}"


def write_table(document: Path, name: str, table: str) -> None:
    """Replace table ``name`` of ``document`` by ``table`` (the file must already hold its markers)."""
    document.write_text(replaced(document.read_text(), name, table))


def demo_table(record: dict) -> str:
    """The README's five-seed table (between its ``demo-table`` markers) from ``demo_cpu_seeds.json``'s record:
    held-out Pass@1 (mean +- population std over seeds, and the worst seed) and Pass@8 at each evaluated step; the
    last step's Pass@1 in bold, the number the demo's bar is about."""
    import statistics

    seeds = record["seeds"]
    steps = sorted({int(s) for r in seeds.values() for s in r["eval/pass@1"]})

    def at(tag: str, step: int) -> list[float]:
        return [r[tag][str(step)] for r in seeds.values()]

    def row(name: str, values: list[str], bold_last: bool = False) -> str:
        if bold_last:
            values = [*values[:-1], f"**{values[-1]}**"]
        return f"| {name} | " + " | ".join(values) + " |"

    def mean_std(tag: str) -> list[str]:
        return [f"{statistics.fmean(at(tag, s)):.2f} +- {statistics.pstdev(at(tag, s)):.2f}" for s in steps]

    return "\n".join([row("optimizer step", [str(s) for s in steps]), "|---|" + "---|" * len(steps),
                      row("held-out Pass@1", mean_std("eval/pass@1"), bold_last=True),
                      row("held-out Pass@1, worst seed", [f"{min(at('eval/pass@1', s)):.2f}" for s in steps],
                          bold_last=True),
                      row("held-out Pass@8", mean_std("eval/pass@8"))])


def last_pass_by_seed(record: dict) -> str:
    """Each seed's Pass@1 at the last evaluated step, to three decimals (the README's prose quotes them)."""
    seeds = record["seeds"]
    last = str(max(int(s) for r in seeds.values() for s in r["eval/pass@1"]))
    return "last Pass@1 by seed: " + ", ".join(f"{seed}: {r['eval/pass@1'][last]:.3f}" for seed, r in seeds.items())
