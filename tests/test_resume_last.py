"""``fit --ckpt_path last``: the run's newest checkpoint over every version of its folder (lit_grpo/cli/resume.py),
resumed into the version it was written in. End to end with real processes: a fit killed with SIGKILL, then the same
command line again, logs the same per-step losses into one version as a fit that was never stopped."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from types import SimpleNamespace

import pytest
from cli_runner import refusal_line
from torch.utils.data import DataLoader

from lit_grpo.cli.plots import read_series, version_dirs
from lit_grpo.cli.resume import checkpoint_folders, first_logged_step, latest_checkpoint, logger_folder

ROOT = Path(__file__).resolve().parents[1]
DEMO = ROOT / "configs" / "demo_cpu.yaml"
#: the demo with the tiny model, 7 small steps, a checkpoint every 3 and a reward with spread (non-zero losses)
SMALL = """
trainer:
  max_steps: 7
  callbacks:
    - class_path: lightning.pytorch.callbacks.ModelCheckpoint
      init_args:
        save_last: link
        every_n_train_steps: 3
eval:
  at_start: false
  at_end: false
  every_n_optimizer_steps: null
model:
  model_name: tiny-random-llama
  log_completions_every_n_steps: null
data:
  prompts_per_step: 4
  num_generations: 4
  max_new_tokens: 8
  rewards: [correctness, toy_rewards:digit_fraction]
