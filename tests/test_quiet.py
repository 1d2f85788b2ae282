"""Third-party lines that say nothing to the user are dropped at their logger, by their text, and nothing else is:
Lightning's litlogger tip and the colocated vLLM engine's configuration dump (lit_grpo/core/quiet.py)."""

import logging
import sys
from pathlib import Path

import pytest
from lightning.pytorch import Trainer

from lit_grpo.core.quiet import LIGHTNING_RANK_ZERO_LOGGER, VLLM_ENGINE_CORE_LOGGER, quiet_lightning, quiet_vllm


class Recorder(logging.Handler):
    def __init__(self) -> None:
        super().__init__(logging.DEBUG)
        self.messages: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.messages.append(record.getMessage())


@pytest.fixture
def recorded():
    """A recorder on a logger whose filters are cleared (an earlier test may have quieted it), its level and
    filters put back after the test."""
    attached = []

    def attach(name: str) -> Recorder:
        logger = logging.getLogger(name)
        attached.append((logger, logger.level, list(logger.filters), recorder := Recorder()))
        logger.setLevel(logging.INFO)
        logger.filters.clear()
        logger.addHandler(recorder)
        return recorder

    yield attach
    for logger, level, filters, recorder in attached:
        logger.removeHandler(recorder)
        logger.setLevel(level)
        logger.filters[:] = filters


def test_the_litlogger_tip_is_dropped_and_lightning_s_other_lines_kept(recorded, tmp_path):
    recorder = recorded(LIGHTNING_RANK_ZERO_LOGGER)
    Trainer(logger=False, enable_progress_bar=False, enable_checkpointing=False, default_root_dir=tmp_path)
    assert any("litlogger" in m for m in recorder.messages)  # the tip is there to drop: the check can fail
    recorder.messages.clear()
    quiet_lightning()
    quiet_lightning()  # once is enough; twice adds no second filter
    Trainer(logger=False, enable_progress_bar=False, enable_checkpointing=False, default_root_dir=tmp_path)
    assert not any("litlogger" in m for m in recorder.messages)
    assert any("GPU available" in m for m in recorder.messages)
    assert len(logging.getLogger(LIGHTNING_RANK_ZERO_LOGGER).filters) == 1


def test_vllm_s_configuration_dump_is_dropped_and_its_other_lines_kept(recorded):
    recorder = recorded(VLLM_ENGINE_CORE_LOGGER)
    logger = logging.getLogger(VLLM_ENGINE_CORE_LOGGER)
    quiet_vllm()
    # vLLM's own format string (vllm/v1/engine/core.py)
    logger.info("Initializing a V1 LLM engine (v%s) with config: %s", "0.32.0", "model='tiny', " * 200)
    logger.info("init engine (profile, create kv cache, warmup model) took %.2f seconds", 1.5)
    assert recorder.messages == ["init engine (profile, create kv cache, warmup model) took 1.50 seconds"]


def test_torch_s_leafspec_deprecation_addressed_to_lightning_is_filtered():
    import warnings

    from lightning.pytorch.utilities._pytree import _tree_flatten

    def leafspec_warnings() -> list[str]:
        with warnings.catch_warnings(record=True) as caught:
            warnings.filterwarnings("always", category=FutureWarning, append=True)  # no once-per-place registry
            _tree_flatten(1)
        return [str(w.message) for w in caught if "LeafSpec" in str(w.message)]

    assert leafspec_warnings()  # the warning is there to filter: the check can fail
    quiet_lightning()
    assert leafspec_warnings() == []


#: a line of the project that warns (rank_zero_warn in RolloutDataModule.check_fit): its text is what Python's
#: default format echoes under the warning
PROJECT_WARNING_LINE = "rank_zero_warn(message)"


def project_warning_place() -> tuple[str, int]:
    import lit_grpo.data.datamodule as datamodule

    lines = Path(datamodule.__file__).read_text().splitlines()
    return datamodule.__file__, next(i for i, line in enumerate(lines, 1) if line.strip() == PROJECT_WARNING_LINE)


def pythons_own_printer():
    """``warnings._showwarnmsg_impl`` as a process starts with it (pytest's recorder replaces it during a test)."""
    import importlib.util

    spec = importlib.util.find_spec("warnings")
    fresh = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(fresh)
    return fresh._showwarnmsg_impl


def test_a_recorder_of_warnings_keeps_them():
    """``logging.captureWarnings``, or a test's ``catch_warnings(record=True)``, keeps getting the warnings: the
    one-line printer takes the place of Python's own printer only."""
    import warnings

    from lit_grpo.core.quiet import OneLineWarnings, one_line_warnings

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        one_line_warnings()
        assert not isinstance(warnings.showwarning, OneLineWarnings)
        warnings.warn("kept by the recorder", UserWarning, stacklevel=1)
    assert [str(w.message) for w in caught] == ["kept by the recorder"]


def warned_beside_a_bar(capfd, message: str, filename: str, lineno: int) -> str:
    """What stderr shows when a warning comes while a progress bar is drawn on stderr (with ``one_line_warnings``
    in place)."""
    import warnings

    from tqdm import tqdm

    from lit_grpo.core.quiet import one_line_warnings

    with warnings.catch_warnings():  # puts back the printer and the filters afterwards
        # as in a command-line process: Python's own printer, not pytest's recorder, shows warnings
        warnings._showwarnmsg_impl = pythons_own_printer()
        one_line_warnings()
        one_line_warnings()  # once is enough: twice wraps nothing twice
        bar = tqdm(total=3, desc="step", file=sys.stderr, ascii=True)
        bar.update(1)
        capfd.readouterr()
        warnings.simplefilter("always")
        warnings.warn_explicit(message, UserWarning, filename, lineno)
        bar.update(1)
        bar.close()
    return capfd.readouterr().err


def screen_lines(err: str) -> list[str]:
    """The lines a terminal keeps: what follows the last carriage return of each line."""
    return [line.rsplit("\r", 1)[-1] for line in err.split("\n")]


def test_a_project_warning_is_one_line_of_its_own_without_its_source_line(capfd):
    filename, lineno = project_warning_place()
    err = warned_beside_a_bar(capfd, "no callback keeps the engine in step", filename, lineno)
    assert "UserWarning: no callback keeps the engine in step" in screen_lines(err), err
    assert PROJECT_WARNING_LINE not in err and filename not in err


def test_another_package_s_warning_keeps_its_format_on_a_line_of_its_own(capfd):
    import lightning.pytorch.trainer.trainer as elsewhere

    err = warned_beside_a_bar(capfd, "a warning of Lightning's", elsewhere.__file__, 1)
    assert any(line.startswith(elsewhere.__file__) and line.endswith("a warning of Lightning's")
               for line in screen_lines(err)), err
