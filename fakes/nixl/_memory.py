"""Registration and the agent's own metadata.

Facts reproduced (docs/reference/nixl-1.5.1.md, facts 3-9, 11): no duplicate or overlap check (except in the
``rocm-strict`` profile); a batch is all-or-nothing; deregistration matches (devId, addr, len) exactly, ignores the meta
string, and removes nothing if any entry misses; metadata is deterministic and, on stable-key profiles, byte-identical
after a range is deregistered and registered again."""

from __future__ import annotations

import functools
import json
import weakref
from dataclasses import dataclass, field

from . import _status as S
from ._parts import AgentParts
from ._faults import STATUS_BY_NAME
from ._spans import SpanIndex
from ._dlist import nixlRegDList, nixlXferDList

MD_TAG = b"nixlSerDes|"


@dataclass(frozen=True)
class Region:
    """One registered range, as a peer sees it in metadata: (mem, addr, len, devId) and its remote key."""

    mem: int
    addr: int
    length: int
    dev: int
    key: int
    _hash: int = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        # Regions key the range indexes and are looked up twice per descriptor of every transfer: hash them once.
        object.__setattr__(self, "_hash", hash((self.mem, self.addr, self.length, self.dev, self.key)))

    def __hash__(self) -> int:
        return self._hash

    @property
    def end(self) -> int:
        return self.addr + self.length

    def covers(self, mem: int, addr: int, length: int, dev: int) -> bool:
        return mem == self.mem and dev == self.dev and self.addr <= addr and addr + length <= self.end

    def section(self) -> list[int]:
        return [self.mem, self.addr, self.length, self.dev, self.key]


_regions: weakref.WeakValueDictionary = weakref.WeakValueDictionary()


def region(mem: int, addr: int, length: int, dev: int, key: int) -> Region:
    """The one live Region with these values.  A peer's view of a registration (decoded from metadata) is then the
    very object the owner registered, and the per-descriptor "is it still registered?" lookups of every transfer
    compare by identity instead of field by field."""
    values = (mem, addr, length, dev, key)
    found = _regions.get(values)
    if found is None:
        found = _regions[values] = Region(*values)
    return found


def encode_md(name: str, conn: str | None, regions: list[Region]) -> bytes:
    # Sections are kept sorted, as NIXL's section descriptor lists are: metadata does not depend on the order in
    # which ranges were registered (re-registering one of several ranges gives byte-identical metadata).
    body = {"name": name, "conn": conn, "sections": sorted(r.section() for r in regions)}
    return MD_TAG + json.dumps(body, separators=(",", ":")).encode()


class SectionTable:
    """A peer's registrations as a loading agent knows them: (mem, addr, len, dev) -> Region, and a range index.

    Immutable, so that every agent that loads the same metadata shares one table; ``merged`` returns a new one.
    ``count`` is the number of sections in the metadata it was decoded from.
    """

    EMPTY: SectionTable

    __slots__ = ("sections", "index", "count")

    def __init__(self, sections: dict[tuple[int, int, int, int], Region], count: int) -> None:
        self.sections = sections
        self.count = count
        self.index = SpanIndex("nixl")  # a peer's registrations, looked up as NIXL looks them up
        for r in sections.values():
            self.index.add((r.mem, r.dev), r.addr, r.length, r)

    @classmethod
    def of(cls, regions: tuple[Region, ...]) -> SectionTable:
        sections: dict[tuple[int, int, int, int], Region] = {}
        for r in regions:  # a later duplicate replaces an earlier one, as a merge does
            sections[(r.mem, r.addr, r.length, r.dev)] = r
        return cls(sections, len(regions))

    def __len__(self) -> int:
        return len(self.sections)

    def rekeys(self, other: SectionTable) -> bool:
        """Does ``other`` give a known descriptor a new remote key?"""
        if other is self:  # the same metadata again: decoding is cached, so it is the very same table
            return False
        mine = self.sections
        return any((known := mine.get(k)) is not None and known.key != r.key for k, r in other.sections.items())

    def merged(self, other: SectionTable) -> SectionTable:
        """This table with ``other``'s sections added or re-keyed; never removes one (NIXL merges metadata)."""
        if not self.sections or other is self:
            return other
        mine = self.sections
        if all((known := mine.get(k)) is not None and known.key == r.key for k, r in other.sections.items()):
            return self  # the same metadata loaded again: a no-op
        return SectionTable({**mine, **other.sections}, self.count)


