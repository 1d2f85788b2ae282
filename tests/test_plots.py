"""``python -m lit_grpo plots``: one labelled line per version of a run folder, and a resumed version (event files
written with a ``purge_step``, as ``fit --ckpt_path last`` writes them) as one continued line."""

from __future__ import annotations

import time

import pytest
from torch.utils.tensorboard import SummaryWriter

from lit_grpo.cli.plots import main, read_scalars, read_series, runs_figure


def write(folder, values: dict[int, float], purge_step: int | None = None) -> None:  # noqa: ANN001
    writer = SummaryWriter(str(folder), purge_step=purge_step)
    for step, value in values.items():
        writer.add_scalar("train/loss", value, step)
    writer.close()
    time.sleep(1.1)  # event file names carry the second they were opened: the next one sorts after this one


def lines_by_label(figure) -> dict[str, list[tuple[float, float]]]:  # noqa: ANN001
    ax = next(a for a in figure.axes if a.get_title() == "train/loss")
    return {line.get_label(): list(zip(line.get_xdata(), line.get_ydata())) for line in ax.get_lines()}


def test_two_versions_of_a_run_are_two_labelled_lines(tmp_path):
    run = tmp_path / "demo"
    write(run / "tensorboard" / "version_0", {0: 1.0, 1: 2.0, 2: 3.0})
    write(run / "tensorboard" / "version_1", {0: 5.0, 1: 6.0})
    lines = lines_by_label(runs_figure([run], tags=("train/loss",)))
    assert lines == {"demo/tensorboard/version_0": [(0, 1.0), (1, 2.0), (2, 3.0)],
                     "demo/tensorboard/version_1": [(0, 5.0), (1, 6.0)]}
    other = tmp_path / "other"
    write(other / "version_0", {0: 7.0})
    lines = lines_by_label(runs_figure([run, other], tags=("train/loss",)))
    assert set(lines) == {"demo/tensorboard/version_0", "demo/tensorboard/version_1", "other"}  # one version: its run


def test_a_resumed_version_is_one_continued_line_without_what_the_stopped_run_logged_after_its_checkpoint(tmp_path):
    version = tmp_path / "run" / "version_0"
    write(version, {0: 1.0, 1: 2.0, 2: 30.0, 3: 40.0})  # killed after step 3; its checkpoint was at step 2
    write(version, {2: 3.0, 3: 4.0, 4: 5.0}, purge_step=2)  # the resumed run, from step 2
    expected = [(0, 1.0), (1, 2.0), (2, 3.0), (3, 4.0), (4, 5.0)]
    assert lines_by_label(runs_figure([tmp_path / "run"], tags=("train/loss",))) == {"run": expected}
    assert read_scalars(tmp_path / "run")["train/loss"] == expected
    assert read_series([version])["version_0"]["train/loss"] == expected


def test_the_command_writes_the_png(tmp_path, capsys):
    write(tmp_path / "run" / "version_0", {0: 1.0, 1: 0.5})
    main([str(tmp_path / "run"), "-o", str(tmp_path / "out.png"), "--tags", "train/loss"])
    assert capsys.readouterr().out.strip() == str(tmp_path / "out.png")
    assert (tmp_path / "out.png").stat().st_size > 1000
    with pytest.raises(ValueError, match="no TensorBoard event files under"):
        read_series([tmp_path / "empty"])
