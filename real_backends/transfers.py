"""Real transfers: NIXL READ throughput for expert-sized transfers against a torch copy of the same bytes.

A real NIXL agent in this process READs S bytes at a time (1 MiB to 64 MiB) from an agent in a child process, as
ranks do (UCX on host memory, as CI has it), posted and polled to DONE, against ``dst.copy_(src)`` of the same bytes
in this process.  The copy runs on one torch thread: NIXL's progress thread spins on a core, and a two-thread torch
copy on a two-core machine then waits for its second thread (medians of 0.1 to 60 GB/s for the same 1 MiB copy).
With ``device="cuda"`` the tensors are in VRAM, on two GPUs when there are two, against a torch peer copy.
"""

from __future__ import annotations

import logging
import os
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


def measure(
    sizes_mib=(1, 4, 16, 64), repeats: int = 15, device: str = "cpu", prep_each: bool = False
) -> dict[str, Any]:
    """``prep_each``: every READ prepares its descriptor lists afresh and releases them, as the EPLB communicator's
    ``add_recv`` does (the calibration measures that path); otherwise the lists are prepared once."""
    import torch

    from real_backends.nixl_real import import_real_nixl

    api, _, package = import_real_nixl()
    _quiet(package)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        return _measure(api, package, sizes_mib, repeats, device, prep_each)
    finally:
        torch.set_num_threads(threads)


def _quiet(package: str) -> None:
    """NIXL's INFO lines go to stdout, where ``--json`` prints."""
    for name in list(logging.root.manager.loggerDict):
        if name.startswith(("nixl", package)):
            logging.getLogger(name).setLevel(logging.WARNING)


def _pattern(nbytes: int, device: str):
    import torch

    return (torch.arange(nbytes, dtype=torch.int64, device=device) % 251).to(torch.uint8)


def _owner(conn, package: str, sizes_mib, device: str) -> None:
    """The peer process: an agent that registers one tensor per size and answers the reader's READs."""
    import importlib

    import torch

    api = importlib.import_module(f"{package}._api")
    _quiet(package)
    agent = api.nixl_agent("bench-owner", api.nixl_agent_config(backends=["UCX"]))
    for mib in sizes_mib:
        src = _pattern(mib * MIB, device)
        if src.is_cuda:
            torch.cuda.synchronize()  # the kernels that fill it are asynchronous; a READ must find it filled
        reg = agent.register_memory([src])
        try:
            conn.send((agent.get_agent_metadata(), src.data_ptr(), max(src.get_device(), 0)))
            conn.recv()  # the reader is done with this size
        except (EOFError, OSError):  # the reader stopped (an error there, said there, or it gave up waiting for this
            return  # process in from_owner): nothing left to serve, and nothing to add
        agent.deregister_memory(reg)
    conn.close()


def start_owner(package: str, sizes_mib, device: str):
    """The owner process and this side's end of its pipe.  This process closes its copy of the owner's end, so
    that an owner that dies (a failed import, a crash in the library) reads as an end of file here, not silence."""
    import multiprocessing as mp

    ctx = mp.get_context("spawn")
    conn, child_end = ctx.Pipe()
    owner = ctx.Process(target=_owner, args=(child_end, package, tuple(sizes_mib), device), daemon=True)
    owner.start()
    child_end.close()
    return owner, conn


def stop_owner(conn, owner) -> None:
    """End the owner process: closing this end tells an owner still waiting for "next" (this side failed) to stop;
    one that does not is killed, and reaped either way."""
    conn.close()
    owner.join(30)
    if owner.is_alive():
        owner.kill()
        owner.join(10)


def from_owner(conn, owner, wait_s: float = 120.0):
    """The owner's next message: its registered memory.  An owner that died or never answered is one clear error
    (the reader used to wait on the pipe for ever)."""
    from sim.errors import BackendUnavailable

    try:
        if conn.poll(wait_s):
            return conn.recv()
    except (EOFError, OSError):
        pass
    owner.join(5)
    how = "gave no answer" if owner.exitcode is None else f"exited with status {owner.exitcode}"
    raise BackendUnavailable(
        f"the NIXL peer process {how} before registering its memory; run the benchmark alone to see its error"
    )


def memory_and_devices(device: str) -> tuple[str, str, str]:
    """(NIXL memory type, the reader's device, the owner's device): two GPUs when there are two, else one for both."""
    if device != "cuda":
        return "DRAM", "cpu", "cpu"
    import torch

    return ("VRAM", "cuda:0", "cuda:1") if torch.cuda.device_count() >= 2 else ("VRAM", "cuda:0", "cuda:0")


