"""The fake DeepEP Buffer: dispatch/combine against a single-process reference (EP 2 to 64, high-throughput and
low-latency), collective semantics (a missing rank is a timeout naming it), misuse, the destructor's two branches,
and NVSHMEM as a reference-counted world."""

from __future__ import annotations

import functools
import re
from typing import Any

import pytest
import torch

from fakes import deep_ep
from sim.ranks import SimulatedRanks
from sim.all2all import expert, local_experts, matches, reference

HIDDEN = 2048  # a size DeepEP's low-latency kernels are built for
# An intranode buffer as vLLM sizes it (VLLM_DEEPEP_BUFFER_SIZE_MB): DeepEP's dispatch asserts that its queues fit
NVL_BYTES = 1 << 30


def _inputs(n: int, tokens: int, experts: int, topk: int, seed: int):
    gen = torch.Generator().manual_seed(seed)
    xs, idxs, ws = [], [], []
    for _ in range(n):
        xs.append(torch.randn(tokens, HIDDEN, generator=gen).to(torch.bfloat16))  # DeepEP moves bf16 rows
        idx = torch.stack([torch.randperm(experts, generator=gen)[:topk] for _ in range(tokens)])
        idx[torch.rand(tokens, topk, generator=gen) < 0.1] = -1  # some slots unused, as DeepEP allows
        idxs.append(idx)
        ws.append(torch.rand(tokens, topk, generator=gen))
    return xs, idxs, ws


def _assert_close(got: torch.Tensor, want: torch.Tensor) -> None:
    """Equal to bf16 precision: rows move as bf16 and the experts' outputs are summed in bf16."""
    assert matches(got, want), (got.float() - want).abs().max()


@pytest.mark.parametrize("n", [2, 4, 8, 16, 64])
def test_high_throughput_dispatch_combine_equals_thereference(n: int) -> None:
    experts, topk, tokens = 4 * n, 4, 6
    xs, idxs, ws = _inputs(n, tokens, experts, topk, seed=n)
    ranks = SimulatedRanks(n)

    def body(g):
        r = g.rank()
        buf = deep_ep.Buffer(g, num_nvl_bytes=NVL_BYTES, explicitly_destroy=True)
        per_rank, _, per_expert, in_rank, _ = buf.get_dispatch_layout(idxs[r], experts)
        recv_x, recv_idx, recv_w, counts, handle, _ = buf.dispatch(
            xs[r],
            num_tokens_per_rank=per_rank,
            is_token_in_rank=in_rank,
            num_tokens_per_expert=per_expert,
            topk_idx=idxs[r],
            topk_weights=ws[r],
        )
        per = experts // n
        assert counts == [int((recv_idx == e).sum()) for e in range(per)]
        combined, _, _ = buf.combine(local_experts(recv_x, recv_idx, recv_w, r, per), handle)
        buf.destroy()
        return combined, per_rank, recv_x.shape[0]

    results = ranks.run(body)
    for r, res in enumerate(results):
        assert not isinstance(res, BaseException), res
        combined, per_rank, _ = res
        _assert_close(combined, reference(xs[r].float(), idxs[r], ws[r]))
    # every rank received exactly what the layouts said the others would send it
    for dst in range(n):
        assert results[dst][2] == sum(int(results[src][1][dst]) for src in range(n))


@pytest.mark.parametrize("n", [2, 4, 8, 16, 64])
def test_low_latency_dispatch_combine_equals_thereference(n: int) -> None:
    experts, topk, tokens, max_tokens = 2 * n, 3, 4, 8
    xs, idxs, ws = _inputs(n, tokens, experts, topk, seed=100 + n)
    ranks = SimulatedRanks(n)
    kernel = ranks.kernel
    deep_ep.configure(kernel, "elastic")

    def body(g):
        r = g.rank()
        hint = deep_ep.Buffer.get_low_latency_rdma_size_hint(max_tokens, HIDDEN, n, experts)
        buf = deep_ep.Buffer(
            g, num_rdma_bytes=hint, low_latency_mode=True, num_qps_per_rank=experts // n, explicitly_destroy=True
        )
        recv_x, count, handle, _, _ = buf.low_latency_dispatch(xs[r], idxs[r], max_tokens, experts, use_fp8=False)
        per = experts // n
        assert recv_x.shape == (per, n * max_tokens, HIDDEN)
        y = torch.zeros_like(recv_x)
        for le in range(per):
            c = int(count[le])
            y[le, :c] = expert(r * per + le, recv_x[le, :c].float()).to(y.dtype)
        combined, _, _ = buf.low_latency_combine(y, idxs[r], ws[r], handle)
        buf.destroy()
        return combined

    for r, res in enumerate(ranks.run(body)):
        assert not isinstance(res, BaseException), res
        _assert_close(res, reference(xs[r].float(), idxs[r], ws[r]))


