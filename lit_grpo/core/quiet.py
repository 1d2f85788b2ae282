"""Lines that third-party packages print on every run and that say nothing to this project's user, each dropped
where it is emitted (a logging filter on the one logger that writes it, matched by its text), so that every other
line of that logger still shows.

- Lightning (2.6) logs an advertisement for its hosted logger (``💡 Tip: ... litlogger ...``) at every
  ``Trainer`` construction that has no ``LitLogger``; it has no switch of its own.
"""

from __future__ import annotations

import logging

#: the logger Lightning's ``rank_zero_info`` writes to, and a piece of the tip's text
LIGHTNING_RANK_ZERO_LOGGER = "lightning.pytorch.utilities.rank_zero"
LITLOGGER_TIP = "litlogger"


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


def quiet_lightning() -> None:
    """Drop Lightning's litlogger tip."""
    drop_messages(LIGHTNING_RANK_ZERO_LOGGER, LITLOGGER_TIP)