SectionTable.EMPTY = SectionTable({}, 0)


def decode_md(blob: bytes) -> tuple[str, str | None, SectionTable]:
    if not isinstance(blob, (bytes, bytearray)) or not bytes(blob).startswith(MD_TAG):
        S.fail(S.MISMATCH, "loadRemoteMD: failed to deserialize remote metadata")
    decoded = _decode(bytes(blob))
    if decoded is None:
        S.fail(S.MISMATCH, "loadRemoteMD: failed to deserialize remote metadata")
    return decoded


@functools.lru_cache(maxsize=4096)
def _decode(blob: bytes) -> tuple[str, str | None, SectionTable] | None:
    # Cached: in an EP group every rank loads every other rank's metadata, i.e. the same bytes N-1 times, and the
    # table built from them is shared by every loader.
    try:
        body = json.loads(blob[len(MD_TAG) :])
        return body["name"], body["conn"], SectionTable.of(tuple(region(*s) for s in body["sections"]))
    except (ValueError, KeyError, TypeError):
        return None


def _check_dlist(descs: object, cls: type, call: str) -> None:
    if not isinstance(descs, cls):
        raise TypeError(
            f"{call}(): incompatible function arguments. The following argument types are supported:\n"
            f"    1. (self: nixlAgent, descs: {cls.__name__}, backends: collections.abc.Sequence) -> None"
        )


