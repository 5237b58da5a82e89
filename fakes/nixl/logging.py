"""``nixl.logging``: NIXL's Python logging set-up (``get_logger``), for code that imports it beside ``nixl._api``.

As NIXL 1.5.1's (``fakes/conformance``, case ``logging_names``): the first ``get_logger`` sets the ``nixl`` logger up
(standard output at INFO, not propagated; ``NIXL_LOG_LEVEL`` = TRACE, DEBUG, INFO, WARN, ERROR or FATAL overrides the
level; ``NIXL_DEBUG_LOGGING`` = true/1/yes turns ``logging.raiseExceptions`` on, anything else off), and
``get_logger(name)`` is ``nixl.`` + ``name`` without its leading underscores, whatever ``name`` is (``nixl.a``
gives ``nixl.nixl.a``).
"""

from __future__ import annotations

import logging
import os
import sys

_LEVELS = {
    "TRACE": logging.DEBUG,
    "DEBUG": logging.DEBUG,
    "INFO": logging.INFO,
    "WARN": logging.WARNING,
    "ERROR": logging.ERROR,
    "FATAL": logging.CRITICAL,
}
_configured = False


def set_log_level_by_env(nixl_logger: logging.Logger) -> None:
    """``nixl_logger`` at the level ``NIXL_LOG_LEVEL`` names, if it names one (a warning if not)."""
    wanted = os.environ.get("NIXL_LOG_LEVEL")
    if not wanted:
        return
    level = _LEVELS.get(wanted.upper())
    if level is None:
        nixl_logger.warning("Invalid NIXL_LOG_LEVEL value '%s'. Using configuration default.", wanted)
    else:
        nixl_logger.setLevel(level)


def setup_logging() -> None:
    global _configured
    if _configured:
        return
    root = logging.getLogger("nixl")
    handler = logging.StreamHandler(sys.stdout)
    handler.setLevel(logging.INFO)
    handler.setFormatter(
        logging.Formatter("%(asctime)s NIXL %(levelname)-7s %(filename)s:%(lineno)d %(message)s", "%Y-%m-%d %H:%M:%S")
    )
    root.handlers[:] = [handler]
    root.propagate = False
    root.setLevel(logging.INFO)
    set_log_level_by_env(root)
    logging.raiseExceptions = os.environ.get("NIXL_DEBUG_LOGGING", "").lower() in ("true", "1", "yes")
    _configured = True


def get_logger(name: str) -> logging.Logger:
    """The logger ``nixl.<name without leading underscores>``."""
    setup_logging()
    return logging.getLogger("nixl." + name.lstrip("_"))
