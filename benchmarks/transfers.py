"""Real transfers: NIXL READ throughput for expert-sized transfers against a torch copy of the same bytes.

Two real NIXL agents in this process (UCX on host memory, as CI has it), one READ of S bytes at a time from one
agent's registered tensor into the other's, posted and polled to DONE, against ``dst.copy_(src)`` of the same
bytes in the same process, on one torch thread: NIXL's progress thread spins on a core, and a two-thread torch copy
on a two-core machine then waits for its second thread (medians of 0.1 to 60 GB/s for the same 1 MiB copy).  Sizes 1 MiB to 64 MiB.  On a GPU the same is done with VRAM tensors on two devices
against a torch peer copy (``gpu`` only; not measured without one).
"""

from __future__ import annotations

import logging
import statistics
import time
from typing import Any

MIB = 1 << 20


def _rates(fns, nbytes: int, repeats: int) -> list[float]:
    """Median bytes/s of each function, measured in turns so that both see the same machine."""
    for fn in fns:
        fn()  # warm: connection wire-up, page faults
    times: list[list[float]] = [[] for _ in fns]
    for _ in range(repeats):
        for i, fn in enumerate(fns):
            started = time.perf_counter()
            fn()
            times[i].append(time.perf_counter() - started)
    return [nbytes / statistics.median(t) for t in times]


def measure(sizes_mib=(1, 4, 16, 64), repeats: int = 15, device: str = "cpu") -> dict[str, Any]:
    import torch

    from real_backends.nixl_real import import_real_nixl

    api, _, package = import_real_nixl()
    for name in list(logging.root.manager.loggerDict):  # its INFO lines go to stdout, where --json prints
        if name.startswith(("nixl", package)):
            logging.getLogger(name).setLevel(logging.WARNING)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        return _measure(api, package, sizes_mib, repeats, device)
    finally:
        torch.set_num_threads(threads)


def _measure(api, package: str, sizes_mib, repeats: int, device: str) -> dict[str, Any]:
    import torch

    mem = "VRAM" if device == "cuda" else "DRAM"
    dev_a, dev_b = ("cuda:0", "cuda:1") if device == "cuda" else ("cpu", "cpu")
    cfg = api.nixl_agent_config(backends=["UCX"])
    reader, owner = api.nixl_agent("bench-reader", cfg), api.nixl_agent("bench-owner", cfg)
    out: dict[str, Any] = {"package": package, "memory": mem, "sizes": {}}
    for mib in sizes_mib:
        nbytes = mib * MIB
        src = torch.randint(0, 255, (nbytes,), dtype=torch.uint8, device=dev_b)
        dst = torch.zeros(nbytes, dtype=torch.uint8, device=dev_a)
        reg_src, reg_dst = owner.register_memory([src]), reader.register_memory([dst])
        reader.add_remote_agent(owner.get_agent_metadata())
        local = reader.prep_xfer_dlist("NIXL_INIT_AGENT", [dst], mem)
        remote = reader.prep_xfer_dlist(owner.name, reader.get_xfer_descs([(src.data_ptr(), nbytes, max(
            src.get_device(), 0))], mem), mem)

        def nixl_read() -> None:
            xfer = reader.make_prepped_xfer("READ", local, [0], remote, [0])
            state = reader.transfer(xfer)
            while state != "DONE":
                state = reader.check_xfer_state(xfer)
                if state not in ("PROC", "DONE"):
                    raise RuntimeError(f"READ failed: {state}")
            reader.release_xfer_handle(xfer)

        def torch_copy() -> None:
            dst.copy_(src)
            if device == "cuda":
                torch.cuda.synchronize()

        nixl_read()
        assert torch.equal(dst, src), "the READ did not move the bytes"
        nixl_rate, copy_rate = _rates([nixl_read, torch_copy], nbytes, repeats)
        out["sizes"][f"{mib}MiB"] = {"nixl_GBps": round(nixl_rate / 1e9, 2), "torch_GBps": round(copy_rate / 1e9, 2),
                                     "ratio": round(nixl_rate / copy_rate, 3)}
        reader.release_dlist_handle(local)
        reader.release_dlist_handle(remote)
        reader.remove_remote_agent(owner.name)
        reader.deregister_memory(reg_dst)
        owner.deregister_memory(reg_src)
    out["min_ratio"] = min(v["ratio"] for v in out["sizes"].values())
    return out
