"""Third-party lines that say nothing to the user are dropped at their logger, by their text, and nothing else is:
Lightning's litlogger tip and the colocated vLLM engine's configuration dump (lit_grpo/core/quiet.py)."""

import logging

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
