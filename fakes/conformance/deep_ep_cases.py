"""The DeepEP behaviour catalogue: each case drives ``deep_ep.Buffer`` (the v1 API) on every rank of a group and
returns what each rank observed, as plain data, so that the fake (simulated ranks) and a real DeepEP (one process
per rank, sharing the visible GPUs) are judged by the same expectations.

An expectation is what DeepEP v1.2.1 does, read from its sources (``csrc/deep_ep.cpp``, ``csrc/config.hpp``,
``deep_ep/buffer.py``) and confirmed on a GPU where ``docs/deep-ep-fake.md`` says so.  A case never compares
numbers across worlds directly: it computes the single-process reference itself and reports whether the library's
result matched it, so that bf16 rounding on the GPU and float math on the fake give the same observation.

Cases use one or two ranks: what one GPU can hold (two processes share it for the intranode kernels, which need two
ranks or more; low-latency mode runs with one, as NVSHMEM places one rank per GPU).  What needs more GPUs is in
``docs/deep-ep-fake.md``'s table as not reached.
"""

from __future__ import annotations

import gc
from contextlib import AbstractContextManager
from dataclasses import dataclass
from typing import Any, Callable

import torch

from fakes.deep_ep.reference import expert, local_experts, matches, reference

from .catalogue import plain

# The hidden sizes DeepEP's low-latency kernels are compiled for (SWITCH_HIDDEN in csrc/kernels/launch.cuh).
HIDDEN_LL = 2048
# How long a late rank stays away in the cases that time a wait: long enough to tell from a call's own cost.
LATE_S = 2.0
# How often the second thread of the GIL cases counts: about twenty ticks in a wait of LATE_S if it runs.
TICK_S = 0.1


@dataclass
class Ctx:
    """What a case gets on each rank: the library, the group, and the world's clock."""

    Buffer: Any  # deep_ep.Buffer, real or fake
    group: Any
    rank: int
    n: int
    device: str  # "cuda" for a real DeepEP, "cpu" for the fake
    sleep: Callable[[float], None]  # the world's sleep (simulated seconds in the fake)
    now: Callable[[], float]
    printed: Callable[[], AbstractContextManager]  # captures what the library prints (DeepEP's C++ printf too)
    start_thread: Callable[[Callable[[], None]], Callable[[], None]]  # another thread of this rank; returns its join


@dataclass(frozen=True)
class DeepEPCase:
    name: str
    fn: Callable[[Ctx], Any]
    ranks: int
    expect: list  # one observation per rank
    doc: str


CASES: dict[str, DeepEPCase] = {}


def case(expect: Any, *, ranks: int, per_rank: bool = False) -> Callable:
    """Register a case; ``expect`` is every rank's observation, or (``per_rank``) a list of them in rank order."""

    def wrap(fn: Callable[[Ctx], Any]) -> Callable[[Ctx], Any]:
        each = list(expect) if per_rank else [expect] * ranks
        if len(each) != ranks:
            raise ValueError(f"case {fn.__name__}: {len(each)} expectations for {ranks} ranks")
        CASES[fn.__name__] = DeepEPCase(fn.__name__, fn, ranks, plain(each), (fn.__doc__ or "").strip())
        return fn

    return wrap


def judge(name: str, observed: list) -> dict[str, Any]:
    """pass or fail, with what was observed and expected."""
    c = CASES[name]
    observed = plain(observed)
    return {
        "name": name,
        "outcome": "pass" if observed == c.expect else "fail",
        "observed": observed,
        "expected": c.expect,
    }


# -- the MoE layer every case routes, and its single-process reference ------------------------------------------
def _inputs(ctx: Ctx, experts: int, hidden: int, tokens: int = 8, topk: int = 2, seed: int = 0):
    """Every rank's tokens, top-k ids (int64) and weights (float32), the same on every rank (seeded)."""
    gen = torch.Generator().manual_seed(seed)
    xs = [torch.randn(tokens, hidden, generator=gen).to(torch.bfloat16) for _ in range(ctx.n)]
    idxs = [torch.stack([torch.randperm(experts, generator=gen)[:topk] for _ in range(tokens)]) for _ in range(ctx.n)]
    ws = [torch.rand(tokens, topk, generator=gen) for _ in range(ctx.n)]
    return xs, idxs, ws