def test_fp8_low_latency_dispatch_returns_data_and_scales_that_dequantise() -> None:
    ranks = SimulatedRanks(2)
    xs, idxs, _ = _inputs(2, 3, 4, 2, seed=7)

    def body(g):
        buf = deep_ep.Buffer(g, num_rdma_bytes=1 << 20, low_latency_mode=True, explicitly_destroy=True)
        (data, scales), count, _, _, _ = buf.low_latency_dispatch(xs[g.rank()], idxs[g.rank()], 4, 4)
        plain = data.float().reshape(*data.shape[:-1], HIDDEN // 128, 128) * scales.unsqueeze(-1)
        return plain.reshape(data.shape), count

    for res in ranks.run(body):
        assert not isinstance(res, BaseException), res
        dequantised, count = res
        assert dequantised.dtype == torch.float32 and int(count.sum()) > 0


def test_a_rank_that_never_dispatches_times_the_others_out_naming_it() -> None:
    ranks = SimulatedRanks(4)
    kernel = ranks.kernel
    xs, idxs, ws = _inputs(4, 3, 8, 2, seed=3)

    def body(g):
        r = g.rank()
        buf = deep_ep.Buffer(g, num_nvl_bytes=NVL_BYTES, explicitly_destroy=True)
        if r == 2:
            return buf  # rank 2 goes on without dispatching
        per_rank, _, per_expert, in_rank, _ = buf.get_dispatch_layout(idxs[r], 8)
        started = kernel.now()
        try:
            buf.dispatch(
                xs[r], is_token_in_rank=in_rank, num_tokens_per_expert=per_expert, topk_idx=idxs[r], topk_weights=ws[r]
            )
        except deep_ep.DeepEPTimeout as exc:
            return exc, kernel.now() - started

    results = ranks.run(body)
    for r in (0, 1, 3):
        exc, waited = results[r]
        assert "DeepEP error: CPU recv timeout" in str(exc) and exc.missing == [2] and "pids [2]" in str(exc)
        assert waited == pytest.approx(100.0)  # DeepEP's timeout, in simulated seconds
        assert isinstance(exc, deep_ep.DeepEPTimeout)
    assert results[2].state == deep_ep.AVAILABLE


def test_low_latency_timeout_poisons_the_buffer() -> None:
    ranks = SimulatedRanks(2)
    xs, idxs, _ = _inputs(2, 2, 4, 2, seed=5)

    def body(g):
        buf = deep_ep.Buffer(g, num_rdma_bytes=1 << 20, low_latency_mode=True, explicitly_destroy=True)
        if g.rank() == 1:
            return buf
        try:
            buf.low_latency_dispatch(xs[0], idxs[0], 4, 4, use_fp8=False)
        except deep_ep.DeepEPTimeout as exc:
            assert "trapped" in str(exc)
        assert buf.state == deep_ep.POISONED
        with pytest.raises(RuntimeError, match="sticky"):
            buf.clean_low_latency_buffer(4, HIDDEN, 4)
        return buf

    results = ranks.run(body)
    for res in results:
        assert not isinstance(res, BaseException), res
    # Never destroyed: with explicitly_destroy, DeepEP's destructor warns about a trapped buffer too, and it leaks.
    trapped = results[0]
    del results
    trapped.__del__()
    assert trapped.state == deep_ep.LEAKED
    assert [f["pid"] for _, kind, f in ranks.kernel.history.records if kind == "deep_ep.leak"] == [0]


def test_misuse_raises_what_deep_ep_raises() -> None:
    ranks = SimulatedRanks(2)

    def body(g):
        buf = deep_ep.Buffer(g, num_nvl_bytes=NVL_BYTES)  # explicitly_destroy=False
        with pytest.raises(AssertionError, match="explicitly_destroy"):
            buf.destroy()
        strict = deep_ep.Buffer(g, num_nvl_bytes=NVL_BYTES, explicitly_destroy=True)
        strict.destroy()
        assert strict.state == deep_ep.DESTROYED and strict.runtime is None
        with pytest.raises(AttributeError):
            strict.get_dispatch_layout(torch.zeros(1, 1, dtype=torch.int64), 2)
        with pytest.raises(AttributeError):
            strict.destroy()
        with pytest.raises(RuntimeError, match="low_latency_mode"):
            buf.low_latency_dispatch(
                torch.zeros(1, HIDDEN, dtype=torch.bfloat16), torch.zeros(1, 1, dtype=torch.int64), 1, 2
            )
        with pytest.raises(AssertionError):
            deep_ep.Buffer.set_num_sms(3)
        return "ok"

    assert ranks.run(body) == ["ok", "ok"]


def test_destructor_runs_the_collective_destroy_or_leaks_with_a_warning(capsys) -> None:
    ranks = SimulatedRanks(2)
    kernel = ranks.kernel
    kept: list[Any] = []

    def body(g):
        default = deep_ep.Buffer(g, num_rdma_bytes=1 << 20, low_latency_mode=True)
        strict = deep_ep.Buffer(g, num_nvl_bytes=NVL_BYTES, explicitly_destroy=True)
        kept.append((default.state, strict.state))
        world = deep_ep._nvshmem.worlds(kernel).of(g.rendezvous.pids[g.rank()])
        count_before = world.init_count
        del default  # refcount finalizes it here, on this rank's thread: the collective destroy runs
        strict.__del__()
        return count_before, world.init_count, strict.state

    results = ranks.run(body)
    assert results == [(1, 0, deep_ep.LEAKED), (1, 0, deep_ep.LEAKED)]
    # DeepEP printf()s it: stdout.  Inside a simulated run the console is quiet (the history holds deep_ep.leak).
    assert "destroy() was not called" in capsys.readouterr().out


@pytest.mark.parametrize("profile, outcome", [("stock", "hang"), ("elastic", "ok"), ("mi355", "error")])
def test_nvshmem_reinit_at_a_new_ep_size(profile: str, outcome: str) -> None:
    """EP4 low-latency buffers destroyed, then EP2 ones on two of the same processes (a scale-down)."""
    ranks = SimulatedRanks(4, nvshmem=profile)
    groups2 = ranks.new_group("ep2", [0, 1])

    def body(g):
        buf = deep_ep.Buffer(g, num_rdma_bytes=1 << 20, low_latency_mode=True, explicitly_destroy=True)
        buf.destroy()
        if g.rank() >= 2:
            return "left"
        try:
            small = deep_ep.Buffer(
                groups2[g.rank()], num_rdma_bytes=1 << 20, low_latency_mode=True, explicitly_destroy=True
            )
        except deep_ep.DeepEPTimeout as exc:
            return "hang: " + str(exc)
        except deep_ep.NvshmemError as exc:
            return "error: " + str(exc)
        return f"ok {small._nvshmem_size}"

    results = ranks.run(body)
    assert results[2:] == ["left", "left"]
    if outcome == "hang":
        assert all(r.startswith("hang") and "initialised for 4 ranks" in r for r in results[:2]), results
    elif outcome == "ok":
        assert results[:2] == ["ok 2", "ok 2"]
    else:
        assert all(r.startswith("error") for r in results[:2]), results


def test_intranode_high_throughput_never_touches_nvshmem() -> None:
    ranks = SimulatedRanks(8)
    kernel = ranks.kernel

    def body(g):
        deep_ep.Buffer(g, num_nvl_bytes=NVL_BYTES, explicitly_destroy=True).destroy()
        return deep_ep._nvshmem.worlds(kernel).of(g.rank()).history

    assert ranks.run(body) == [[]] * 8


def test_nvshmem_is_joined_only_with_rdma_bytes() -> None:
    """DeepEP exchanges the NVSHMEM unique id for any low-latency buffer (or group above 8 ranks), but its runtime
    joins NVSHMEM only when the buffer has RDMA bytes (not for any low-latency one)."""
    ranks = SimulatedRanks(2, nvshmem="elastic")
    kernel = ranks.kernel

    def body(g):
        deep_ep.Buffer(g, num_nvl_bytes=NVL_BYTES, low_latency_mode=True, explicitly_destroy=True).destroy()
        joined_without = list(deep_ep._nvshmem.worlds(kernel).of(g.rank()).history)
        _ll_buffer(g).destroy()
        return joined_without, bool(deep_ep._nvshmem.worlds(kernel).of(g.rank()).history)

    assert ranks.run(body) == [([], True), ([], True)]


def test_size_hint_grows_with_ep_size_and_experts() -> None:
    hint = deep_ep.Buffer.get_low_latency_rdma_size_hint
    assert hint(128, 7168, 16, 256) < hint(128, 7168, 32, 512) and hint(128, 7168, 16, 256) % 128 == 0


def test_the_fake_deep_ep_fixture_gives_ranks_and_the_import(fake_deep_ep) -> None:
    import deep_ep as imported

    assert imported.Buffer is deep_ep.Buffer
    ranks = fake_deep_ep(2, nvshmem="elastic")

    def body(g):
        buf = imported.Buffer(g, num_rdma_bytes=1 << 20, low_latency_mode=True, explicitly_destroy=True)
        buf.destroy()
        return buf.state

    assert ranks.run(body) == [deep_ep.DESTROYED, deep_ep.DESTROYED]


def _ll_buffer(g, ht: bool = False):
    return deep_ep.Buffer(
        g, num_nvl_bytes=NVL_BYTES if ht else 0, num_rdma_bytes=1 << 20, low_latency_mode=True, explicitly_destroy=True
    )


def test_low_latency_after_high_throughput_needs_a_clean() -> None:
    xs, idxs, ws = _inputs(2, 3, 4, 2, seed=11)

    def body(g, clean: bool):
        r = g.rank()
        buf = _ll_buffer(g, ht=True)
        _, _, per_expert, in_rank, _ = buf.get_dispatch_layout(idxs[r], 4)
        buf.dispatch(
            xs[r], is_token_in_rank=in_rank, num_tokens_per_expert=per_expert, topk_idx=idxs[r], topk_weights=ws[r]
        )
        if clean:
            buf.clean_low_latency_buffer(4, HIDDEN, 4)
        try:
            buf.low_latency_dispatch(xs[r], idxs[r], 4, 4, use_fp8=False)
        except deep_ep.DeepEPTimeout as exc:
            return buf.state, "clean_low_latency_buffer was not called" in str(exc)
        return buf.state, None

    assert SimulatedRanks(2).run(lambda g: body(g, True)) == [(deep_ep.AVAILABLE, None)] * 2
    assert SimulatedRanks(2).run(lambda g: body(g, False)) == [(deep_ep.POISONED, True)] * 2


def test_low_latency_parity_skew_hangs_the_rank_left_alone() -> None:
    """Rank 1 issues one extra LL call (a dummy batch).  Calls pair by position: rank 0's last call meets rank 1's
    extra one (garbage on real hardware: different batches), and rank 1's last call waits for a peer that never
    comes, then traps."""
    xs, idxs, ws = _inputs(2, 2, 4, 2, seed=12)

    def body(g):
        r = g.rank()
        buf = _ll_buffer(g)
        calls = 2 if r == 1 else 1
        try:
            for _ in range(calls):
                buf.low_latency_dispatch(xs[r], idxs[r], 4, 4, use_fp8=False)
            recv, count, handle, _, _ = buf.low_latency_dispatch(xs[r], idxs[r], 4, 4, use_fp8=False)
        except deep_ep.DeepEPTimeout as exc:
            return buf.state, exc.missing
        return buf.state, None

    results = SimulatedRanks(2).run(body)
    assert results == [(deep_ep.AVAILABLE, None), (deep_ep.POISONED, [0])]


def test_a_low_latency_handle_outlives_two_more_dispatches() -> None:
    """A handle is tensors and sizes (DeepEP v1.2.1): combining with the first of three dispatches is still right."""
    xs, idxs, ws = _inputs(2, 2, 4, 2, seed=13)

    def body(g):
        r = g.rank()
        buf = _ll_buffer(g)
        recv_x, count, handle, _, _ = buf.low_latency_dispatch(xs[r], idxs[r], 4, 4, use_fp8=False)
        buf.low_latency_dispatch(xs[r], idxs[r], 4, 4, use_fp8=False)
        buf.low_latency_dispatch(xs[r], idxs[r], 4, 4, use_fp8=False)
        y = torch.zeros_like(recv_x)
        for le in range(2):
            y[le, : int(count[le])] = expert(r * 2 + le, recv_x[le, : int(count[le])].float()).to(y.dtype)
        combined, _, _ = buf.low_latency_combine(y, idxs[r], ws[r], handle)
        _assert_close(combined, reference(xs[r].float(), idxs[r], ws[r]))
        return "ok"

    assert SimulatedRanks(2).run(body) == ["ok", "ok"]


@pytest.mark.parametrize(
    "size, kwargs, cond",
    [
        (2, {"num_nvl_bytes": 1000}, "num_nvl_bytes % NUM_BUFFER_ALIGNMENT_BYTES == 0"),
        (2, {"num_rdma_bytes": 1 << 20}, "num_rdma_bytes == 0 or num_ranks > NUM_MAX_NVL_PEERS or low_latency_mode"),
        (12, {"num_nvl_bytes": 1 << 20}, "num_ranks < NUM_MAX_NVL_PEERS or num_ranks % NUM_MAX_NVL_PEERS == 0"),
    ],
)
def test_the_constructor_checks_what_deep_ep_asserts_before_any_exchange(size, kwargs, cond) -> None:
    def body(g):
        with pytest.raises(RuntimeError, match=re.escape(cond)):
            deep_ep.Buffer(g, **kwargs)
        return "refused"

    assert SimulatedRanks(size).run(body) == ["refused"] * size


def test_a_leaked_low_latency_buffer_above_8_ranks_keeps_the_static_team_from_the_next_one() -> None:
    # finalize (destroy) is the only thing that resets the process's sub-RDMA team; vLLM replacing its class-level
    # LL buffer without destroy() leaves the team held, and the next LL buffer above 8 ranks fails at once.
    ranks = SimulatedRanks(16, nvshmem="elastic")
    second = ranks.new_group("again", list(range(16)))

    def body(g, destroy_first):
        kw: dict[str, Any] = {"num_rdma_bytes": 1 << 20, "low_latency_mode": True, "explicitly_destroy": True}
        first = deep_ep.Buffer(g, **kw)
        if destroy_first:
            first.destroy()
        del first  # leaked (a warning) when not destroyed
        try:
            deep_ep.Buffer(second[g.rank()], **kw)
        except RuntimeError as exc:
            return "cpu_rdma_team == NVSHMEM_TEAM_INVALID" in str(exc) and "never destroyed" in str(exc)
        return "ok"

    assert ranks.run(lambda g: body(g, True)) == ["ok"] * 16
    ranks = SimulatedRanks(16, nvshmem="elastic")
    second = ranks.new_group("again", list(range(16)))
    assert ranks.run(lambda g: body(g, False)) == [True] * 16


def test_high_throughput_without_a_config_asserts_on_an_ep_size_deep_ep_has_no_config_for() -> None:
    # DeepEP's dispatch and combine take the recommended config of the EP size when given none; there is none for 3.
    xs, idxs, ws = _inputs(3, 4, 6, 2, seed=3)

    def body(g):
        r = g.rank()
        buf = deep_ep.Buffer(g, num_nvl_bytes=NVL_BYTES, explicitly_destroy=True)
        per_rank, _, per_expert, in_rank, _ = buf.get_dispatch_layout(idxs[r], 6)
        dispatch = functools.partial(
            buf.dispatch,
            xs[r],
            num_tokens_per_rank=per_rank,
            is_token_in_rank=in_rank,
            num_tokens_per_expert=per_expert,
            topk_idx=idxs[r],
            topk_weights=ws[r],
        )
        with pytest.raises(AssertionError, match="Unsupported number of EP ranks: 3"):
            dispatch()
        # A config of the caller's passes that check, but the intranode kernels are built for 2, 4 or 8 ranks: the
        # dispatch asserts, and so does destroy()'s barrier (the buffer is never freed).
        with pytest.raises(RuntimeError, match="Unsupported ranks"):
            dispatch(config=object())
        with pytest.raises(RuntimeError, match="Unsupported ranks"):
            buf.destroy()
        return "ok"

    assert SimulatedRanks(3).run(body) == ["ok"] * 3


def test_any_nvshmem_finalize_releases_the_sub_rdma_team() -> None:
    # internode::finalize resets the process's team whichever buffer calls it: a leaked LL buffer's team goes with
    # the next destroy of another NVSHMEM buffer in the process.
    ranks = SimulatedRanks(16, nvshmem="elastic")
    g2, g3 = ranks.new_group("b", list(range(16))), ranks.new_group("c", list(range(16)))

    def body(g):
        ll: dict[str, Any] = {"num_rdma_bytes": 1 << 20, "low_latency_mode": True, "explicitly_destroy": True}
        leaked = deep_ep.Buffer(g, **ll)
        del leaked
        other = deep_ep.Buffer(g2[g.rank()], num_nvl_bytes=NVL_BYTES, num_rdma_bytes=1 << 20, explicitly_destroy=True)
        other.destroy()
        deep_ep.Buffer(g3[g.rank()], **ll).destroy()
        return "ok"

    assert ranks.run(body) == ["ok"] * 16


# -- from a review against DeepEP's reference ---------------------------------------------------------------------
def test_with_return_recv_hook_the_tokens_land_only_when_the_hook_runs() -> None:
    """Low latency with ``return_recv_hook``: the call sends, the hook receives; before it, the receive buffers hold
    nothing of the call (NaN here), after it exactly what the call without a hook returns."""
    n, experts, max_tokens = 2, 4, 4
    xs, idxs, ws = _inputs(n, 3, experts, 2, seed=11)
    ranks = SimulatedRanks(n)

    def body(g):
        r = g.rank()
        buf = deep_ep.Buffer(g, num_rdma_bytes=1 << 20, low_latency_mode=True, explicitly_destroy=True)
        plain_x, plain_count, plain_handle, _, no_hook = buf.low_latency_dispatch(
            xs[r], idxs[r], max_tokens, experts, use_fp8=False
        )
        recv_x, count, handle, _, hook = buf.low_latency_dispatch(
            xs[r], idxs[r], max_tokens, experts, use_fp8=False, return_recv_hook=True
        )
        before = (bool(recv_x.isnan().all()), int(count.sum()))
        hook()
        torch.testing.assert_close(recv_x, plain_x, equal_nan=True)
        assert torch.equal(count, plain_count) and no_hook is None
        y = torch.zeros_like(recv_x)
        combined, _, combine_hook = buf.low_latency_combine(y, idxs[r], ws[r], handle, return_recv_hook=True)
        combined_before = bool(combined.isnan().all())
        combine_hook()
        with pytest.raises(RuntimeError, match=re.escape("'not (async and return_recv_hook)'")):
            buf.low_latency_dispatch(xs[r], idxs[r], max_tokens, experts, async_finish=True, return_recv_hook=True)
        return before, combined_before, combined

    for res in ranks.run(body):
        assert not isinstance(res, BaseException), res
        before, combined_before, combined = res
        assert before == (True, 0) and combined_before and torch.equal(combined, torch.zeros_like(combined))


def test_a_rank_that_comes_late_waits_its_own_timeout() -> None:
    """DeepEP's timeout counts from each rank's own launch: rank 0 arrives at 0 and times out at 100; rank 1,
    arriving at 90, waits until 190 (not until 100, only 10 s after it arrives); rank 2 never comes."""
    ranks = SimulatedRanks(3)
    kernel = ranks.kernel

    def body(g):
        r = g.rank()
        buf = deep_ep.Buffer(g, num_rdma_bytes=1 << 20, low_latency_mode=True, explicitly_destroy=True)
        if r == 2:
            return None
        kernel.sleep(90.0 * r)
        start = kernel.now()
        with pytest.raises(deep_ep.DeepEPTimeout) as info:
            buf.clean_low_latency_buffer(4, HIDDEN, 6)
        return start, kernel.now(), info.value.missing

    results = ranks.run(body)
    assert results[0][1:] == (results[0][0] + 100.0, [2]) and results[1][1:] == (results[1][0] + 100.0, [2])
    assert results[1][0] == results[0][0] + 90.0


def test_the_destructor_of_a_buffer_whose_exchange_failed_is_an_illegal_address() -> None:
    """The default flag runs the C++ destroy in the destructor; a constructor that failed before the IPC handles were
    opened leaves it pointers that were never set (DeepEP fault 7 of docs/reference/deep-ep.md), not a Python
    AttributeError."""
    ranks = SimulatedRanks(2)
    unraisable: list = []

    def body(g):
        if g.rank() == 1:
            return None  # never joins the exchange: rank 0's constructor fails at its first collective
        import sys

        hook, sys.unraisablehook = sys.unraisablehook, unraisable.append
        try:
            with pytest.raises(Exception):  # noqa: B017 - whatever the failed exchange raises; the destructor is tested
                deep_ep.Buffer(g, num_nvl_bytes=NVL_BYTES)
            import gc

            gc.collect()
        finally:
            sys.unraisablehook = hook
        return None

    ranks.run(body)
    assert [str(u.exc_value) for u in unraisable] == [
        "CUDA error: an illegal memory access was encountered (the destructor's barrier of a buffer whose "
        "constructor failed before the IPC handles were opened)"
    ]
