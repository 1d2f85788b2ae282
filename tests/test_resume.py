"""A run that dies can resume from its last checkpoint and lose nothing."""

import json
import subprocess
import sys
from pathlib import Path

import pytest
from resume_worker import run

WORKER = Path(__file__).with_name("resume_worker.py")


def test_six_steps_straight_equal_three_plus_checkpoint_plus_three_in_new_process(tmp_path):
    straight = run(6, str(tmp_path / "a"))
    first = run(3, str(tmp_path / "b"), ckpt_out=str(tmp_path / "half.ckpt"))
    out = tmp_path / "second.json"
    subprocess.run(
        [sys.executable, str(WORKER), "6", str(out), "--ckpt-in", str(tmp_path / "half.ckpt"),
         "--workdir", str(tmp_path / "c")],
        check=True, cwd=WORKER.parent,
    )
    second = json.loads(out.read_text())
    assert len(straight) == 6 and len(first) == 3 and len(second) == 3
    # staleness 0,1,0,1,... with v = 2: the checkpoint at step 3 holds a lagging engine
    assert [s["train/staleness"] for s in straight] == [0, 1, 0, 1, 0, 1]
    for expected, got in zip(straight, first + second):
        for key in expected:
            assert got[key] == pytest.approx(expected[key], abs=1e-6), key
    # the run did something: losses and KL change from step to step
    assert len({round(s["train/loss"], 6) for s in straight}) > 1
    assert any(s["train/kl"] > 0 for s in straight)
