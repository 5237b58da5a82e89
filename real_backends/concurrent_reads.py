"""Do READs that one process posts together share its bandwidth?  The evidence for the simulation's link model.

The simulated fake NIXL lets the transfers a process posts share its link (``FakeFabric.xfer_duration``): k READs
posted together finish after one fixed cost and k times the bytes.  This measures the same thing on the real NIXL,
between two processes as ranks are: the median time of one READ of ``size``, of k READs of ``size`` posted together
and polled until every one is DONE, and of one READ of k times ``size``.  ``together / (k x one)`` near 1 says the
bytes take turns (the model); near ``1/k`` would say every READ had the whole bandwidth (the model before).

    python -m benchmarks.concurrent_reads [--device cpu|cuda] [--k 4] [--sizes-mib 1 4 16 64] [--repeats 9]

prints one JSON object; ``docs/results/real/concurrent-reads-*.json`` hold the recorded runs (``docs/validation.md``).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time
from typing import Any

from real_backends.transfers import MIB, _pattern, _quiet, from_owner, memory_and_devices, start_owner, stop_owner


def measure(device: str = "cpu", k: int = 4, sizes_mib=(1, 4, 16, 64), repeats: int = 9) -> dict[str, Any]:
    import torch

    from real_backends.nixl_real import import_real_nixl

    os.environ.setdefault("NIXL_LOG_LEVEL", "WARN")
    api, _, package = import_real_nixl()
    _quiet(package)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # NIXL's progress thread needs a core of its own on a small machine
    mem, dev_a, dev_b = memory_and_devices(device)
    total = int(max(sizes_mib) * MIB) * k
    # The owner registers one buffer of ``total`` bytes (transfers' owner, given one size), read in slices.
    owner, conn = start_owner(package, (total / MIB,), dev_b)
    out: dict[str, Any] = {"package": package, "memory": mem, "devices": [dev_a, dev_b], "k": k, "sizes": {}}
    try:
        # Made inside the try: if it fails, the owner is told (its pipe closed) and joined.
        reader = api.nixl_agent("concurrent-reader", api.nixl_agent_config(backends=["UCX"]))
        metadata, addr, dev_id = from_owner(conn, owner)
        dst = torch.zeros(total, dtype=torch.uint8, device=dev_a)
        if dst.is_cuda:
            torch.cuda.synchronize()
        reg = reader.register_memory([dst])
        name = reader.add_remote_agent(metadata)
        name = name.decode() if isinstance(name, bytes) else name
        local_base, local_dev = dst.data_ptr(), max(dst.get_device(), 0)

        def reads(count: int, nbytes: int) -> float:
            """Seconds from posting ``count`` READs of ``nbytes`` (consecutive slices) to the last one DONE."""
            made = []
            for i in range(count):
                local = reader.prep_xfer_dlist(
                    "NIXL_INIT_AGENT", reader.get_xfer_descs([(local_base + i * nbytes, nbytes, local_dev)], mem), mem
                )
                remote = reader.prep_xfer_dlist(
                    name, reader.get_xfer_descs([(addr + i * nbytes, nbytes, dev_id)], mem), mem
                )
                made.append((reader.make_prepped_xfer("READ", local, [0], remote, [0]), local, remote))
            started = time.perf_counter()
            for xfer, _, _ in made:
                state = reader.transfer(xfer)
                if state not in ("PROC", "DONE"):
                    raise RuntimeError(f"READ failed: {state}")
            for xfer, _, _ in made:
                while (state := reader.check_xfer_state(xfer)) != "DONE":
                    if state != "PROC":
                        raise RuntimeError(f"READ failed: {state}")
            elapsed = time.perf_counter() - started
            for xfer, local, remote in made:
                reader.release_xfer_handle(xfer)
                reader.release_dlist_handle(local)
                reader.release_dlist_handle(remote)
            return elapsed

        reads(1, int(min(sizes_mib) * MIB))  # the first READ towards the peer pays the endpoint's wire-up
        for mib in sizes_mib:
            nbytes = int(mib * MIB)
            one, together, big = [], [], []
            for _ in range(repeats):  # interleaved, so that drift in the machine's speed hits all three alike
                one.append(reads(1, nbytes))
                together.append(reads(k, nbytes))
                big.append(reads(1, k * nbytes))
            o, t, b = (statistics.median(x) for x in (one, together, big))
            out["sizes"][f"{mib:g}MiB"] = {
                "one_s": o,
                "together_s": t,
                "one_of_k_times_the_bytes_s": b,
                "together_over_k_one": round(t / (k * o), 3),
                "together_over_one_of_k_times_the_bytes": round(t / b, 3),
            }
        out["bytes_ok"] = bool(torch.equal(dst.cpu(), _pattern(total, "cpu")))
        reader.remove_remote_agent(name)
        reader.deregister_memory(reg)
        conn.send("next")  # the owner's only size: it deregisters and ends
    finally:
        torch.set_num_threads(threads)
        stop_owner(conn, owner)
    return out


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.concurrent_reads", description=__doc__.split("\n")[0])
    parser.add_argument("--device", choices=["cpu", "cuda"], default="cpu")
    parser.add_argument("--k", type=int, default=4)
    parser.add_argument("--sizes-mib", type=float, nargs="+", default=[1, 4, 16, 64])
    parser.add_argument("--repeats", type=int, default=9)
    args = parser.parse_args(argv)
    print(json.dumps(measure(args.device, args.k, tuple(args.sizes_mib), args.repeats), indent=1))


if __name__ == "__main__":
    main()
