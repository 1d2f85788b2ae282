"""Lines that third-party packages print on every run and that say nothing to this project's user, each dropped
where it is emitted (a logging filter on the one logger that writes it, matched by its text), so that every other
line of that logger still shows.

- Lightning (2.6) logs an advertisement for its hosted logger (``💡 Tip: ... litlogger ...``) at every
  ``Trainer`` construction that has no ``LitLogger``; it has no switch of its own.
- vLLM logs its whole engine configuration (several kilobytes on one line) when an engine starts; the colocated
  engine's options are the project's own (``VLLMEngine``), so the dump repeats what the run's config says. Only
  that record is dropped: vLLM's other lines (the KV cache size, its warnings) still show. ``vllm serve`` runs
  its engine in processes of its own, where ``VLLM_LOGGING_LEVEL=WARNING`` quiets it.
- Lightning 2.6 builds ``torch.utils._pytree.LeafSpec``, which torch 2.13 deprecated (a ``FutureWarning`` at each
  fit, addressed to Lightning): that one warning is filtered by its text.
"""

from __future__ import annotations

import logging
import warnings

#: the logger Lightning's ``rank_zero_info`` writes to, and a piece of the tip's text
LIGHTNING_RANK_ZERO_LOGGER = "lightning.pytorch.utilities.rank_zero"
LITLOGGER_TIP = "litlogger"
#: the logger of vLLM's engine core, and a piece of its configuration dump ("Initializing a V1 LLM engine (v...)
#: with config: ...")
VLLM_ENGINE_CORE_LOGGER = "vllm.v1.engine.core"
VLLM_CONFIG_DUMP = "LLM engine (v"


class DropMessages(logging.Filter):
    """Drops the records whose message contains one of ``pieces``."""

    def __init__(self, *pieces: str) -> None:
        super().__init__()
        self.pieces = pieces

    def filter(self, record: logging.LogRecord) -> bool:
        message = record.getMessage()
        return not any(piece in message for piece in self.pieces)


def drop_messages(logger_name: str, *pieces: str) -> None:
    """Drop ``logger_name``'s records containing one of ``pieces`` from now on (once per logger and pieces)."""
    logger = logging.getLogger(logger_name)
    if not any(isinstance(f, DropMessages) and f.pieces == pieces for f in logger.filters):
        logger.addFilter(DropMessages(*pieces))


#: torch's deprecation of the ``LeafSpec`` that Lightning's pytree helpers build
LIGHTNING_LEAFSPEC = r"`isinstance\(treespec, LeafSpec\)` is deprecated"


def quiet_lightning() -> None:
    """Drop Lightning's litlogger tip and torch's deprecation warning addressed to Lightning's pytree helpers."""
    drop_messages(LIGHTNING_RANK_ZERO_LOGGER, LITLOGGER_TIP)
    warnings.filterwarnings("ignore", message=LIGHTNING_LEAFSPEC, category=FutureWarning)


def quiet_vllm() -> None:
    """Drop vLLM's configuration dump at engine start (in this process)."""
    drop_messages(VLLM_ENGINE_CORE_LOGGER, VLLM_CONFIG_DUMP)
