"""The fake process groups against gloo: one test, two parameters (fake, real), per case of
``process_group_cases``.  The real side is torch's own gloo on this CPU machine, three processes on a stateless group
(``real_backends.groups``, as vLLM's elastic EP makes them), so it runs in every CI run.  The fake side kills a
rank the way the simulated cluster does (``Kernel.kill_process``, then ``torch_dist.process_gone``)."""

from __future__ import annotations

import multiprocessing
import os
import queue
import signal
import time

import pytest

from tests.conformance import process_group_cases as cases


def _fake(name: str, case: cases.Case) -> dict[int, list]:
    from fakes import torch_dist
    from sim.kernel import Kernel

    kernel = Kernel(seed=0)
    groups = torch_dist.Rendezvous(kernel, name, list(range(cases.WORLD))).groups()
    seen: dict[int, list] = {}

    def rank_main(g) -> None:
        seen[g.rank()] = case.body(g, g.rank(), cases.Clock())  # simulated time: 0 for every rank

    def killer(rank: int, at: float) -> None:
        kernel.sleep(at)
        kernel.kill_process(rank)
        torch_dist.process_gone(kernel, rank, "was killed")

    with torch_dist.installed():
        for g in groups:
            kernel.spawn(f"rank{g.rank()}", rank_main, g, pid=g.rank())
        if case.kill is not None:
            kernel.spawn("killer", killer, *case.kill, pid=99)
        kernel.run()
    assert not kernel.crashes, kernel.crashes
    kernel.close()
    return seen


def _real_rank(name: str, rank: int, port: int, out) -> None:
    import torch
    import torch.distributed as dist

    from real_backends.groups import GroupSpec, connect_store, open_group

    store = connect_store("127.0.0.1", port, 60.0)
    group = open_group(store, GroupSpec(name, rank, cases.WORLD), 60.0)
    dist.all_reduce(torch.ones(1), group=group)  # every pair connected before the case's clock starts
    out.put((rank, "ready", None))
    start = float(store.get("start").decode())  # the parent's choice, on the machine's one monotonic clock
    time.sleep(max(0.0, start - time.monotonic()))
    out.put((rank, "rows", cases.CASES[name].body(group, rank, cases.Clock(start))))


def _real(name: str, case: cases.Case) -> dict[int, list]:
    from torch.distributed import TCPStore

    store = TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
    ctx = multiprocessing.get_context("spawn")
    out = ctx.Queue()
    procs = [ctx.Process(target=_real_rank, args=(name, r, store.port, out), daemon=True) for r in range(cases.WORLD)]
    for p in procs:
        p.start()
    seen: dict[int, list] = {}
    try:
        for _ in range(cases.WORLD):
            out.get(timeout=120)  # "ready"
        start = time.monotonic() + 0.5  # every rank sleeps until then, and the kill counts from it
        store.set("start", repr(start))
        if case.kill is not None:
            rank, at = case.kill
            time.sleep(max(0.0, start + at - time.monotonic()))
            pid = procs[rank].pid
            assert pid is not None  # started above
            os.kill(pid, signal.SIGKILL)
        survivors = cases.WORLD - (case.kill is not None)
        while len(seen) < survivors:
            rank, kind, rows = out.get(timeout=60)
            if kind == "rows":
                seen[rank] = rows
    except queue.Empty:
        pytest.fail(f"gloo case {name}: ranks {sorted(set(range(cases.WORLD)) - set(seen))} never reported")
    finally:
        for p in procs:
            p.join(10)
            if p.is_alive():
                p.kill()
    return seen


@pytest.mark.parametrize("impl", ["fake", "real"])
@pytest.mark.parametrize("name", sorted(cases.CASES))
def test_process_groups_agree_with_gloo(name: str, impl: str) -> None:
    case = cases.CASES[name]
    seen = _fake(name, case) if impl == "fake" else _real(name, case)
    assert case.expected is not None
    assert cases.agree(seen, case.expected), seen
    if impl == "fake":  # simulated time: exactly on the second
        assert all(t == want for r in seen for (_, _, t), (_, _, want) in zip(seen[r], case.expected[r]))
