"""``dist_worker.py`` whose job results also carry the multi-turn statistics (``multi_turn_helpers.MULTI_TURN_KEYS``).

Usage: python multi_turn_worker.py JOBS_JSON OUT_PREFIX (as dist_worker.py; launched by
``multi_turn_helpers.launch_multi_turn``).
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import dist_worker
from multi_turn_helpers import MULTI_TURN_KEYS

if __name__ == "__main__":
    dist_worker.KEYS = dist_worker.KEYS + MULTI_TURN_KEYS
    jobs = json.loads(Path(sys.argv[1]).read_text())
    prefix = sys.argv[2]
    results = [dist_worker.run_job(job, str(Path(prefix).parent / f"job{i}")) for i, job in enumerate(jobs)]
    rank = results[0]["rank"] if results else 0
    Path(f"{prefix}.{rank}.json").write_text(json.dumps(results))