def _measure(api, package: str, sizes_mib, repeats: int, device: str, prep_each: bool = False) -> dict[str, Any]:
    import torch

    mem, dev_a, dev_b = memory_and_devices(device)
    # The owner is another process, as every rank is in vLLM (UCX then takes its inter-process paths: cma or shared
    # memory on the host, CUDA IPC between GPUs); the torch baseline copies in this process.
    owner, conn = start_owner(package, sizes_mib, dev_b)
    out: dict[str, Any] = {"package": package, "memory": mem, "devices": [dev_a, dev_b], "sizes": {}}
    # UCX's settings pick the path a READ takes: on a GPU without active NVLinks, cuda_ipc leaves GET zero-copy off
    # unless UCX_CUDA_IPC_ENABLE_GET_ZCOPY=on, and the READ falls back to software emulation over TCP (on one H200:
    # 0.6 GB/s against 21-978 GB/s from 1 to 64 MiB; docs/gpu-validation.md). A figure names the settings it was
    # measured under.
    out["ucx_env"] = {k: v for k, v in sorted(os.environ.items()) if k.startswith("UCX_")}
    try:
        reader = api.nixl_agent("bench-reader", api.nixl_agent_config(backends=["UCX"]))  # failing: the owner ends
        for mib in sizes_mib:
            nbytes = int(mib * MIB)
            metadata, addr, dev_id = from_owner(conn, owner)
            src = _pattern(nbytes, dev_b)  # the same bytes, for the torch baseline
            dst = torch.zeros(nbytes, dtype=torch.uint8, device=dev_a)
            if dst.is_cuda:
                # torch fills dst on its own stream; a READ's copy runs on UCX's, and a zero-fill still queued
                # behind the pattern kernels above would land after the READ (seen on one H200: DONE, zeros).
                torch.cuda.synchronize()
            reg_dst = reader.register_memory([dst])
            connect_started = time.perf_counter()
            name = reader.add_remote_agent(metadata)
            name = name.decode() if isinstance(name, bytes) else name
            local = reader.prep_xfer_dlist("NIXL_INIT_AGENT", [dst], mem)
            remote = reader.prep_xfer_dlist(name, reader.get_xfer_descs([(addr, nbytes, dev_id)], mem), mem)

            def nixl_read() -> None:
                lh, rh = local, remote
                if prep_each:
                    lh = reader.prep_xfer_dlist("NIXL_INIT_AGENT", reader.get_xfer_descs([dst], mem), mem)
                    rh = reader.prep_xfer_dlist(name, reader.get_xfer_descs([(addr, nbytes, dev_id)], mem), mem)
                xfer = reader.make_prepped_xfer("READ", lh, [0], rh, [0])
                state = reader.transfer(xfer)
                while state != "DONE":
                    state = reader.check_xfer_state(xfer)
                    if state not in ("PROC", "DONE"):
                        raise RuntimeError(f"READ failed: {state}")
                reader.release_xfer_handle(xfer)
                if prep_each:
                    reader.release_dlist_handle(lh)
                    reader.release_dlist_handle(rh)

            def torch_copy() -> None:
                dst.copy_(src)
                if device == "cuda":
                    torch.cuda.synchronize()

            nixl_read()  # the first READ towards this peer: with the metadata load, it pays the endpoint's wire-up
            first_s = time.perf_counter() - connect_started
            assert torch.equal(dst, src.to(dst.device)), "the READ did not move the bytes"
            nixl_rate, copy_rate = _rates([nixl_read, torch_copy], nbytes, repeats)
            out["sizes"][f"{mib}MiB"] = {
                "bytes": nbytes,
                "nixl_s": nbytes / nixl_rate,
                "first_s": first_s,
                "nixl_GBps": round(nixl_rate / 1e9, 2),
                "torch_GBps": round(copy_rate / 1e9, 2),
                "ratio": round(nixl_rate / copy_rate, 3),
            }
            reader.release_dlist_handle(local)
            reader.release_dlist_handle(remote)
            reader.remove_remote_agent(name)
            reader.deregister_memory(reg_dst)
            conn.send("next")
    finally:
        stop_owner(conn, owner)
    out["min_ratio"] = min(v["ratio"] for v in out["sizes"].values())
    return out
