"""``multi_turn_worker.py`` whose ``ServerEngine`` also writes every completion request it sends (the server's or the
router's URL, the prompts, ``n`` and the session id) and every session it releases to ``requests.<rank>.jsonl``
beside the results, and whose results carry the routing statistics, for tests/test_server_routing.py.

Usage: python routing_worker.py JOBS_JSON OUT_PREFIX (as dist_worker.py; launched through ``distributed_launch``).
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import dist_worker
from multi_turn_helpers import MULTI_TURN_KEYS

from lit_grpo.engines.remote.client import ServerEngine

ROUTING_KEYS = ("rollout/server_0_sequences", "rollout/server_1_sequences", "rollout/server_load_ratio_max")


def recording(log: Path) -> None:
    """Make ``ServerEngine`` append each request it sends (URL, prompts, ``n``, session id) and each session it
    releases (``{"released": [ids]}``, the router's ids when it has one) to ``log``."""
    send, release = ServerEngine._complete, ServerEngine.release_sessions

    def write(record: dict) -> None:
        with open(log, "a") as f:
            f.write(json.dumps(record) + "\n")

    def _complete(self, server, prompts, n, sampling, seed, session=None, salt=None):  # noqa: ANN001, ANN202
        write({"url": server.url, "prompts": prompts, "n": n, "session": session, "salt": salt})
        return send(self, server, prompts, n, sampling, seed, session, salt)

    def release_sessions(self, sessions):  # noqa: ANN001, ANN202
        sessions = list(sessions)
        write({"released": [self.session_id(s) if self.router is not None else s for s in sessions]})
        return release(self, sessions)

    ServerEngine._complete, ServerEngine.release_sessions = _complete, release_sessions


if __name__ == "__main__":
    jobs = json.loads(Path(sys.argv[1]).read_text())
    prefix = sys.argv[2]
    recording(Path(prefix).parent / f"requests.{os.environ.get('LOCAL_RANK', '0')}.jsonl")
    dist_worker.KEYS = dist_worker.KEYS + MULTI_TURN_KEYS + ROUTING_KEYS
    results = [dist_worker.run_job(job, str(Path(prefix).parent / f"job{i}")) for i, job in enumerate(jobs)]
    rank = results[0]["rank"] if results else 0
    Path(f"{prefix}.{rank}.json").write_text(json.dumps(results))
