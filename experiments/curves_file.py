"""The results file of a sweep (``fig2_miniature.py``, ``corrections_study.py``): ``curves.json.gz``, the settings,
the summaries and every run's raw curves as compact JSON, gzip-compressed. A sweep's curves are megabytes of plain
JSON (mostly digits and the indentation around them); compressed they are a tenth of that, so the committed results
keep the repository light and every figure and table stays reproducible from them (``--plot-only``)."""

from __future__ import annotations

import gzip
import json
from pathlib import Path

#: the file's name in a sweep's ``--out`` folder
CURVES_FILE = "curves.json.gz"


def write_curves(path: Path, data: dict) -> None:
    """Write ``data`` to ``path`` as compact JSON, gzip-compressed. The gzip header gets no time stamp and no file
    name, so the same data always give the same bytes (a redraw does not change a committed file for nothing)."""
    text = json.dumps(data, separators=(",", ":"))
    path.write_bytes(gzip.compress(text.encode(), mtime=0))


def read_curves(path: Path) -> dict:
    """The data ``write_curves`` wrote to ``path``."""
    return json.loads(gzip.decompress(path.read_bytes()))
