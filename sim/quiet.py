"""Keeping the fakes' console output out of a command's output.

The fake NIXL logs every call it refuses, as the real one does on stderr, and the fake DeepEP prints its leak warning
on stdout, as the real one does.  Inside a run the history says what happened (:func:`during_a_run`); after a
command, communicators and buffers a run leaked (``gc.never``, a broken strategy) are finalized at interpreter exit,
where those lines would only be noise under its output (:func:`for_good`).  Light on purpose: the CLI and the sweep
workers import it before anything heavy.
"""

from __future__ import annotations

import contextlib
import logging
import sys
from typing import Iterator

FAKE_NIXL_LOGGER = "epsim.fakes.nixl"


@contextlib.contextmanager
def during_a_run() -> Iterator[None]:
    """Both fakes quiet while the block runs (as before it afterwards)."""
    from fakes.deep_ep.buffer import quiet_console

    log = logging.getLogger(FAKE_NIXL_LOGGER)
    saved = log.propagate, log.handlers[:]
    log.propagate, log.handlers = False, [logging.NullHandler()]
    try:
        with quiet_console():
            yield
    finally:
        log.propagate, log.handlers = saved


def for_good() -> None:
    """Both fakes quiet from now on (registered to run at exit)."""
    log = logging.getLogger(FAKE_NIXL_LOGGER)
    log.propagate, log.handlers = False, [logging.NullHandler()]
    deep_ep = sys.modules.get("fakes.deep_ep.buffer")  # only if a run used it: no imports at interpreter exit
    if deep_ep is not None:
        deep_ep.quiet_console_for_good()