class MemoryMixin(AgentParts):
    def _init_memory(self) -> None:
        self.regions: list[Region] = []  # in registration order: what metadata and deregistration see
        self.region_index = SpanIndex("nixl")  # the same regions, looked up as NIXL looks a descriptor up
        # Regions that a failed batch deregistration took out of the agent's loopback view only.  Real 1.5.1:
        # after deregister_memory([known, unknown]) raises NOT_FOUND, `known` is still registered, still in the
        # metadata and still usable as a local descriptor, but a loopback request naming it remotely is NOT_FOUND
        # until it is registered again.
        self.loopback_hidden: list[Region] = []

    def _key_for(self, mem: int, addr: int, length: int, dev: int) -> int:
        if self.fabric.profile.stable_keys:
            # cma and NVLink: the "key" is a function of the range, so re-registration changes nothing (fact 11).
            return (addr * 31 + length * 7 + dev * 3 + mem) & 0xFFFF_FFFF
        return self.fabric.new_id()

    def registerMem(self, descs: nixlRegDList, backends: list | None = None) -> S.nixl_status_t:
        self.fabric.host_time(self.fabric.time_model.register_s, "registering memory")
        self._enter()
        _check_dlist(descs, nixlRegDList, "registerMem")
        mem = descs.getType()
        self._refuse_posix_only(backends, "registerMem")
        if not self._has_backend_for(mem):
            S.fail(S.NOT_FOUND, f"registerMem: no available backends for mem type '{mem.name}'")
        profile = self.fabric.profile
        if mem == S.nixl_mem_t.VRAM_SEG and not profile.vram_ok:
            S.fail(
                S.BACKEND,
                f"nixlUcxContext {self.name}: VRAM memory is detected as host by UCX. UCX is likely "
                "not configured with CUDA/ROCm support. VRAM registration cannot proceed.",
            )
        fault = self.fabric.faults.take("register.fail", self.name, pid=self.pid)
        if fault is not None:
            S.fail(
                STATUS_BY_NAME[fault.params.get("error", "BACKEND")],
                "registerMem: registration failed for the specified or all potential backends "
                "(injected fault register.fail)",
            )
        triples = list(descs._triples())
        if not triples:  # 1.5.1 hands UCX nothing to register and reports its failure
            S.fail(
                S.BACKEND,
                "registerMem: registration failed for the specified or all potential backends (empty descriptor list)",
            )
        new = [region(int(mem), a, n, d, self._key_for(int(mem), a, n, d)) for a, n, d in triples]
        if profile.exclusive_pages:
            self._refuse_shared_pages(new)
        self.regions.extend(new)  # all or nothing: nothing above added anything
        for r in new:
            self.region_index.add((r.mem, r.dev), r.addr, r.length, r)
        self.loopback_hidden = [r for r in self.loopback_hidden if r not in new]
        self.fabric.emit(
            "register", agent=self.name, pid=self.pid, conn=self.conn, ranges=[(r.addr, r.length) for r in new]
        )
        return S.nixl_status_t.NIXL_SUCCESS

    def _refuse_shared_pages(self, new: list[Region]) -> None:
        # Byte ranges, not whole pages: allocators put unrelated small buffers on one page, and what was reported
        # on MI355 is registering the *same* memory again, not a neighbour.
        taken = [r for core in list(self.fabric.conns.values()) if core.pid == self.pid for r in core.regions]
        for r in new:
            for other in taken:
                if r.mem == other.mem and r.addr < other.end and other.addr < r.end:
                    S.fail(
                        S.BACKEND,
                        f"registerMem: [0x{r.addr:x}, 0x{r.end:x}) overlaps memory already "
                        "registered in this process (rocm-strict profile)",
                    )
            taken.append(r)

    def deregisterMem(self, descs: nixlRegDList, backends: list | None = None) -> S.nixl_status_t:
        self._enter()
        _check_dlist(descs, nixlRegDList, "deregisterMem")
        mem = int(descs.getType())
        triples = list(descs._triples())
        if len(set(triples)) != len(triples):
            # One list naming a range twice: 1.5.1 segfaults (on DRAM, whether the range was registered once or
            # twice, and for two tensors on the same storage); the hardened profiles refuse it instead.
            if self.fabric.profile.released_handle_use == "crash":
                raise S.SimulatedCrash(
                    "SIGSEGV", "deregisterMem: the same range twice in one list (real NIXL 1.5.1 segfaults)"
                )
            S.fail(S.INVALID_PARAM, "deregisterMem: the same range twice in one descriptor list")
        remaining = list(self.regions)
        matched: list[Region] = []
        for addr, length, dev in triples:
            for i, r in enumerate(remaining):
                if (r.mem, r.addr, r.length, r.dev) == (mem, addr, length, dev):
                    matched.append(remaining.pop(i))
                    break
            else:
                self.loopback_hidden.extend(matched)
                # Observers learn of the refused range (a second deregistration is how a double release shows).
                self.fabric.emit(
                    "deregister.refused", agent=self.name, pid=self.pid, conn=self.conn, ranges=[(addr, length)]
                )
                if not any(r.mem == mem for r in self.regions):
                    S.fail(S.NOT_FOUND, f"deregisterMem: no available backends for mem type '{S.nixl_mem_t(mem).name}'")
                S.fail(
                    S.NOT_FOUND,
                    "deregisterMem: deregistration failed on at least one backend with status NIXL_ERR_NOT_FOUND",
                )
        self.regions = remaining
        removed = matched
        for r in removed:
            self.region_index.remove(r)
        self.loopback_hidden = [r for r in self.loopback_hidden if r not in removed]
        self.fabric.emit(
            "deregister", agent=self.name, pid=self.pid, conn=self.conn, ranges=[(r.addr, r.length) for r in removed]
        )
        return S.nixl_status_t.NIXL_SUCCESS

    def getLocalMD(self) -> bytes:
        self._enter()
        return encode_md(self.name, self.conn, self.regions)

    def getLocalPartialMD(self, descs: nixlRegDList, inc_conn_info: bool, backends: list | None = None) -> bytes:
        self._enter()
        _check_dlist(descs, nixlRegDList, "getLocalPartialMD")
        mem = int(descs.getType())
        picked = []
        for addr, length, dev in descs._triples():
            match = [r for r in self.regions if (r.mem, r.addr, r.length, r.dev) == (mem, addr, length, dev)]
            if not match:
                S.fail(S.NOT_FOUND, "getLocalPartialMD: descriptor list contains unregistered memory")
            picked.append(match[0])
        return encode_md(self.name, self.conn if inc_conn_info else None, picked)

    def _local_region(self, mem: int, addr: int, length: int, dev: int) -> Region | None:
        return self.region_index.find((mem, dev), addr, length)

    def _loopback_region(self, mem: int, addr: int, length: int, dev: int) -> Region | None:
        return self.region_index.find((mem, dev), addr, length, skip=self.loopback_hidden or None)

    def _xfer_triples(self, descs: nixlXferDList, call: str) -> list[tuple[int, int, int]]:
        _check_dlist(descs, nixlXferDList, call)
        return descs._triples()