def _ht_round(
    ctx: Ctx, buf: Any, experts: int = 0, hidden: int = 256, seed: int = 0, handle_from: Any = None
) -> dict[str, bool]:
    """One high-throughput dispatch, each rank's experts, and combine (on ``handle_from``'s handle when given: a
    dispatch there, the combine on ``buf``): what matched the reference."""
    experts = experts or 2 * ctx.n
    per = experts // ctx.n
    xs, idxs, ws = _inputs(ctx, experts, hidden, seed=seed)
    x, idx, w = (t.to(ctx.device) for t in (xs[ctx.rank], idxs[ctx.rank], ws[ctx.rank]))
    via = handle_from if handle_from is not None else buf
    per_rank, _, per_expert, in_rank, _ = via.get_dispatch_layout(idx, experts)
    recv_x, recv_idx, recv_w, counts, handle, _ = via.dispatch(
        x,
        num_tokens_per_rank=per_rank,
        is_token_in_rank=in_rank,
        num_tokens_per_expert=per_expert,
        topk_idx=idx,
        topk_weights=w,
    )
    y = local_experts(recv_x.cpu(), recv_idx.cpu(), recv_w.cpu(), ctx.rank, per)
    combined, _, _ = buf.combine(y.to(ctx.device), handle)
    mine = range(ctx.rank * per, (ctx.rank + 1) * per)
    want_counts = [sum(int((i == e).sum()) for i in idxs) for e in mine]
    want_received = sum(int(any(int(e) in mine for e in row)) for i in idxs for row in i)
    return {
        "combined": matches(combined, reference(xs[ctx.rank].float(), idxs[ctx.rank], ws[ctx.rank])),
        "counts": [int(c) for c in counts] == want_counts,
        "received": int(recv_x.shape[0]) == want_received,
    }


HT_OK = {"combined": True, "counts": True, "received": True}
NVL_BYTES = 1 << 24


def _ht(ctx: Ctx, **kwargs: Any) -> Any:
    return ctx.Buffer(ctx.group, num_nvl_bytes=NVL_BYTES, **kwargs)


