"""Drop-in for ``nixl._bindings`` (the pybind11 module of NIXL 1.5.1): the same names, values and exceptions."""

from functools import wraps as _wraps

from ._agent import AgentCore as nixlAgent
from ._agent import nixlAgentConfig
from ._dlist import nixlRegDList, nixlRemoteDList, nixlXferDList
from ._status import (
    DEFAULT_COMM_PORT,
    NIXL_INIT_AGENT,
    SimulatedCrash,
    nixl_cost_t,
    nixl_mem_t,
    nixl_status_t,
    nixl_thread_sync_t,
    nixl_xfer_op_t,
    nixlBackendError,
    nixlCancelledError,
    nixlInvalidParamError,
    nixlMismatchError,
    nixlNoTelemetryError,
    nixlNotAllowedError,
    nixlNotFoundError,
    nixlNotPostedError,
    nixlNotSupportedError,
    nixlRemoteDisconnectError,
    nixlRepostActiveError,
    nixlUnknownError,
)
from ._xfer import nixlXferTelemetry

DRAM_SEG, VRAM_SEG, BLK_SEG, OBJ_SEG, FILE_SEG = (
    nixl_mem_t.DRAM_SEG,
    nixl_mem_t.VRAM_SEG,
    nixl_mem_t.BLK_SEG,
    nixl_mem_t.OBJ_SEG,
    nixl_mem_t.FILE_SEG,
)
NIXL_READ, NIXL_WRITE = nixl_xfer_op_t.NIXL_READ, nixl_xfer_op_t.NIXL_WRITE
NIXL_IN_PROG, NIXL_SUCCESS = nixl_status_t.NIXL_IN_PROG, nixl_status_t.NIXL_SUCCESS
NIXL_ERR_NOT_POSTED = nixl_status_t.NIXL_ERR_NOT_POSTED
NIXL_ERR_INVALID_PARAM = nixl_status_t.NIXL_ERR_INVALID_PARAM
NIXL_ERR_BACKEND = nixl_status_t.NIXL_ERR_BACKEND
NIXL_ERR_NOT_FOUND = nixl_status_t.NIXL_ERR_NOT_FOUND
NIXL_ERR_MISMATCH = nixl_status_t.NIXL_ERR_MISMATCH
NIXL_ERR_NOT_ALLOWED = nixl_status_t.NIXL_ERR_NOT_ALLOWED
NIXL_ERR_REPOST_ACTIVE = nixl_status_t.NIXL_ERR_REPOST_ACTIVE
NIXL_ERR_UNKNOWN = nixl_status_t.NIXL_ERR_UNKNOWN
NIXL_ERR_NOT_SUPPORTED = nixl_status_t.NIXL_ERR_NOT_SUPPORTED
NIXL_THREAD_SYNC_NONE = nixl_thread_sync_t.NIXL_THREAD_SYNC_NONE
NIXL_THREAD_SYNC_STRICT = nixl_thread_sync_t.NIXL_THREAD_SYNC_STRICT
NIXL_THREAD_SYNC_RW = nixl_thread_sync_t.NIXL_THREAD_SYNC_RW
NIXL_THREAD_SYNC_DEFAULT = nixl_thread_sync_t.NIXL_THREAD_SYNC_DEFAULT
NIXL_COST_ANALYTICAL_BACKEND = nixl_cost_t.NIXL_COST_ANALYTICAL_BACKEND
HAVE_UCX_GPU_DEVICE_API = False  # the fake has no device-side API (prep_mem_view raises nixlBackendError)


def _agent_name(value, call: str) -> str:
    """An agent name as pybind11 hands it to a ``std::string`` parameter of 1.5.1: a str (its UTF-8), or bytes or a
    bytearray (their raw bytes; ``add_remote_agent`` returns bytes, and clients pass that on); anything else, and a
    str that has no UTF-8 form, matches no overload (TypeError).  Raw bytes that are not UTF-8 stay distinct from
    every str name (surrogateescape)."""
    if isinstance(value, str):
        if value.__class__ is not str or not value.isascii():
            try:
                value.encode()
            except UnicodeEncodeError:
                raise TypeError(
                    f"{call}(): incompatible function arguments: the name {value!r} has no UTF-8 form"
                ) from None
            value = str.__str__(value)
        return value
    if isinstance(value, (bytes, bytearray)):
        return bytes(value).decode("utf-8", "surrogateescape")
    raise TypeError(
        f"{call}(): incompatible function arguments: an agent name is str or bytes, not {type(value).__name__}"
    )


def _takes_name(method, index: int, keyword: str):
    """``method`` with its name argument (positional ``index``, or ``keyword``) converted by :func:`_agent_name`."""
    call = method.__name__

    @_wraps(method)
    def converted(self, *args, **kw):
        if len(args) > index:
            name = args[index]
            if name.__class__ is not str or not name.isascii():  # a plain ASCII str (every EPLB call) is as given
                args = (*args[:index], _agent_name(name, call), *args[index + 1 :])
        elif keyword in kw:
            kw[keyword] = _agent_name(kw[keyword], call)
        return method(self, *args, **kw)

    converted.__takes_name__ = True  # type: ignore[attr-defined]  # a mark read back by getattr below
    return converted


# Every call of the fake core that takes an agent name, and where: converted here, once, as pybind11 converts
# them before 1.5.1 sees them (the core's own peers, requests and events then hold str names only).
_NAME_ARGS = {
    "__init__": (0, "name"),
    "makeConnection": (0, "name"),
    "prepXferDlist": (0, "agent_name"),
    "createXferReq": (3, "remote_agent"),
    "genNotif": (0, "name"),
    "invalidateRemoteMD": (0, "name"),
    "checkRemoteMD": (0, "name"),
    "fetchRemoteMD": (0, "remote_agent"),
}
for _call, (_index, _keyword) in _NAME_ARGS.items():
    _method = getattr(nixlAgent, _call)
    if not getattr(_method, "__takes_name__", False):
        setattr(nixlAgent, _call, _takes_name(_method, _index, _keyword))

__all__ = [name for name in dir() if not name.startswith("_") and name != "SimulatedCrash"]
