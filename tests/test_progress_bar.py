"""The command line's default progress bar counts optimizer steps out of ``trainer.max_steps`` (a GRPO fit is
step-based: Lightning's epoch bar read ``Epoch 0/-2``), and gives way to a bar of the user's or to
``enable_progress_bar: false``; a fit's output carries neither transformers' ``past_key_values`` deprecation nor
Lightning's litlogger tip, nor the logger's version in the bar, nor the model summary's FLOPs (0: Lightning counts them
over an example input)."""

import re
import sys
from pathlib import Path

from lightning.pytorch.callbacks import RichProgressBar, TQDMProgressBar

from lit_grpo.cli.progress import StepProgressBar, default_progress_bar
from lit_grpo.engines import progress

ROOT = Path(__file__).resolve().parents[1]


def test_a_fit_shows_steps_out_of_max_steps_and_no_noise(tmp_path, monkeypatch, capfd):
    from lit_grpo.cli.lightning_cli import train

    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(sys, "argv", ["lit_grpo"])  # LightningCLI reads sys.argv too; keep pytest's out of it
    monkeypatch.setattr(progress, "INTERVAL_S", 0.0)  # every decode step reported: these generations are short
    cli = train(["fit", "--config", str(ROOT / "configs" / "demo_cpu.yaml"), "--model.model_name", "tiny-random-llama",
                 "--trainer.max_steps", "3", "--trainer.logger", "lightning.pytorch.loggers.CSVLogger",
                 "--trainer.logger.save_dir", str(tmp_path), "--trainer.callbacks", "[]",
                 "--trainer.enable_checkpointing", "false", "--eval.at_start", "false", "--eval.at_end", "false",
                 "--data.prompts_per_step", "2", "--data.num_generations", "2", "--data.micro_batch_size", "4",
                 "--data.max_new_tokens", "4"])
    bar = cli.trainer.progress_bar_callback
    assert isinstance(bar, StepProgressBar)
    assert bar.train_progress_bar.total == 3
    assert bar.train_progress_bar.n == cli.trainer.global_step == 3
    assert bar.train_progress_bar.desc.startswith("step")
    captured = capfd.readouterr()
    assert "Epoch 0/" not in captured.out + captured.err
    assert "past_key_values" not in captured.err
    assert "litlogger" not in captured.out + captured.err
    # the bar shows the run's numbers, not the logger's version (v_num)
    postfix = bar.get_metrics(cli.trainer, cli.model)
    assert "reward" in postfix and "v_num" not in postfix
    assert "v_num" not in captured.out + captured.err
    # the model summary is printed, without Lightning's FLOPs: counted over an example input that a GRPO module has
    # none of, they read 0 (the update's FLOPs are logged as train/update_flops)
    assert "Total params" in captured.out + captured.err
    assert "FLOPs" not in captured.out + captured.err
    # while a batch's rollouts are sampled, the bar says how far the generation is (2 prompts x 2 completions)
    shown = [int(done) for done in re.findall(r"step \(generating: (\d)/4 sequences, \d+ tokens\)", captured.out)]
    assert shown and all(0 <= done < 4 for done in shown)
    assert bar.train_progress_bar.desc == "step"  # and no longer once it is done
    assert not progress._listeners  # the bar stopped listening at the end of the fit


def test_a_slow_step_shows_seconds_per_step_not_zero_steps_per_second():
    from tqdm import tqdm

    line = tqdm.format_meter(1, 150, 420.0, bar_format=StepProgressBar.BAR_FORMAT, prefix="step")
    assert "420.00s/it" in line and "0.00it/s" not in line
    assert "2.00it/s" in tqdm.format_meter(2, 150, 1.0, bar_format=StepProgressBar.BAR_FORMAT, prefix="step")


def test_a_generation_reports_at_most_once_per_interval_and_only_to_listeners(monkeypatch):
    reports = []
    silent = progress.Reporter(4, interval_s=0.0)
    silent.update(1, lambda: 1 / 0)  # nobody listens: the token count is not even asked for
    stop = progress.listen(reports.append)
    try:
        reporter = progress.Reporter(4, interval_s=0.0)
        reporter.update(1, lambda: 7)
        reporter.update(3, lambda: 20)
        reporter.done(lambda: 25)
        throttled = progress.Reporter(4, interval_s=3600.0)
        throttled.update(2, lambda: 9)
        throttled.done(lambda: 10)  # nothing was shown: nothing to clear
    finally:
        stop()
    assert [(r.sequences_done, r.sequences, r.tokens) for r in reports] == [(1, 4, 7), (3, 4, 20), (4, 4, 25)]
    assert not progress._listeners


def test_the_default_bar_gives_way_to_a_given_bar_or_to_none():
    assert isinstance(default_progress_bar({}, []), StepProgressBar)
    assert isinstance(default_progress_bar({"enable_progress_bar": None, "callbacks": None}, []), StepProgressBar)
    assert default_progress_bar({"enable_progress_bar": False}, []) is None
    assert default_progress_bar({"callbacks": [TQDMProgressBar(refresh_rate=5)]}, []) is None
    assert default_progress_bar({"callbacks": RichProgressBar()}, []) is None
    assert default_progress_bar({}, [TQDMProgressBar()]) is None


def test_a_remote_generation_reports_answered_requests_and_the_time_while_waiting(monkeypatch):
    """The remote engines' wait (``progress.wait_reporting``): reports while a slow request is still out, each
    request's sequences and tokens once it is answered, the results in the requests' order."""
    import threading
    from concurrent.futures import ThreadPoolExecutor

    monkeypatch.setattr(progress, "INTERVAL_S", 0.02)
    reports = []
    stop = progress.listen(reports.append)
    release = threading.Event()

    def answer(tokens: int, slow: bool) -> list[list[int]]:
        if slow:
            release.wait(5)
        return [[0] * tokens, [0] * tokens]  # two sequences

    try:
        with ThreadPoolExecutor(2) as pool:
            futures = [pool.submit(answer, 3, True), pool.submit(answer, 5, False)]
            threading.Timer(0.2, release.set).start()
            results = progress.wait_reporting(futures, 4, lambda seqs: (len(seqs), sum(map(len, seqs))))
    finally:
        stop()
    assert [len(r[0]) for r in results] == [3, 5]
    waiting = [r for r in reports if r.sequences_done == 2]
    assert waiting and all(r.tokens == 10 for r in waiting)  # the fast request answered, the slow one out
    assert len({round(r.seconds, 2) for r in waiting}) > 1  # the time moves while nothing else does
    assert reports[-1].sequences_done == 4 and reports[-1].tokens == 16