"""
VERSIONS = Path("runs") / "demo_cpu" / "tensorboard"
NOT_RESUMABLE = "not resumable"


def _fit_command(folder: Path) -> tuple[list[str], dict[str, str]]:
    (folder / "small.yaml").write_text(SMALL)
    env = dict(os.environ, OMP_NUM_THREADS="1", HF_HUB_OFFLINE="1", HF_DATASETS_OFFLINE="1",
               PYTHONPATH=os.pathsep.join([str(ROOT / "tests"), os.environ.get("PYTHONPATH", "")]))
    env.pop("LIT_GRPO_DEBUG", None)
    return [sys.executable, "-m", "lit_grpo", "fit", "--config", str(DEMO), "--config", "small.yaml",
            "--ckpt_path", "last"], env


def _logged_steps(version: Path) -> list[int]:
    try:
        return [step for step, _ in read_series([version]).get(version.name, {}).get("train/loss", [])]
    except ValueError:  # no event file yet
        return []


@pytest.mark.slow
def test_a_killed_fit_rerun_with_ckpt_path_last_logs_the_uninterrupted_losses_in_one_version(tmp_path):
    straight, killed = tmp_path / "straight", tmp_path / "killed"
    straight.mkdir(), killed.mkdir()
    command, env = _fit_command(straight)
    first = subprocess.run(command, cwd=straight, env=env, capture_output=True, text=True, timeout=900)
    assert first.returncode == 0, first.stderr[-3000:]
    # nothing to resume yet: said in one line, then the fit runs from step 0 (the same command line every time)
    assert "ckpt_path last: no checkpoint in runs/demo_cpu/tensorboard/*/checkpoints; the fit starts from the " \
           "beginning" in first.stderr

    command, env = _fit_command(killed)
    version = killed / VERSIONS / "version_0"
    with open(killed / "killed.log", "w") as log:
        proc = subprocess.Popen(command, cwd=killed, env=env, stdout=log, stderr=subprocess.STDOUT)
        try:  # killed once step 3 is logged: after the step-3 checkpoint and its step's metrics, before step 6's
            deadline = time.monotonic() + 600
            while 3 not in _logged_steps(version) and proc.poll() is None and time.monotonic() < deadline:
                time.sleep(0.1)
            assert proc.poll() is None, "the fit ended before it could be killed"
            proc.send_signal(signal.SIGKILL)
            proc.wait(timeout=60)
        finally:
            if proc.poll() is None:
                proc.kill()
    assert proc.returncode == -signal.SIGKILL
    stopped_at = max(_logged_steps(version))
    assert stopped_at < 6

    resumed = subprocess.run(command, cwd=killed, env=env, capture_output=True, text=True, timeout=900)
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    output = resumed.stdout + resumed.stderr
    assert f"Restoring states from the checkpoint path at {VERSIONS / 'version_0' / 'checkpoints'}" in output
    assert NOT_RESUMABLE not in output  # the data module restores its position: Lightning's warning is wrong here
    assert "no last checkpoint" not in output
    # one version, one continued line: what the killed run logged after its checkpoint was purged and logged again
    assert version_dirs(killed / "runs") == [version]
    assert len(list(version.glob("events.out.tfevents.*"))) == 2
    expected, got = read_series([straight / "runs"]), read_series([killed / "runs"])
    assert list(got) == ["runs"]
    for tag in ("train/loss", "rollout/reward_mean", "train/kl", "train/grad_norm"):
        assert [s for s, _ in got["runs"][tag]] == list(range(7)), tag
        assert got["runs"][tag] == expected["runs"][tag], tag
    assert any(value != 0.0 for _, value in got["runs"]["train/loss"])  # the comparison can fail
    assert sorted(p.name for p in (version / "checkpoints").glob("*.ckpt")) == ["epoch=0-step=6.ckpt", "last.ckpt"]


def _touch(path: Path, mtime: float) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(b"")
    os.utime(path, (mtime, mtime))
    return path


def test_last_is_the_newest_checkpoint_over_every_version_and_a_link_counts_as_its_target(tmp_path):
    now = time.time()
    root = tmp_path / "runs" / "tb"
    _touch(root / "version_0" / "checkpoints" / "epoch=0-step=9.ckpt", now - 100)
    newest = _touch(root / "version_1" / "checkpoints" / "epoch=0-step=3.ckpt", now - 10)
    (root / "version_1" / "checkpoints" / "last.ckpt").symlink_to(newest.name)
    (root / "version_2" / "checkpoints").mkdir(parents=True)
    (root / "version_2" / "checkpoints" / "last.ckpt").symlink_to("gone.ckpt")  # killed between save and link
    folders = [root / "*" / "checkpoints"]
    assert latest_checkpoint(folders) == root / "version_1" / "checkpoints" / "last.ckpt"
    os.utime(root / "version_0" / "checkpoints" / "epoch=0-step=9.ckpt", (now, now))
    assert latest_checkpoint(folders) == root / "version_0" / "checkpoints" / "epoch=0-step=9.ckpt"
    assert latest_checkpoint([tmp_path / "none" / "*" / "checkpoints"]) is None


def test_the_folders_searched_follow_the_config_s_logger_and_checkpoint_callbacks(tmp_path):
    tb = "lightning.pytorch.loggers.TensorBoardLogger"
    checkpoint = "lightning.pytorch.callbacks.ModelCheckpoint"

    def trainer(**values: object) -> dict:
        return {"default_root_dir": str(tmp_path), **values}

    assert checkpoint_folders(trainer()) == [tmp_path / "lightning_logs" / "*" / "checkpoints"]
    assert checkpoint_folders(trainer(logger=False)) == [tmp_path / "checkpoints"]
    logger = {"class_path": tb, "init_args": {"save_dir": "runs/x", "name": "tensorboard"}}
    assert checkpoint_folders(trainer(logger=logger)) == [Path("runs/x/tensorboard/*/checkpoints")]
    unnamed = {"class_path": "lightning.pytorch.loggers.CSVLogger", "init_args": {"save_dir": "runs/y", "name": ""}}
    assert checkpoint_folders(trainer(logger=[unnamed, logger])) == [Path("runs/y/*/checkpoints")]
    callbacks = [{"class_path": checkpoint, "init_args": {"dirpath": "ckpts"}}, {"class_path": checkpoint}]
    assert checkpoint_folders(trainer(logger=logger, callbacks=callbacks)) == [Path("ckpts")]
    wandb = {"class_path": "lightning.pytorch.loggers.WandbLogger", "init_args": {"save_dir": "w", "project": "p"}}
    assert logger_folder(wandb, tmp_path) == (Path("w/p"), True)
    with pytest.raises(ValueError, match="ckpt_path 'last' with trainer.logger lightning.pytorch.loggers.MLFlowLogger"):
        logger_folder({"class_path": "lightning.pytorch.loggers.MLFlowLogger"}, tmp_path)


def test_the_first_step_a_resumed_run_logs_counts_the_batch_the_checkpoint_was_saved_at():
    def meta(stepped: int, processed: int, completed: int) -> dict:
        loop = {"epoch_loop.state_dict": {"_batches_that_stepped": stepped},
                "epoch_loop.batch_progress": {"total": {"processed": processed, "completed": completed}}}
        return {"loops": {"fit_loop": loop}}

    assert first_logged_step(meta(2, 3, 2)) == 3  # saved at the end of the third batch: it logs step 3 next
    assert first_logged_step(meta(3, 3, 3)) == 3  # saved between batches
    assert first_logged_step({}) == 0


@pytest.mark.parametrize("where", ["command line", "config"])
def test_ckpt_path_last_reads_the_newest_checkpoint_of_any_version(where, tmp_path, monkeypatch, capsys):
    # files that are not checkpoints: the one line that refuses the newest shows which one `last` resolved to
    _touch(tmp_path / VERSIONS / "version_0" / "checkpoints" / "last.ckpt", time.time() - 100)
    newest = _touch(tmp_path / VERSIONS / "version_1" / "checkpoints" / "epoch=0-step=2.ckpt", time.time())
    newest.write_bytes(b"not a checkpoint")
    (tmp_path / "resume.yaml").write_text("ckpt_path: last\n")
    extra = ["--ckpt_path", "last"] if where == "command line" else ["--config", str(tmp_path / "resume.yaml")]
    line = refusal_line(["fit", "--config", str(DEMO), *extra], tmp_path, monkeypatch, capsys)
    source = "on the command line" if where == "command line" else f"in {tmp_path / 'resume.yaml'}"
    assert line.startswith(f"error: checkpoint {newest.relative_to(tmp_path)} is not")
    assert line.endswith(f"(ckpt_path, {source})")


def test_only_the_data_module_s_loader_tells_lightning_it_is_resumable():
    from lightning.fabric.utilities.types import _Stateful

    from lit_grpo.data.prompt_order import PromptLoader, PromptStream

    owner = SimpleNamespace(batches_per_epoch=1, consumed=0)
    assert isinstance(PromptLoader(PromptStream(owner), batch_size=None), _Stateful)
    assert not isinstance(DataLoader(PromptStream(owner), batch_size=None), _Stateful)  # others are still warned
