"""The ``usp_dit`` logger, and console output that only rank 0 of a torchrun job prints.

    from usp_dit.distributed.logs import configure_logging, get_logger
    configure_logging()                  # once, at the start of a script (the examples do)
    get_logger("training").info("...")   # "usp_dit.training"

Every rank of a job runs the same code, so a notice or a warning would otherwise appear once per
rank. ``configure_logging`` keeps INFO and WARNING lines on rank 0 and only errors on the others:
for the ``usp_dit`` logger (and its children, e.g. the kernels' notices in ``usp_dit.kernels.policy``),
for Diffusers' and Transformers' loggers, and for Python ``warnings``, which are ignored on ranks > 0.
The library itself never configures logging; a script chooses to.
"""
from __future__ import annotations

import logging
import os
import sys
import warnings

LOGGER_NAME = "usp_dit"
# Libraries whose INFO/WARNING lines every rank would repeat word for word: quiet on ranks > 0.
PEER_QUIET_LOGGERS = (LOGGER_NAME, "diffusers", "transformers")
# Diffusers and Transformers set their loggers' level from these when they first configure them,
# which may be after configure_logging: the variables make that late setting agree.
_VERBOSITY_VARIABLES = ("DIFFUSERS_VERBOSITY", "TRANSFORMERS_VERBOSITY")
_HANDLER_MARK = "_usp_dit_handler"


def get_logger(name: str | None = None) -> logging.Logger:
    """The ``usp_dit`` logger, or its child ``usp_dit.<name>``."""
    return logging.getLogger(LOGGER_NAME if not name else f"{LOGGER_NAME}.{name}")


def env_rank() -> int:
    """This process's global rank from torchrun's ``RANK`` (0 without torchrun)."""
    return int(os.environ.get("RANK", "0"))


class _Formatter(logging.Formatter):
    """INFO as the bare message; other levels prefixed with the level; ranks > 0 name their rank."""

    def __init__(self, rank: int) -> None:
        super().__init__()
        self.rank = rank

    def format(self, record: logging.LogRecord) -> str:
        text = record.getMessage()
        if record.levelno != logging.INFO:
            text = f"{record.levelname.lower()}: {text}"
        if record.exc_info:
            text = f"{text}\n{self.formatException(record.exc_info)}"
        return text if self.rank == 0 else f"[rank {self.rank}] {text}"


def _install_handler(logger: logging.Logger, rank: int) -> None:
    """One stderr handler on ``logger`` (a second call replaces nothing and adds nothing)."""
    if any(getattr(h, _HANDLER_MARK, False) for h in logger.handlers):
        return
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(_Formatter(rank))
    setattr(handler, _HANDLER_MARK, True)
    logger.addHandler(handler)


def _quiet_peer() -> None:
    """Ranks > 0: errors only, from our logger, Diffusers' and Transformers', and no Python warnings."""
    for name in PEER_QUIET_LOGGERS:
        logging.getLogger(name).setLevel(logging.ERROR)
    for variable in _VERBOSITY_VARIABLES:
        os.environ[variable] = "error"
    warnings.filterwarnings("ignore")


def configure_logging(rank: int | None = None, level: int = logging.INFO) -> None:
    """Print ``usp_dit`` log lines to stderr: all from ``level`` up on rank 0, errors only on the others.

    ``rank`` defaults to torchrun's ``RANK`` (0 without torchrun), so it can run before the process
    group starts. Idempotent.
    """
    rank = env_rank() if rank is None else rank
    logger = logging.getLogger(LOGGER_NAME)
    _install_handler(logger, rank)
    if rank == 0:
        logger.setLevel(level)
    else:
        _quiet_peer()
