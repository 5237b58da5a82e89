"""A drop-in for ``deep_ep.Buffer`` (v1 API) inside the simulation: lifecycle, collective semantics and real
dispatch/combine math on CPU tensors.

Facts reproduced (``docs/deep-ep-fake.md``; the faults in ``docs/reference/deep-ep.md``): the constructor's exchanges
(device ids, IPC handles, and for RDMA or low-latency mode an NVSHMEM unique id) over the group, then the collective
``sync`` that makes the buffer AVAILABLE; NVSHMEM only for RDMA or LL (the intranode high-throughput path never touches
it); ``destroy()`` asserts ``explicitly_destroy``, is collective, finalizes NVSHMEM, and leaves ``runtime`` None so any
later call raises ``AttributeError``; the destructor runs the collective destroy when the flag is off and only warns
(LEAKED) when it is on; low-latency calls alternate two buffers, so every rank must issue the same sequence;
``clean_low_latency_buffer`` is collective and required after high-throughput use before LL; a handle is layout data
that any buffer of the EP size that made it takes (DeepEP v1.2.1's sources).  A collective some rank never reaches fails
the others as DeepEP does (:class:`DeepEPTimeout`).

Experts are split contiguously: rank ``r`` holds experts ``[r*E/R, (r+1)*E/R)``.  Tokens arrive ordered by source
rank, then token index (the real kernels' order is not specified; the counts and the combined result are).
"""

from __future__ import annotations

import contextlib
import math
import sys
import weakref
from dataclasses import dataclass
from typing import Any, Callable, Optional

import torch

from fakes import torch_dist

from . import _nvshmem
from ._team import DeepEPTimeout, Team

NUM_MAX_NVL_PEERS = 8
NUM_MAX_RDMA_PEERS = 20
NUM_BUFFER_ALIGNMENT_BYTES = 128
# The recommended configs of DeepEP v1.2.1's get_dispatch_config / get_combine_config (deep_ep/buffer.py), for the
# few EP sizes it has one for: EP size -> num_max_nvl_chunked_recv_tokens (the same in both maps).
CONFIG_NVL_RECV_TOKENS = {2: 256, 4: 256, 8: 256, 16: 288, 24: 288, 32: 288, 64: 288, 128: 560, 144: 720, 160: 720}
CONFIG_EP_SIZES = frozenset(CONFIG_NVL_RECV_TOKENS)
# The NVLink rank counts the intranode kernels are built for (SWITCH_RANKS in csrc/kernels/launch.cuh): dispatch,
# combine, and the barrier that destroy() runs.
NVL_KERNEL_RANKS = frozenset({2, 4, 8})
# The hidden sizes the low-latency kernels are built for (SWITCH_HIDDEN in csrc/kernels/launch.cuh).
LL_HIDDEN_SIZES = frozenset({2048, 2560, 4096, 5120, 6144, 7168, 8192})
CONSTRUCTING, AVAILABLE, DESTROYING, DESTROYED, LEAKED, POISONED = (
    "CONSTRUCTING",
    "AVAILABLE",
    "DESTROYING",
    "DESTROYED",
    "LEAKED",
    "POISONED",
)
# Keyed by the objects themselves (weakly), never by id(): an id is reused once its object is gone.
# kernel -> {pid: the team of the low-latency buffer (above 8 ranks) that holds the process's sub-RDMA team}
_static_team_owner: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


_console_quiet = 0  # > 0 while a simulation holds the console (see quiet_console)


def _printf(text: str) -> None:
    """What DeepEP's C++ ``printf``s: to stdout, flushed.  A simulated run quiets it, since it must not land in the
    simulator's own output (``--json`` on stdout) and the run's history records the same event."""
    if not _console_quiet:
        print(text, file=sys.stdout, flush=True)


@contextlib.contextmanager
def quiet_console():
    """Inside the block, the fake's console lines (the destructor's leak warning) are dropped."""
    global _console_quiet
    _console_quiet += 1
    try:
        yield
    finally:
        _console_quiet -= 1


def quiet_console_for_good() -> None:
    """From now on (a process about to exit, whose leaked buffers are finalized at interpreter shutdown)."""
    global _console_quiet
    _console_quiet += 1


class EventOverlap:
    """DeepEP's event wrapper; CPU tensors complete at once."""

    def __init__(self, event: Any = None, extra_tensors: Any = None) -> None:
        self.event, self.extra_tensors = event, extra_tensors

    def current_stream_wait(self) -> None:
        pass

    def __enter__(self) -> EventOverlap:
        return self

    def __exit__(self, *exc: Any) -> None:
        pass


@dataclass(frozen=True)
class _Handle:
    """What dispatch returns for combine: layout data only (DeepEP's handles are tensors and sizes), so it fits any
    buffer of the EP size that made it."""

    team: int  # the buffer that made it (for messages; combine does not check it)
    ep_size: int
    rank: int
    low_latency: bool
    layout: Any  # HT: per source rank, the token indices received; LL: per local expert, (src rank, token) pairs
    num_tokens: int  # tokens this rank dispatched
    max_tokens: int = 0  # LL: num_max_dispatch_tokens_per_rank of the dispatch
    num_experts: int = 0  # LL


