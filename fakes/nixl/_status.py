"""Status codes, enums and the exception classes of NIXL's Python bindings.

Real NIXL raises one exception class per negative status, and the exception's text is only the status name
(``str(nixlNotFoundError)`` is ``'NIXL_ERR_NOT_FOUND'``); the explanation goes to the log.  The fake does the same:
:func:`fail` logs the real log line and raises the class whose name the real bindings use.
"""

from __future__ import annotations

import enum
import logging
from typing import NoReturn

log = logging.getLogger("epsim.fakes.nixl")


class _PyEnum(enum.IntEnum):
    """pybind11 enums print as ``nixl_mem_t.DRAM_SEG`` and compare equal to their ints."""

    def __str__(self) -> str:
        return f"{type(self).__name__}.{self.name}"

    def __repr__(self) -> str:
        return f"<{type(self).__name__}.{self.name}: {int(self)}>"


class nixl_mem_t(_PyEnum):
    DRAM_SEG = 0
    VRAM_SEG = 1
    BLK_SEG = 2
    OBJ_SEG = 3
    FILE_SEG = 4


class nixl_status_t(_PyEnum):
    NIXL_IN_PROG = 1
    NIXL_SUCCESS = 0
    NIXL_ERR_NOT_POSTED = -1
    NIXL_ERR_INVALID_PARAM = -2
    NIXL_ERR_BACKEND = -3
    NIXL_ERR_NOT_FOUND = -4
    NIXL_ERR_MISMATCH = -5
    NIXL_ERR_NOT_ALLOWED = -6
    NIXL_ERR_REPOST_ACTIVE = -7
    NIXL_ERR_UNKNOWN = -8
    NIXL_ERR_NOT_SUPPORTED = -9
    # 1.5.1's Python enum stops at -9; the C++ codes below exist only as exceptions.


class nixl_xfer_op_t(_PyEnum):
    NIXL_READ = 0
    NIXL_WRITE = 1


class nixl_thread_sync_t(_PyEnum):
    NIXL_THREAD_SYNC_NONE = 0
    NIXL_THREAD_SYNC_STRICT = 1
    NIXL_THREAD_SYNC_RW = 2
    NIXL_THREAD_SYNC_DEFAULT = 0  # an alias, as in the real enum


class nixl_cost_t(_PyEnum):
    NIXL_COST_ANALYTICAL_BACKEND = 0


class nixlNotPostedError(Exception):
    pass


class nixlInvalidParamError(Exception):
    pass


class nixlBackendError(Exception):
    pass


class nixlNotFoundError(Exception):
    pass


class nixlMismatchError(Exception):
    pass


class nixlNotAllowedError(Exception):
    pass


class nixlRepostActiveError(Exception):
    pass


class nixlUnknownError(Exception):
    pass


class nixlNotSupportedError(Exception):
    pass


class nixlRemoteDisconnectError(Exception):
    pass


class nixlCancelledError(Exception):
    pass


class nixlNoTelemetryError(Exception):
    pass


class SimulatedCrash(BaseException):
    """Where real NIXL 1.5.1 kills the process (SIGSEGV), the fake's ``dram`` profile raises this instead.

    It derives from ``BaseException`` so that code under test which catches ``Exception`` cannot swallow it: a
    crash must end a simulated run as a ``crash`` verdict, the way the real process would die.
    """

    def __init__(self, signal: str, why: str) -> None:
        super().__init__(f"{signal}: {why}")
        self.signal = signal
        self.why = why


# code -> (status name, exception class)
_BY_CODE: dict[int, tuple[str, type[Exception]]] = {
    -1: ("NIXL_ERR_NOT_POSTED", nixlNotPostedError),
    -2: ("NIXL_ERR_INVALID_PARAM", nixlInvalidParamError),
    -3: ("NIXL_ERR_BACKEND", nixlBackendError),
    -4: ("NIXL_ERR_NOT_FOUND", nixlNotFoundError),
    -5: ("NIXL_ERR_MISMATCH", nixlMismatchError),
    -6: ("NIXL_ERR_NOT_ALLOWED", nixlNotAllowedError),
    -7: ("NIXL_ERR_REPOST_ACTIVE", nixlRepostActiveError),
    -8: ("NIXL_ERR_UNKNOWN", nixlUnknownError),
    -9: ("NIXL_ERR_NOT_SUPPORTED", nixlNotSupportedError),
    -10: ("NIXL_ERR_REMOTE_DISCONNECT", nixlRemoteDisconnectError),
    -11: ("NIXL_ERR_CANCELED", nixlCancelledError),
    -12: ("NIXL_ERR_NO_TELEMETRY", nixlNoTelemetryError),
}

NOT_POSTED, INVALID_PARAM, BACKEND, NOT_FOUND, MISMATCH, NOT_ALLOWED = -1, -2, -3, -4, -5, -6
REPOST_ACTIVE, UNKNOWN, NOT_SUPPORTED, REMOTE_DISCONNECT, CANCELED, NO_TELEMETRY = -7, -8, -9, -10, -11, -12


def error(code: int, log_line: str | None = None) -> Exception:
    """The exception real NIXL raises for ``code``, after logging ``log_line`` as NIXL's C++ core would."""
    name, cls = _BY_CODE[code]
    if log_line:
        log.error(log_line)
    return cls(name)


def fail(code: int, log_line: str | None = None) -> NoReturn:
    raise error(code, log_line)


def name_of(code: int) -> str:
    return _BY_CODE[code][0]


NIXL_INIT_AGENT = ""
DEFAULT_COMM_PORT = 8888