def _ll(
    ctx: Ctx, experts: int, max_tokens: int = 16, hidden: int = HIDDEN_LL, rdma_bytes: int | None = None, **kwargs: Any
) -> Any:
    """A low-latency buffer as vLLM's manager sizes it (the size hint)."""
    if rdma_bytes is None:
        rdma_bytes = ctx.Buffer.get_low_latency_rdma_size_hint(max_tokens, hidden, ctx.n, experts)
    return ctx.Buffer(
        ctx.group,
        num_nvl_bytes=0,
        num_rdma_bytes=rdma_bytes,
        low_latency_mode=True,
        num_qps_per_rank=max(1, experts // ctx.n),
        explicitly_destroy=True,
        **kwargs,
    )


def _ll_round(
    ctx: Ctx, buf: Any, experts: int, max_tokens: int = 16, hidden: int = HIDDEN_LL, seed: int = 0, hook: bool = False
) -> dict[str, bool]:
    """One low-latency dispatch (bf16), each rank's experts on the packed rows, and combine: what matched."""
    per = experts // ctx.n
    xs, idxs, ws = _inputs(ctx, experts, hidden, seed=seed)
    x, idx, w = (t.to(ctx.device) for t in (xs[ctx.rank], idxs[ctx.rank], ws[ctx.rank]))
    recv_x, count, handle, _, recv_hook = buf.low_latency_dispatch(
        x, idx, max_tokens, experts, use_fp8=False, return_recv_hook=hook
    )
    if hook:
        recv_hook()
    counts = [int(c) for c in count.cpu()]
    rx = recv_x.float().cpu()
    y = torch.zeros(rx.shape, dtype=torch.float32)
    for le in range(per):
        y[le, : counts[le]] = expert(ctx.rank * per + le, rx[le, : counts[le]])
    combined, _, combine_hook = buf.low_latency_combine(
        y.to(torch.bfloat16).to(ctx.device), idx, w, handle, return_recv_hook=hook
    )
    if hook:
        combine_hook()
    mine = range(ctx.rank * per, (ctx.rank + 1) * per)
    want_counts = [sum(int((i == e).sum()) for i in idxs) for e in mine]
    return {
        "combined": matches(combined, reference(xs[ctx.rank].float(), idxs[ctx.rank], ws[ctx.rank])),
        "counts": counts == want_counts,
    }


LL_OK = {"combined": True, "counts": True}


def _outcome(fn: Callable[[], Any]) -> str:
    """ "ok", or the class name of what the call raised (the observation of an assertion)."""
    try:
        fn()
    except Exception as exc:  # noqa: BLE001 - the type is the observation
        return type(exc).__name__
    return "ok"


def _timed(ctx: Ctx, fn: Callable[[], Any]) -> float:
    started = ctx.now()
    fn()
    return ctx.now() - started


def _late_then(ctx: Ctx, fn: Callable[[], Any]) -> dict[str, bool]:
    """Rank 0 calls ``fn`` at once, the others ``LATE_S`` later: whether each rank's call waited for the late ones."""
    if ctx.rank:
        ctx.sleep(LATE_S)
    took = _timed(ctx, fn)
    return {"waited": took >= 0.8 * LATE_S}


# What the GIL cases observe: rank 0 waited and its other thread did not run meanwhile; rank 1 did not wait.
HELD_THE_GIL = [{"waited": True, "others_ran": False}, {"waited": False, "others_ran": False}]


def _while_waiting(ctx: Ctx, fn: Callable[[], Any]) -> dict[str, bool]:
    """As :func:`_late_then`, with a second thread on each rank counting ticks of ``TICK_S`` meanwhile: whether the
    call waited, and whether that thread ran while it did (a call that keeps the GIL as it waits stops it)."""
    ticks = [0]
    stop = [False]

    def tick() -> None:
        while not stop[0]:
            ctx.sleep(TICK_S)
            ticks[0] += 1

    join = ctx.start_thread(tick)
    if ctx.rank:
        ctx.sleep(LATE_S)
    before = ticks[0]
    took = _timed(ctx, fn)
    ticked = ticks[0] - before  # read first: the thread may run again the moment the call returns
    stop[0] = True
    join()
    waited = took >= 0.8 * LATE_S
    return {"waited": waited, "others_ran": waited and ticked >= 0.5 * LATE_S / TICK_S}


# -- high-throughput (intranode) buffers: two ranks ----------------------------------------------------------------
@case(HT_OK, ranks=2)
def ht_dispatch_combine(ctx: Ctx):
    """Dispatch and combine on a two-rank intranode buffer: counts per local expert, tokens received and the combined
    rows equal the single-process reference."""
    buf = _ht(ctx, explicitly_destroy=True)
    out = _ht_round(ctx, buf)
    buf.destroy()
    return out


@case(["ok", "RuntimeError", "ok"], ranks=2)
def ht_dispatch_needs_room_for_its_queues(ctx: Ctx):
    """A buffer is made at any aligned size, but an intranode dispatch asserts on the host, before any kernel, when its
    queues do not fit ``num_nvl_bytes`` (``num_sms / 2`` channels x ranks x ``num_max_nvl_chunked_recv_tokens`` rows
    with their indices and weights): 1 MiB is too small for 256-wide bf16 rows at the default config, whatever the
    tokens sent.  The buffer is then destroyed as usual."""
    made: list[Any] = []
    out = [_outcome(lambda: made.append(ctx.Buffer(ctx.group, num_nvl_bytes=1 << 20, explicitly_destroy=True)))]
    out.append(_outcome(lambda: _ht_round(ctx, made[0])))
    out.append(_outcome(made[0].destroy))
    return out


@case([{"waited": True}, {"waited": False}], ranks=2, per_rank=True)
def destroy_waits_for_every_rank(ctx: Ctx):
    """``destroy()`` is collective (a device barrier over the intranode ranks): a rank that destroys first returns
    only when the last has called it."""
    buf = _ht(ctx, explicitly_destroy=True)
    return _late_then(ctx, buf.destroy)


@case(HELD_THE_GIL, ranks=2, per_rank=True)
def destroy_holds_the_gil(ctx: Ctx):
    """``destroy()`` waits in its barrier without releasing the GIL (its binding has no release): while rank 0 waits
    for the late rank, no other thread of rank 0's process runs."""
    buf = _ht(ctx, explicitly_destroy=True)
    return _while_waiting(ctx, buf.destroy)


@case(HELD_THE_GIL, ranks=2, per_rank=True)
def ht_dispatch_holds_the_gil(ctx: Ctx):
    """The intranode dispatch spins on the host for the peers' receive counts with the GIL held (v1.2.1 releases it
    only in the internode dispatch): while rank 0 waits for the late rank, no other thread of its process runs."""
    buf = _ht(ctx, explicitly_destroy=True)
    observed = _while_waiting(ctx, lambda: _ht_round(ctx, buf))
    buf.destroy()
    return observed


@case([{"waited": True}, {"waited": False}], ranks=2, per_rank=True)
def destructor_without_flag_waits_for_every_rank(ctx: Ctx):
    """With ``explicitly_destroy=False`` the destructor runs the collective destroy: the first rank to drop its last
    reference waits in it until the others drop theirs."""
    holder = [_ht(ctx)]

    def drop() -> None:
        holder.clear()
        gc.collect()

    return _late_then(ctx, drop)


@case({"warned": True, "waited": False}, ranks=2)
def destructor_with_flag_warns_and_returns(ctx: Ctx):
    """With ``explicitly_destroy=True`` and no ``destroy()``, the destructor prints DeepEP's warning and returns at
    once: nothing is torn down and no rank waits for another."""
    holder = [_ht(ctx, explicitly_destroy=True)]
    with ctx.printed() as lines:
        waited = _late_then(ctx, holder.clear)["waited"]
    return {"warned": any("destroy() was not called" in line for line in lines), "waited": waited}


@case(["AssertionError", "done"], ranks=2)
def destroy_asserts_the_flag(ctx: Ctx):
    """``destroy()`` on a buffer made without ``explicitly_destroy`` is an AssertionError (Python side, nothing torn
    down); dropping it then runs the collective destroy in the destructor on every rank."""
    holder = [_ht(ctx)]
    refused = _outcome(holder[0].destroy)
    holder.clear()
    gc.collect()
    return [refused, "done"]


@case(["AttributeError", "AttributeError", "AttributeError"], ranks=2)
def calls_after_destroy(ctx: Ctx):
    """After ``destroy()`` the runtime is None: a layout, a dispatch and a second destroy raise AttributeError."""
    buf = _ht(ctx, explicitly_destroy=True)
    buf.destroy()
    idx = torch.zeros(1, 1, dtype=torch.int64, device=ctx.device)
    x = torch.zeros(1, 256, dtype=torch.bfloat16, device=ctx.device)
    return [
        _outcome(lambda: buf.get_dispatch_layout(idx, 2 * ctx.n)),
        _outcome(
            lambda: buf.dispatch(
                x,
                topk_idx=idx,
                topk_weights=idx.float(),
                num_tokens_per_rank=idx,
                is_token_in_rank=idx.bool(),
                num_tokens_per_expert=idx,
            )
        ),
        _outcome(buf.destroy),
    ]


@case({"second": HT_OK, "first": HT_OK}, ranks=2)
def two_buffers_on_one_group(ctx: Ctx):
    """Two buffers on the same group, alive together (old and new at a reconfiguration): each one's dispatch and
    combine are right, whichever runs first, and each is destroyed on its own."""
    first = _ht(ctx, explicitly_destroy=True)
    second = _ht(ctx, explicitly_destroy=True)
    out = {"second": _ht_round(ctx, second, seed=1), "first": _ht_round(ctx, first, seed=2)}
    second.destroy()
    first.destroy()
    return out


@case(HT_OK, ranks=2)
def handle_from_another_buffer_of_the_same_size(ctx: Ctx):
    """A high-throughput handle is plain layout tensors: combine on another buffer of the same group size, with the
    handle a dispatch on the first returned, gives the right result."""
    first = _ht(ctx, explicitly_destroy=True)
    second = _ht(ctx, explicitly_destroy=True)
    out = _ht_round(ctx, second, handle_from=first)
    second.destroy()
    first.destroy()
    return out


@case(["RuntimeError", "RuntimeError"], ranks=2)
def constructor_asserts(ctx: Ctx):
    """The C++ constructor's host assertions (RuntimeError, before anything is exchanged): buffer bytes not a multiple
    of 128, and RDMA bytes for an intranode group outside low-latency mode."""
    return [
        _outcome(lambda: ctx.Buffer(ctx.group, num_nvl_bytes=1000)),
        _outcome(lambda: ctx.Buffer(ctx.group, num_nvl_bytes=NVL_BYTES, num_rdma_bytes=1 << 20)),
    ]


# -- one rank --------------------------------------------------------------------------------------------------------
@case(["AssertionError", "RuntimeError", "RuntimeError"], ranks=1)
def one_rank_high_throughput(ctx: Ctx):
    """An intranode buffer of one rank is made, but its dispatch without a ``config`` asserts (no recommended config
    for one rank), a low-latency call on it asserts ``low_latency_mode``, and ``destroy()`` asserts too: its barrier is
    a kernel built for 2, 4 or 8 ranks ("Unsupported ranks"), so the buffer is never freed."""
    buf = _ht(ctx, explicitly_destroy=True)
    idx = torch.zeros(2, 1, dtype=torch.int64, device=ctx.device)
    x = torch.zeros(2, 256, dtype=torch.bfloat16, device=ctx.device)
    per_rank, _, per_expert, in_rank, _ = buf.get_dispatch_layout(idx, 2)
    out = [
        _outcome(
            lambda: buf.dispatch(
                x,
                num_tokens_per_rank=per_rank,
                is_token_in_rank=in_rank,
                num_tokens_per_expert=per_expert,
                topk_idx=idx,
                topk_weights=idx.float(),
            )
        ),
        _outcome(lambda: buf.low_latency_dispatch(x, idx, 16, 2)),
        _outcome(buf.destroy),
    ]
    return out


@case([LL_OK, LL_OK], ranks=1)
def ll_dispatch_combine(ctx: Ctx):
    """Low-latency dispatch (bf16) and combine, twice (both halves of the double buffer): per-expert counts and the
    weighted combined rows equal the reference."""
    buf = _ll(ctx, experts=4)
    out = [_ll_round(ctx, buf, 4, seed=1), _ll_round(ctx, buf, 4, seed=2)]
    buf.destroy()
    return out


@case(["torch.float8_e4m3fn", [2, 16, HIDDEN_LL], "torch.float32", [2, 16, HIDDEN_LL // 128]], ranks=1)
def ll_fp8_dispatch(ctx: Ctx):
    """With ``use_fp8`` (the default) low-latency dispatch returns E4M3 rows ``[local experts, ranks x max tokens,
    hidden]`` and float32 scales, one per 128 channels."""
    xs, idxs, _ = _inputs(ctx, 2, HIDDEN_LL)
    buf = _ll(ctx, experts=2)
    (data, scales), _, _, _, _ = buf.low_latency_dispatch(xs[0].to(ctx.device), idxs[0].to(ctx.device), 16, 2)
    out = [str(data.dtype), list(data.shape), str(scales.dtype), list(scales.shape)]
    buf.destroy()
    return out


@case(["RuntimeError", "RuntimeError", "RuntimeError"], ranks=1)
def ll_dispatch_asserts(ctx: Ctx):
    """Low-latency dispatch's host assertions: a hidden size the kernels are not built for (256), an RDMA buffer
    smaller than the layout, and ``async_finish`` with ``return_recv_hook``."""
    xs, idxs, _ = _inputs(ctx, 2, HIDDEN_LL)
    x, idx = xs[0].to(ctx.device), idxs[0].to(ctx.device)
    narrow = _inputs(ctx, 2, 256)
    hint = ctx.Buffer.get_low_latency_rdma_size_hint(16, HIDDEN_LL, ctx.n, 2)
    calls = [
        (
            {"hidden": 256},
            lambda buf: buf.low_latency_dispatch(narrow[0][0].to(ctx.device), narrow[1][0].to(ctx.device), 16, 2),
        ),
        ({"rdma_bytes": (hint // 2) // 128 * 128}, lambda buf: buf.low_latency_dispatch(x, idx, 16, 2)),
        ({}, lambda buf: buf.low_latency_dispatch(x, idx, 16, 2, async_finish=True, return_recv_hook=True)),
    ]
    out = []
    for sizes, call in calls:  # one buffer at a time
        buf = _ll(ctx, experts=2, **sizes)
        out.append(_outcome(lambda: call(buf)))
        buf.destroy()
    return out


@case(LL_OK, ranks=1)
def ll_recv_hook(ctx: Ctx):
    """``return_recv_hook``: the calls only send; once the caller runs each hook, the results are right."""
    buf = _ll(ctx, experts=2)
    out = _ll_round(ctx, buf, 2, hook=True)
    buf.destroy()
    return out


@case([None, LL_OK], ranks=1)
def ll_clean_then_dispatch(ctx: Ctx):
    """``clean_low_latency_buffer`` returns None and the buffer serves after it."""
    buf = _ll(ctx, experts=2)
    cleaned = buf.clean_low_latency_buffer(16, HIDDEN_LL, 2)
    out = [cleaned, _ll_round(ctx, buf, 2)]
    buf.destroy()
    return out


@case(LL_OK, ranks=1)
def ll_combine_with_an_older_handle(ctx: Ctx):
    """A low-latency handle is plain tensors and sizes: after two more dispatches (both halves of the double buffer
    used again), combining with the first dispatch's handle and rows still gives the right result."""
    xs, idxs, ws = _inputs(ctx, 2, HIDDEN_LL)
    x, idx, w = xs[0].to(ctx.device), idxs[0].to(ctx.device), ws[0].to(ctx.device)
    buf = _ll(ctx, experts=2)
    recv_x, count, handle, _, _ = buf.low_latency_dispatch(x, idx, 16, 2, use_fp8=False)
    for _ in range(2):
        buf.low_latency_dispatch(x, idx, 16, 2, use_fp8=False)
    counts = [int(c) for c in count.cpu()]
    rx = recv_x.float().cpu()
    y = torch.zeros(rx.shape, dtype=torch.float32)
    for e in range(2):
        y[e, : counts[e]] = expert(e, rx[e, : counts[e]])
    try:
        combined, _, _ = buf.low_latency_combine(y.to(torch.bfloat16).to(ctx.device), idx, w, handle)
        out: Any = matches(combined, reference(xs[0].float(), idxs[0], ws[0]))
    except Exception as exc:  # noqa: BLE001 - a refusal is the observation
        out = type(exc).__name__
    buf.destroy()
    return {"combined": out, "counts": counts == [int((idxs[0] == e).sum()) for e in range(2)]}


@case({"second": LL_OK, "after_destroy": LL_OK}, ranks=1)
def ll_buffers_one_after_another(ctx: Ctx):
    """A second low-latency buffer made while the first is alive serves (NVSHMEM's second init at the same size
    only counts), and one made after both are destroyed serves too."""
    first = _ll(ctx, experts=2)
    second = _ll(ctx, experts=2)
    out = {"second": _ll_round(ctx, second, 2)}
    second.destroy()
    first.destroy()
    third = _ll(ctx, experts=2)
    out["after_destroy"] = _ll_round(ctx, third, 2)
    third.destroy()
    return out


SIZE_HINT_SHAPES = [(128, 7168, 8, 256), (256, 4096, 16, 64), (16, 2048, 1, 4), (1, 128, 1, 1), (512, 8192, 64, 256)]


@case([1908410496, 545260160, 1065344, 1408, 8724154496], ranks=1)
def ll_rdma_size_hint(ctx: Ctx):
    """``get_low_latency_rdma_size_hint`` for several shapes: DeepEP's ``LowLatencyLayout`` (two sets of send,
    receive and 128-byte-aligned signalling buffers), plus one alignment unit even when the total is aligned."""
    return [int(ctx.Buffer.get_low_latency_rdma_size_hint(*shape)) for shape in SIZE_HINT_SHAPES]