class _Runtime:
    """Stands for the C++ object: ``runtime`` is None after destroy, and every call then fails as DeepEP's do."""


def _per_group(rdv: Any, what: str) -> dict:
    """State of one group's buffers, kept on its rendezvous so that it dies with it.  (Module-level weak-key
    dictionaries keyed by the rendezvous kept every DeepEP run's simulated world alive: a team references the
    kernel, and the kernel, through its threads, the rendezvous.)"""
    return rdv.__dict__.setdefault(f"_deep_ep_{what}", {})


class Buffer:
    num_sms: int = 20

    def __init__(
        self,
        group: Any = None,
        num_nvl_bytes: int = 0,
        num_rdma_bytes: int = 0,
        low_latency_mode: bool = False,
        num_qps_per_rank: int = 24,
        allow_nvlink_for_low_latency_mode: bool = True,
        allow_mnnvl: bool = False,
        use_fabric: bool = False,
        explicitly_destroy: bool = False,
        enable_shrink: bool = False,
        comm: Any = None,
    ) -> None:
        self.state = CONSTRUCTING
        self.runtime: Optional[_Runtime] = None
        self.explicitly_destroy = explicitly_destroy
        if comm is not None:
            raise NotImplementedError("the fake DeepEP takes a (fake) torch ProcessGroup, not an mpi4py communicator")
        if not isinstance(group, torch_dist.FakeProcessGroup):
            raise TypeError(
                "the fake DeepEP Buffer needs a fake process group (fakes.torch_dist) inside the simulation"
            )
        self.group = group
        self.rank, self.group_size = group.rank(), group.size()
        rdv = group.rendezvous
        self._kernel = rdv.kernel
        self._pid = rdv.pids[self.rank]
        self.num_nvl_bytes, self.num_rdma_bytes = int(num_nvl_bytes), int(num_rdma_bytes)
        self.low_latency_mode = bool(low_latency_mode)
        self.num_qps_per_rank = num_qps_per_rank
        self.enable_shrink = enable_shrink
        # The C++ constructor's own checks, before anything is exchanged (EP_HOST_ASSERT: a RuntimeError).
        n = self.group_size
        for ok, cond in (
            (self.num_nvl_bytes % NUM_BUFFER_ALIGNMENT_BYTES == 0, "num_nvl_bytes % NUM_BUFFER_ALIGNMENT_BYTES == 0"),
            (self.num_rdma_bytes % NUM_BUFFER_ALIGNMENT_BYTES == 0, "num_rdma_bytes % NUM_BUFFER_ALIGNMENT_BYTES == 0"),
            (
                n <= NUM_MAX_NVL_PEERS * NUM_MAX_RDMA_PEERS or self.low_latency_mode,
                "num_ranks <= NUM_MAX_NVL_PEERS * NUM_MAX_RDMA_PEERS or low_latency_mode",
            ),
            (
                n < NUM_MAX_NVL_PEERS or n % NUM_MAX_NVL_PEERS == 0,
                "num_ranks < NUM_MAX_NVL_PEERS or num_ranks % NUM_MAX_NVL_PEERS == 0",
            ),
            (
                self.num_rdma_bytes == 0 or n > NUM_MAX_NVL_PEERS or self.low_latency_mode,
                "num_rdma_bytes == 0 or num_ranks > NUM_MAX_NVL_PEERS or low_latency_mode",
            ),
        ):
            if not ok:
                self.state = POISONED  # never AVAILABLE: its destructor has nothing to tear down
                raise RuntimeError(
                    f"Failed: Assertion error csrc/deep_ep.cpp: '{cond}' (group of {n} ranks, "
                    f"num_nvl_bytes={self.num_nvl_bytes}, num_rdma_bytes={self.num_rdma_bytes})"
                )
        self._ll_parity = 0
        self._needs_clean = False
        self._nvshmem: _nvshmem.World | None = None
        self._nvshmem_size: int | None = None

        # The C++ constructor is local; then device ids and IPC handles are exchanged over the group.
        made = _per_group(rdv, "created")  # rank -> buffers made on this group
        k = made.get(self.rank, 0)
        made[self.rank] = k + 1
        teams = _per_group(rdv, "teams")  # k -> the team of the group's k-th buffers
        team = teams.get(k)
        if team is None:
            team = teams[k] = Team(self._kernel, rdv.pids, f"{rdv.name}/deep_ep#{k}")
        device_ids: list[Any] = [None] * self.group_size
        torch_dist.all_gather_object(device_ids, self._pid, group=group)
        handles: list[Any] = [None] * self.group_size
        torch_dist.all_gather_object(handles, team.id, group=group)
        if len(set(handles)) != 1:
            raise RuntimeError(f"DeepEP: ranks of {rdv.name} opened different buffers' IPC handles: {handles}")
        self._team = Team.open(handles[0])
        if self.low_latency_mode or self.group_size > NUM_MAX_NVL_PEERS:  # DeepEP: RDMA ranks > 1 or low latency
            uid: list[Any] = [None] * self.group_size
            torch_dist.all_gather_object(uid, (self._team.id, k) if self.rank == 0 else None, group=group)
            if self.uses_nvshmem:
                self._join_nvshmem(uid[0])
        # runtime.sync: open the peers' handles, (NVSHMEM) align, then barriers.  Collective.
        self.runtime = _Runtime()
        self._meet("sync", None, lambda xs: [None] * len(xs), device_side=True, holds_gil=self.uses_nvshmem)
        self.state = AVAILABLE
        self._kernel.history.record(
            "deep_ep.buffer",
            pid=self._pid,
            team=self._team.name,
            size=self.group_size,
            nvshmem=self._nvshmem_size,
            low_latency=self.low_latency_mode,
        )

    # -- NVSHMEM -------------------------------------------------------------------------------------------------
    @property
    def uses_nvshmem(self) -> bool:
        """The C++ runtime joins NVSHMEM only with RDMA bytes (the unique id is exchanged for any low-latency buffer
        or group above 8 ranks; the constructor refuses RDMA bytes without either)."""
        return self.num_rdma_bytes > 0

    def _join_nvshmem(self, uid: Any) -> None:
        worlds = _nvshmem.worlds(self._kernel)
        world = worlds.of(self._pid)
        effective = world.init(self.group_size, uid, worlds.profile)
        self._nvshmem, self._nvshmem_size = world, effective
        if self.low_latency_mode and self.group_size > NUM_MAX_NVL_PEERS:
            # The process-wide sub-RDMA team is reset only by finalize (destroy): a buffer that leaked (dropped
            # with explicitly_destroy=True) or trapped still holds it, alive or not.
            owners = _static_team_owner.setdefault(self._kernel, {})
            holder = owners.get(self._pid)
            if holder is not None:
                raise RuntimeError(
                    f"Assertion error: cpu_rdma_team == NVSHMEM_TEAM_INVALID (a second low-latency "
                    f"buffer above 8 ranks while {holder} still holds the team: never destroyed)"
                )
            owners[self._pid] = self._team.name
        if effective != self.group_size:
            # The old world is in effect (still alive, or reused after finalize): nvshmem_align is collective over it,
            # and the new group's ranks never meet.
            why = (
                "a buffer of the old world is still alive: the second init only bumped its count and ignored the "
                "new size"
                if world.init_count > 1
                else "the old world was reused: stock NVSHMEM does not reset its bootstrap on finalize"
            )
            self._kernel.sleep(100.0, "nvshmem_align across mismatched worlds")
            self.state = POISONED
            raise DeepEPTimeout(
                f"nvshmem_align hangs: NVSHMEM was initialised for {effective} ranks and this "
                f"buffer's group has {self.group_size} ({why})",
                [],
            )

    # -- helpers ---------------------------------------------------------------------------------------------------
    def _live(self, what: str) -> None:
        if self.runtime is None:
            raise AttributeError(f"'NoneType' object has no attribute '{what}'")
        if self.state == POISONED:
            raise RuntimeError("CUDA error: unspecified launch failure (a device-side trap left a sticky error)")

    def _meet(
        self,
        kind: str,
        payload: Any,
        combine: Callable[[list[Any]], list[Any]],
        parity: int | None = None,
        device_side: bool = False,
        holds_gil: bool = False,
    ) -> Any:
        """A collective call: see :meth:`Team.meet`.  ``holds_gil`` for the C++ calls that wait for the peers with
        the GIL held (v1.2.1's bindings release it only in ``internode_dispatch``): ``destroy()``'s barrier, the
        intranode dispatch's receive-count spin, NVSHMEM's initialization in ``sync``."""
        try:
            return self._team.meet(
                self.rank, kind, payload, combine, parity=parity, device_side=device_side, holds_gil=holds_gil
            )
        except DeepEPTimeout:
            if device_side:
                self.state = POISONED
            raise

    @property
    def _experts_per_rank(self) -> Callable[[int], int]:
        return lambda num_experts: num_experts // self.group_size

    def _check_handle(self, handle: _Handle, low_latency: bool) -> None:
        """A handle is plain layout data (DeepEP: tensors and sizes), so any buffer of the same EP size takes it; one
        from another EP size fails the kernels' shape assertions."""
        if not isinstance(handle, _Handle) or handle.low_latency != low_latency:
            raise TypeError("handle must be the one dispatch returned")
        if handle.ep_size != self.group_size or handle.rank != self.rank:
            raise RuntimeError(
                f"Assertion error: handle from another buffer (EP size {handle.ep_size}, this buffer {self.group_size})"
            )

    # -- local calls ------------------------------------------------------------------------------------------------
    @staticmethod
    def set_num_sms(new_num_sms: int) -> None:
        assert new_num_sms % 2 == 0, "The SM count must be even"
        Buffer.num_sms = new_num_sms

    @staticmethod
    def get_low_latency_rdma_size_hint(
        num_max_dispatch_tokens_per_rank: int, hidden: int, num_ranks: int, num_experts: int
    ) -> int:
        """DeepEP's ``get_low_latency_rdma_size_hint``: the ``LowLatencyLayout`` bytes, plus one alignment unit
        (DeepEP rounds ``(bytes + 128) / 128``, so an aligned total gains 128)."""
        total = _ll_layout_bytes(num_max_dispatch_tokens_per_rank, hidden, num_experts)
        return (total + NUM_BUFFER_ALIGNMENT_BYTES) // NUM_BUFFER_ALIGNMENT_BYTES * NUM_BUFFER_ALIGNMENT_BYTES

    def get_local_device_id(self) -> int:
        self._live("get_local_device_id")
        return 0

    def get_comm_stream(self) -> Any:
        self._live("get_comm_stream")
        return None

    def get_dispatch_layout(
        self,
        topk_idx: torch.Tensor,
        num_experts: int,
        previous_event: Any = None,
        async_finish: bool = False,
        allocate_on_comm_stream: bool = False,
    ):
        """(num_tokens_per_rank, num_tokens_per_rdma_rank, num_tokens_per_expert, is_token_in_rank, event): local."""
        self._live("get_dispatch_layout")
        per = num_experts // self.group_size
        valid = topk_idx >= 0
        owner = torch.where(valid, topk_idx // per, torch.full_like(topk_idx, -1))
        is_token_in_rank = torch.zeros(topk_idx.shape[0], self.group_size, dtype=torch.bool)
        for r in range(self.group_size):
            is_token_in_rank[:, r] = (owner == r).any(dim=1)
        num_tokens_per_rank = is_token_in_rank.sum(dim=0).to(torch.int32)
        num_tokens_per_expert = torch.bincount(topk_idx[valid].flatten(), minlength=num_experts).to(torch.int32)
        rdma = None
        if self.group_size > NUM_MAX_NVL_PEERS:
            nodes = math.ceil(self.group_size / NUM_MAX_NVL_PEERS)
            rdma = torch.stack([is_token_in_rank[:, n * 8 : (n + 1) * 8].any(dim=1).sum() for n in range(nodes)])
            rdma = rdma.to(torch.int32)
        return num_tokens_per_rank, rdma, num_tokens_per_expert, is_token_in_rank, EventOverlap()

    # -- high-throughput dispatch and combine (collective) --------------------------------------------------------
    def _check_config(self, config: Any) -> None:
        """Without a ``config``, DeepEP takes its recommended one for the EP size, and has one for a few sizes only
        (an elastic EP that grows to, say, 3 or 72 ranks asserts at its first high-throughput dispatch)."""
        if config is None:
            assert self.group_size in CONFIG_EP_SIZES, f"Unsupported number of EP ranks: {self.group_size}"

    def _nvl_kernel_ranks(self, where: str) -> None:
        """The intranode kernels (notify, dispatch, combine, and the barrier that ``destroy()`` runs) are built for 2,
        4 or 8 NVLink ranks: any other count asserts before the kernel is launched."""
        nvl_ranks = min(self.group_size, NUM_MAX_NVL_PEERS)
        if nvl_ranks not in NVL_KERNEL_RANKS:
            raise RuntimeError(
                f"Failed: Assertion error {where}: 'false and \"Unsupported ranks\"' ({nvl_ranks} NVLink ranks)"
            )

    def _nvl_fits(self, what: str, config: Any, per_token: int, fixed: int, prefix: int = 0) -> None:
        """The intranode kernels' host assertion that their queues fit the NVLink buffer: ``prefix`` bytes, ``fixed``
        bytes per channel and rank, and ``per_token`` bytes for each of the ``num_max_nvl_chunked_recv_tokens`` a
        channel queues per rank (csrc/deep_ep.cpp; ``num_sms / 2`` channels).  A buffer sized too small for the rows
        it carries is refused at the first dispatch, whatever the tokens sent."""
        if self.group_size > NUM_MAX_NVL_PEERS:
            return  # the internode kernels size their queues differently: not modelled
        # (a config of the caller's without these fields is read as the recommended one)
        sms = getattr(config, "num_sms", Buffer.num_sms)
        recv_tokens = getattr(
            config, "num_max_nvl_chunked_recv_tokens", CONFIG_NVL_RECV_TOKENS.get(self.group_size, 256)
        )
        channels, ranks = sms // 2, self.group_size
        need = prefix + channels * ranks * (fixed + recv_tokens * per_token)
        _assert(
            need <= self.num_nvl_bytes,
            f"{what} queues <= num_nvl_bytes",
            f"{channels} channels x {ranks} ranks x {recv_tokens} tokens need {need} bytes, the buffer has "
            f"{self.num_nvl_bytes}",
        )

    def dispatch(
        self,
        x: Any,
        handle: Optional[_Handle] = None,
        num_tokens_per_rank: Any = None,
        num_tokens_per_rdma_rank: Any = None,
        is_token_in_rank: Any = None,
        num_tokens_per_expert: Any = None,
        topk_idx: Optional[torch.Tensor] = None,
        topk_weights: Optional[torch.Tensor] = None,
        expert_alignment: int = 1,
        num_worst_tokens: int = 0,
        config: Any = None,
        previous_event: Any = None,
        async_finish: bool = False,
        allocate_on_comm_stream: bool = False,
    ):
        """(recv_x, recv_topk_idx, recv_topk_weights, num_recv_tokens_per_expert_list, handle, event)."""
        self._live("intranode_dispatch")
        self._check_config(config)
        if handle is not None:
            self._check_handle(handle, low_latency=False)
            raise NotImplementedError("cached re-dispatch with a handle is not modelled by the fake DeepEP")
        if topk_idx is None or is_token_in_rank is None or num_tokens_per_expert is None:
            raise ValueError(
                "dispatch needs topk_idx, is_token_in_rank and num_tokens_per_expert (from get_dispatch_layout)"
            )
        num_experts = int(num_tokens_per_expert.numel())
        ranks = self.group_size
        _assert(
            ranks * (ranks + num_experts // ranks) * 4 <= self.num_nvl_bytes,
            "num_ranks * (num_ranks + num_local_experts) * sizeof(int) <= num_nvl_bytes",
            f"{self.num_nvl_bytes} bytes",
        )
        self._nvl_kernel_ranks("csrc/kernels/intranode.cu")
        topk = int(topk_idx.shape[1])
        # the rank-by-rank size prefix; per channel and rank: start and end offsets, queue head and tail; per queued
        # token: the row, its source index, its top-k indices (int64) and weights (float)
        self._nvl_fits(
            "dispatch", config, int(x.shape[1]) * x.element_size() + 4 + topk * 12, 4 * 4, prefix=ranks * ranks * 4
        )
        mine = (
            x.detach().clone(),
            topk_idx.clone(),
            None if topk_weights is None else topk_weights.clone(),
            is_token_in_rank.clone(),
        )
        rank, per = self.rank, num_experts // self.group_size

        def route(payloads: list[Any]) -> list[Any]:
            out = []
            for dst in range(len(payloads)):
                rows, idx, weights, layout = [], [], [], []
                for sx, sidx, sw, sin in payloads:
                    tokens = torch.nonzero(sin[:, dst], as_tuple=False).flatten()
                    layout.append(tokens)
                    rows.append(sx[tokens])
                    local = sidx[tokens]
                    inside = (local >= dst * per) & (local < (dst + 1) * per)
                    idx.append(torch.where(inside, local - dst * per, torch.full_like(local, -1)))
                    if sw is not None:
                        weights.append(torch.where(inside, sw[tokens], torch.zeros_like(sw[tokens])))
                out.append((torch.cat(rows), torch.cat(idx), torch.cat(weights) if weights else None, layout))
            return out

        recv_x, recv_idx, recv_w, layout = self._meet("dispatch", mine, route, holds_gil=True)
        self._needs_clean = self.low_latency_mode
        counts = [int((recv_idx == e).sum()) for e in range(per)]
        counts = [((c + expert_alignment - 1) // expert_alignment) * expert_alignment for c in counts]
        new_handle = _Handle(self._team.id, self.group_size, rank, False, layout, int(x.shape[0]))
        return recv_x, recv_idx, recv_w, counts, new_handle, EventOverlap()

    def combine(
        self,
        x: torch.Tensor,
        handle: _Handle,
        topk_weights: Optional[torch.Tensor] = None,
        bias: Any = None,
        config: Any = None,
        previous_event: Any = None,
        async_finish: bool = False,
        allocate_on_comm_stream: bool = False,
    ):
        """(combined_x, combined_topk_weights, event): every rank's rows for a token summed back at its source."""
        self._live("intranode_combine")
        self._check_config(config)
        self._check_handle(handle, low_latency=False)
        if x.dtype != torch.bfloat16:  # the intranode combine kernel is built for bf16 alone (SWITCH_TYPES)
            raise RuntimeError(
                "Failed: Assertion error csrc/kernels/intranode.cu: 'false and \"Unsupported type\"' "
                f"(combine of {x.dtype})"
            )
        self._nvl_kernel_ranks("csrc/kernels/intranode.cu")
        topk = 0 if topk_weights is None else int(topk_weights.shape[1])
        # per channel and rank: queue head and tail; per queued token: the row, its source index, its top-k weights
        self._nvl_fits("combine", config, int(x.shape[1]) * x.element_size() + 4 + topk * 4, 2 * 4)
        mine = (
            x.detach().clone(),
            None if topk_weights is None else topk_weights.clone(),
            handle.layout,
            handle.num_tokens,
        )

        def reduce(payloads: list[Any]) -> list[Any]:
            hidden = payloads[0][0].shape[1:]
            sums = [torch.zeros((p[3],) + tuple(hidden), dtype=payloads[0][0].dtype) for p in payloads]
            wsums: list[Any] = [None] * len(payloads)
            for rows, w, layout, _ in payloads:
                start = 0
                for src, tokens in enumerate(layout):
                    n = int(tokens.numel())
                    sums[src].index_add_(0, tokens, rows[start : start + n])
                    if w is not None:
                        if wsums[src] is None:
                            wsums[src] = torch.zeros((payloads[src][3], w.shape[1]), dtype=w.dtype)
                        wsums[src].index_add_(0, tokens, w[start : start + n])
                    start += n
            return list(zip(sums, wsums))

        combined, weights = self._meet("combine", mine, reduce)
        self._needs_clean = self.low_latency_mode
        if bias is not None:
            for b in bias if isinstance(bias, (tuple, list)) else (bias,):
                if b is not None:
                    combined = combined + b
        return combined, weights, EventOverlap()

    # -- low-latency dispatch and combine (collective, double-buffered) --------------------------------------------
    def _ll_checks(self, what: str, hidden: int, max_tokens: int, num_experts: int) -> None:
        """The host assertions a low-latency call makes before it flips the double-buffer parity."""
        self._live(what)
        if not self.low_latency_mode:
            raise RuntimeError("Assertion error: low_latency_mode must be enabled for low-latency kernels")
        _assert(hidden % 128 == 0, "x.size(1) % sizeof(int4) == 0 and x.size(1) % 128 == 0", f"hidden {hidden}")
        _assert(
            num_experts % self.group_size == 0,
            "num_experts % num_ranks == 0",
            f"{num_experts} experts over {self.group_size} ranks",
        )
        need = _ll_layout_bytes(max_tokens, hidden, num_experts)
        _assert(
            need <= self.num_rdma_bytes,
            "layout.total_bytes <= num_rdma_bytes",
            f"the layout needs {need} bytes, the buffer has {self.num_rdma_bytes}",
        )

    def _ll_turn(self, what: str, async_finish: bool, return_recv_hook: bool, hidden: int) -> int:
        """Flip the parity, then the assertions DeepEP makes after the flip (a refused call has flipped it too), and
        the stale flags of high-throughput use."""
        parity = self._ll_parity
        self._ll_parity ^= 1
        _no_async_with_hook(async_finish, return_recv_hook)
        _assert(
            hidden in LL_HIDDEN_SIZES,
            'false and "Unsupported hidden"',
            f"hidden {hidden}; the kernels are built for {sorted(LL_HIDDEN_SIZES)}",
        )
        if self._needs_clean:
            # Flags left by high-throughput use: the LL kernels wait for counts that never come, then trap.
            self._kernel.sleep(100.0, f"{what}: stale flags (no clean_low_latency_buffer after HT use)")
            self.state = POISONED
            raise DeepEPTimeout(
                f"device barrier trapped (sticky CUDA error): {what} found flags of high-throughput "
                "use; clean_low_latency_buffer was not called",
                [],
            )
        return parity

    def low_latency_dispatch(
        self,
        x: torch.Tensor,
        topk_idx: torch.Tensor,
        num_max_dispatch_tokens_per_rank: int,
        num_experts: int,
        cumulative_local_expert_recv_stats: Any = None,
        dispatch_wait_recv_cost_stats: Any = None,
        use_fp8: bool = True,
        round_scale: bool = False,
        use_ue8m0: bool = False,
        async_finish: bool = False,
        return_recv_hook: bool = False,
    ):
        """(recv_x, recv_count, handle, event, hook): ``recv_x`` is ``[local experts, ranks * max tokens, hidden]``
        (with ``use_fp8``, a pair of FP8 data and per-128-channel scales)."""
        self._ll_checks("low_latency_dispatch", int(x.shape[-1]), num_max_dispatch_tokens_per_rank, num_experts)
        _assert(
            x.dim() == 2 and x.dtype == torch.bfloat16,
            "x.dim() == 2 and x.is_contiguous() and x.scalar_type() == torch::kBFloat16",
            f"x is {x.dtype} of {x.dim()} dims",
        )
        _assert(topk_idx.dtype == torch.int64, "topk_idx.scalar_type() == torch::kInt64", str(topk_idx.dtype))
        _assert(
            x.shape[0] <= num_max_dispatch_tokens_per_rank,
            "x.size(0) <= num_max_dispatch_tokens_per_rank",
            f"{x.shape[0]} tokens > {num_max_dispatch_tokens_per_rank}",
        )
        parity = self._ll_turn("low_latency_dispatch", async_finish, return_recv_hook, int(x.shape[1]))
        ranks, m = self.group_size, num_max_dispatch_tokens_per_rank
        per = num_experts // ranks
        mine = (x.detach().clone(), topk_idx.clone())

        def route(payloads: list[Any]) -> list[Any]:
            hidden = payloads[0][0].shape[1]
            out = []
            for dst in range(ranks):
                recv = torch.zeros(per, ranks * m, hidden, dtype=payloads[0][0].dtype)
                count = torch.zeros(per, dtype=torch.int32)
                layout: list[list[tuple[int, int]]] = [[] for _ in range(per)]
                for src, (sx, sidx) in enumerate(payloads):
                    for t in range(sx.shape[0]):
                        for e in sorted({int(v) for v in sidx[t].tolist() if v >= 0}):
                            if dst * per <= e < (dst + 1) * per:
                                le = e - dst * per
                                recv[le, int(count[le])] = sx[t]
                                count[le] += 1
                                layout[le].append((src, t))
                out.append((recv, count, layout))
            return out

        recv_x, count, layout = self._meet("low_latency_dispatch", mine, route, parity=parity, device_side=True)
        if cumulative_local_expert_recv_stats is not None:
            cumulative_local_expert_recv_stats += count.to(cumulative_local_expert_recv_stats.dtype)
        handle = _Handle(
            self._team.id,
            self.group_size,
            self.rank,
            True,
            layout,
            int(x.shape[0]),
            num_max_dispatch_tokens_per_rank,
            num_experts,
        )
        if use_fp8:
            recv_x = _to_fp8(recv_x)
        if not return_recv_hook:
            return recv_x, count, handle, EventOverlap(), None
        # Only the send half has run: the tokens land in the receive buffer when the caller runs the hook.
        arrived = (recv_x, count)
        recv_x = tuple(_not_yet(t) for t in recv_x) if isinstance(recv_x, tuple) else _not_yet(recv_x)
        count = torch.zeros_like(count)
        return recv_x, count, handle, EventOverlap(), _receive_hook((recv_x, count), arrived)

    def low_latency_combine(
        self,
        x: torch.Tensor,
        topk_idx: torch.Tensor,
        topk_weights: torch.Tensor,
        handle: _Handle,
        use_logfmt: bool = False,
        zero_copy: bool = False,
        async_finish: bool = False,
        return_recv_hook: bool = False,
        out: Any = None,
    ):
        """(combined_x, event, hook): ``combined_x[t] = sum_k topk_weights[t, k] * x[expert k's row for t]``."""
        self._check_handle(handle, low_latency=True)
        self._ll_checks("low_latency_combine", int(x.shape[-1]), handle.max_tokens, handle.num_experts)
        _assert(
            x.dim() == 3 and x.dtype == torch.bfloat16,
            "x.dim() == 3 and x.is_contiguous() and x.scalar_type() == torch::kBFloat16",
            f"x is {x.dtype} of {x.dim()} dims",
        )
        _assert(
            x.shape[0] == handle.num_experts // self.group_size and x.shape[1] == self.group_size * handle.max_tokens,
            "x.size(0) == num_experts / num_ranks and x.size(1) == num_ranks * num_max_dispatch_tokens_per_rank",
            f"x is {list(x.shape)}",
        )
        _assert(
            topk_weights.dtype == torch.float32,
            "topk_weights.scalar_type() == torch::kFloat32",
            str(topk_weights.dtype),
        )
        parity = self._ll_turn("low_latency_combine", async_finish, return_recv_hook, int(x.shape[2]))
        mine = (x.detach().clone(), handle.layout)
        ranks = self.group_size
        num_tokens, weights, idx = handle.num_tokens, topk_weights.clone(), topk_idx.clone()
        per = x.shape[0]

        def gather(payloads: list[Any]) -> list[Any]:
            # For each source rank: row of (expert, token) -> the expert output that rank computed
            rows: list[dict[tuple[int, int], torch.Tensor]] = [{} for _ in range(ranks)]
            for owner, (ox, layout) in enumerate(payloads):
                for le, pairs in enumerate(layout):
                    for slot, (src, t) in enumerate(pairs):
                        rows[src][(owner * per + le, t)] = ox[le, slot]
            return rows

        mine_rows = self._meet("low_latency_combine", mine, gather, parity=parity, device_side=True)
        combined = torch.zeros(num_tokens, x.shape[2], dtype=x.dtype)
        for t in range(num_tokens):
            for k in range(idx.shape[1]):
                e = int(idx[t, k])
                if e >= 0:
                    combined[t] += weights[t, k].to(x.dtype) * mine_rows[(e, t)]
        if not return_recv_hook:
            if out is not None:
                out.copy_(combined)
                combined = out
            return combined, EventOverlap(), None
        result = out if out is not None else torch.empty_like(combined)
        result.copy_(_not_yet(result))  # whatever the buffer held: not the combined tokens yet
        return result, EventOverlap(), _receive_hook((result,), (combined,))

    def clean_low_latency_buffer(self, num_max_dispatch_tokens_per_rank: int, hidden: int, num_experts: int) -> None:
        """Zero the LL buffers' flags: a device barrier before and after, so collective."""
        self._live("clean_low_latency_buffer")
        if not self.low_latency_mode:
            raise RuntimeError("Assertion error: low_latency_mode must be enabled for low-latency kernels")
        self._meet("clean_low_latency_buffer", None, lambda xs: [None] * len(xs), device_side=True)
        self._needs_clean = False

    # -- teardown -----------------------------------------------------------------------------------------------
    def destroy(self) -> None:
        assert self.explicitly_destroy, "`explicitly_destroy` flag must be set"
        self._live("destroy")
        self._destroy()

    def _destroy(self) -> None:
        """The C++ ``destroy()``: a device barrier over every rank, free, then (RDMA) NVSHMEM barrier and finalize.
        The barrier of an NVLink buffer is a kernel built for 2, 4 or 8 ranks: on any other count it asserts before
        anything is freed, and the buffer stays (its destructor then warns, with ``explicitly_destroy``)."""
        if self.num_nvl_bytes > 0:
            self._nvl_kernel_ranks("csrc/kernels/runtime.cu")
        self.state = DESTROYING
        self._meet("destroy", None, lambda xs: [None] * len(xs), device_side=True, holds_gil=True)
        if self._nvshmem is not None:
            self._nvshmem.finalize(_nvshmem.worlds(self._kernel).profile)
            self._nvshmem = None
            # internode::finalize resets the process's sub-RDMA team, whichever buffer held it.
            _static_team_owner.get(self._kernel, {}).pop(self._pid, None)
        self.runtime = None
        self.state = DESTROYED
        self._kernel.history.record("deep_ep.destroy", pid=self._pid, team=self._team.name)

    def __del__(self) -> None:
        state = getattr(self, "state", None)
        # A trapped buffer was never destroyed either: with the flag on, DeepEP's destructor warns about it too.
        # (One whose constructor asserted never existed on the C++ side: it has no team.)
        trapped = state == POISONED and getattr(self, "_team", None) is not None
        if state not in (AVAILABLE, CONSTRUCTING) and not (trapped and getattr(self, "explicitly_destroy", False)):
            return
        if getattr(self, "explicitly_destroy", False):
            self.state = LEAKED
            try:
                _printf("WARNING: destroy() was not called before DeepEP buffer destruction, which can leak resources.")
                self._kernel.history.record("deep_ep.leak", pid=self._pid, team=self._team.name)
            except Exception:  # noqa: BLE001 - a destructor never raises
                pass
            return
        # The default flag: the whole collective destroy runs here, wherever the collector runs the destructor.
        # Exceptions escape to Python's unraisable hook (the simulator reports them), as pybind's would terminate.
        kernel = getattr(self, "_kernel", None)
        if getattr(self, "_team", None) is None:
            # The constructor failed before the peers' IPC handles were opened: the C++ destroy's barrier runs on
            # pointers that were never set (DeepEP fault 7: an illegal address, or a hang).
            self.state = POISONED
            if kernel is not None:
                kernel.history.record("deep_ep.destroy_uninitialised", pid=self._pid)
            raise RuntimeError(
                "CUDA error: an illegal memory access was encountered (the destructor's barrier of a "
                "buffer whose constructor failed before the IPC handles were opened)"
            )
        if kernel is not None and kernel.current() is None:
            # After the simulation (its interpreter shutdown): no simulated thread can wait for the peers.  Real
            # DeepEP would run the barrier at exit and hang or fault if a peer is gone (DeepEP fault 2); here the
            # buffer is left behind and the history says so.
            self.state = LEAKED
            try:
                kernel.history.record("deep_ep.destroy_at_exit", pid=self._pid, team=self._team.name)
            except Exception:  # noqa: BLE001 - a destructor never raises
                pass
            return
        self._destroy()


def _assert(ok: bool, cond: str, detail: str) -> None:
    """DeepEP's ``EP_HOST_ASSERT``: a RuntimeError naming the condition."""
    if not ok:
        raise RuntimeError(f"Failed: Assertion error csrc/deep_ep.cpp: '{cond}' ({detail})")


def _ll_layout_bytes(max_tokens: int, hidden: int, num_experts: int) -> int:
    """The bytes of DeepEP's ``LowLatencyLayout`` (csrc/config.hpp): two (odd/even) sets of a send buffer, a receive
    buffer and a 128-byte-aligned signalling buffer, each sized for the larger of an FP8-or-BF16 dispatch message
    (a 16-byte header, then the row) and a BF16 combine message."""
    num_scales = hidden // 128
    _assert(num_scales * 4 <= hidden, "num_scales * sizeof(float) <= hidden", f"hidden {hidden}")
    dispatch_msg = 16 + max(hidden * 2, hidden + num_scales * 4)
    combine_msg = num_scales * 4 + hidden * 2
    send = max(max_tokens * dispatch_msg, num_experts * max_tokens * combine_msg)
    recv = num_experts * max_tokens * max(dispatch_msg, combine_msg)
    signal = -(-num_experts * 4 // NUM_BUFFER_ALIGNMENT_BYTES) * NUM_BUFFER_ALIGNMENT_BYTES
    return 2 * (send + recv + signal)


def _no_async_with_hook(async_finish: bool, return_recv_hook: bool) -> None:
    if async_finish and return_recv_hook:  # the C++ side's host assertion
        raise RuntimeError("Failed: Assertion error csrc/deep_ep.cpp: 'not (async and return_recv_hook)'")


def _not_yet(t: torch.Tensor) -> torch.Tensor:
    """A receive buffer whose tokens have not landed: NaN where a float can hold it (zeros otherwise), so that
    reading it before the hook shows."""
    return torch.full_like(t, float("nan")) if t.is_floating_point() else torch.zeros_like(t)


def _receive_hook(into: tuple, arrived: tuple) -> Callable[[], None]:
    """``return_recv_hook``: the receive half of the kernel, which the caller launches when it is ready; until then
    the returned buffers hold nothing of the call."""

    def hook() -> None:
        for dst, src in zip(into, arrived):
            if isinstance(dst, tuple):
                for d, s in zip(dst, src):
                    d.copy_(s)
            else:
                dst.copy_(src)

    return hook


def _to_fp8(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-128-channel FP8 (E4M3) data and float32 scales, as DeepEP's LL dispatch returns with ``use_fp8``."""
    hidden = x.shape[-1]
    if hidden % 128:
        raise RuntimeError("Assertion error: hidden must be a multiple of 128 for FP8 low-latency dispatch")
    blocks = x.float().reshape(*x.shape[:-1], hidden // 128, 128)
    amax = blocks.abs().amax(dim=-1).clamp(min=1e-4)
    scales = amax / 448.0
    data = (blocks / scales.unsqueeze(-1)).reshape(x.shape).to(torch.float8_e4m3fn)
    return data, scales
