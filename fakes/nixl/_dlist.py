"""Descriptor lists: ``nixlRegDList`` (addr, len, devId, meta) and ``nixlXferDList`` (addr, len, devId).

Like the pybind11 originals they have no ``len()``; ``descCount()`` counts, items read back as tuples and ``meta``
reads back as bytes.  They pickle, so ``get_serialized_descs``/``deserialize_descs`` work across processes.
"""

from __future__ import annotations

import operator
from typing import Any

import numpy as np

from ._status import nixl_mem_t

_U64 = 1 << 64
_CAST = (
    "Unable to cast Python instance of type {} to C++ type '?' (#define PYBIND11_DETAILED_ERROR_MESSAGES or "
    "compile in debug mode for details)"
)


def _u64(value: Any) -> int:
    """A descriptor's address, length or device as pybind11 casts it to uint64_t: an int (or an object with
    ``__index__``, a numpy integer) in [0, 2^64).  A float (a stride computed with ``/``), a negative number or a
    larger one is refused with pybind11's RuntimeError, as 1.5.1 refuses it."""
    if type(value) is not int:
        if isinstance(value, float) or not hasattr(value, "__index__"):
            raise RuntimeError(_CAST.format(type(value)))
        value = operator.index(value)
    if 0 <= value < _U64:
        return value
    raise RuntimeError(_CAST.format(type(value)))


def _meta(value: Any) -> bytes:
    if isinstance(value, str):
        return value.encode()
    if isinstance(value, (bytes, bytearray)):
        return bytes(value)
    raise RuntimeError(_CAST.format(type(value)))


def _rows(array: Any) -> list:
    """The rows of an Nx3 numpy array as 1.5.1 reads them: 64-bit integers only, C order, as uint64."""
    if array.dtype not in (np.int64, np.uint64):
        raise ValueError("descs must be a Nx3 numpy array of uint64 or int64")
    if not array.flags.c_contiguous:
        raise ValueError("descs must be a C-contiguous numpy array")
    return array.astype(np.uint64, copy=False).tolist()  # a negative int64 wraps, as a reinterpreting read does


_MEM_TYPES = {int(m): m for m in nixl_mem_t}


def _mem_type(value: Any) -> nixl_mem_t:
    try:
        return _MEM_TYPES[int(value)]
    except KeyError:
        return nixl_mem_t(int(value))  # raises the enum's own ValueError


class _DList:
    _arity = 3

    def __init__(self, type: nixl_mem_t, descs: Any = 0) -> None:  # noqa: A002 - the real keyword is `type`
        self._type = _mem_type(type)
        self._descs: list[tuple] = []
        if descs.__class__ is not list:  # (the transfer path, every EPLB READ, has a list: skip two probes)
            if isinstance(descs, int):
                return  # (type, init_size): the size is a capacity hint only
            if hasattr(descs, "ndim"):  # numpy Nx3
                if descs.ndim != 2 or descs.shape[1] != 3:
                    raise ValueError("descs must be a 2D numpy array with 3 columns")
                for row in _rows(descs):
                    self._descs.append(self._make(tuple(row) + (b"",) * (self._arity - 3)))
                return
            # pybind11 takes a list, a numpy array or a size: a tuple of tuples matches no constructor
            raise TypeError(
                f"__init__(): incompatible constructor arguments; got {descs.__class__.__name__}, expected "
                "a list of tuples, an Nx3 numpy array or a size"
            )
        arity = self._arity
        for desc in descs:
            if not isinstance(desc, tuple) or len(desc) != arity:
                raise ValueError(f"Each descriptor tuple must have exactly {arity} elements")
        if arity == 3:  # the transfer path: one comprehension, no tuple built twice
            self._descs = [(_u64(a), _u64(n), _u64(d)) for a, n, d in descs]
        else:
            self._descs = [self._make(desc) for desc in descs]

    def _make(self, desc: tuple) -> tuple:
        addr, length, dev = _u64(desc[0]), _u64(desc[1]), _u64(desc[2])
        if self._arity == 4:
            return (addr, length, dev, _meta(desc[3]))
        return (addr, length, dev)

    # -- the pybind11 surface -------------------------------------------------------------------------------
    def getType(self) -> nixl_mem_t:
        return self._type

    def descCount(self) -> int:
        return len(self._descs)

    def isEmpty(self) -> bool:
        return not self._descs

    def __getitem__(self, i: int) -> tuple:
        return self._descs[i]

    def __setitem__(self, i: int, desc: tuple) -> None:
        self._descs[i] = self._make(desc)

    def addDesc(self, desc: tuple) -> None:
        self._descs.append(self._make(desc))

    append = addDesc

    def remDesc(self, i: int) -> None:
        del self._descs[i]

    def index(self, desc: tuple) -> int:
        key = tuple(_u64(x) for x in desc[:3])
        for i, d in enumerate(self._descs):
            if d[:3] == key:
                return i
        return -1

    def clear(self) -> None:
        self._descs.clear()

    def print(self) -> None:
        print(f"DescList of mem type {self._type.name}")
        for d in self._descs:
            print(f"    {d}")

    def __eq__(self, other: object) -> bool:
        return type(other) is type(self) and other._type == self._type and other._descs == self._descs

    __hash__ = None  # type: ignore[assignment]

    def __getstate__(self):
        return (int(self._type), list(self._descs))

    def __setstate__(self, state) -> None:
        self._type = nixl_mem_t(state[0])
        self._descs = [tuple(d) for d in state[1]]

    # -- helpers the fake agent uses --------------------------------------------------------------------------
    @classmethod
    def _of_triples(cls, type: nixl_mem_t, triples: list[tuple[int, int, int]]) -> _DList:  # noqa: A002
        """A list from (addr, len, dev) tuples of Python ints the fake made itself (nothing left to convert)."""
        out = cls.__new__(cls)
        out._type = _mem_type(type)
        out._descs = triples if cls._arity == 3 else [t + (b"",) for t in triples]
        return out

    def _triples(self) -> list[tuple[int, int, int]]:
        return list(self._descs) if self._arity == 3 else [d[:3] for d in self._descs]


class nixlXferDList(_DList):
    _arity = 3


class nixlRegDList(_DList):
    _arity = 4

    def trim(self) -> None:
        pass  # storage hint only


class nixlRemoteDList(_DList):
    """(addr, len, devId, agent name): descriptors for memory views of a remote agent."""

    _arity = 4
