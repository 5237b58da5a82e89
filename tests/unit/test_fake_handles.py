"""The fake's transfer and prepared-list handles: hashed by their (deterministic) value, compared by identity.

vLLM's NixlEplbCommunicator waits on ``set(handles)``: with an address-based hash the set's order, and so a
simulation's event order and trace, changed from one process to the next.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import numpy as np

from fakes.nixl import FakeFabric, _api, use_fabric

ROOT = Path(__file__).resolve().parents[2]

# ``pad`` objects of a handle's size class made first: the handles land at other addresses in each run.
SCRIPT = """
import json, sys
pad = [(i, i, i) for i in range(int(sys.argv[1]))]
import numpy as np
from fakes.nixl import FakeFabric, _api, use_fabric
with use_fabric(FakeFabric("dram")):
    a = _api.nixl_agent("A")
buf = np.zeros(64, dtype=np.uint8)
a.register_memory([(buf.ctypes.data, 64, 0, "")], "DRAM")
descs = a.get_xfer_descs([(buf.ctypes.data, 8, 0)], "DRAM")
xfers = [a.initialize_xfer("READ", descs, descs, "A") for _ in range(600)]
dlists = [a.prep_xfer_dlist("A", descs) for _ in range(600)]
print(json.dumps([[h._handle for h in set(xfers)], [d._handle for d in set(dlists)]]))
"""


def _set_order(seed: str, pad: int) -> list[list[int]]:
    env = {**os.environ, "PYTHONHASHSEED": seed, "PYTHONPATH": str(ROOT)}
    done = subprocess.run(
        [sys.executable, "-c", SCRIPT, str(pad)], capture_output=True, text=True, env=env, cwd=ROOT, timeout=120
    )
    assert done.returncode == 0, done.stderr[-2000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


def test_a_set_of_handles_iterates_in_the_same_order_in_every_process():
    first = _set_order("0", 0)
    assert len(first[0]) == len(first[1]) == 600
    assert first[0] != sorted(first[0])  # a hash table's order, not the values' (the check below means something)
    for seed, pad in (("1", 777), ("2", 5003)):
        assert _set_order(seed, pad) == first


def _pair() -> tuple[_api.nixl_agent, np.ndarray, Any]:
    with use_fabric(FakeFabric("dram")):
        a = _api.nixl_agent("A")
    buf = np.zeros(64, dtype=np.uint8)
    a.register_memory([(buf.ctypes.data, 64, 0, "")], "DRAM")
    descs = a.get_xfer_descs([(buf.ctypes.data, 8, 0)], "DRAM")
    return a, buf, descs


def test_handles_compare_by_identity_and_hash_by_value():
    a, buf, descs = _pair()
    x, y = a.initialize_xfer("READ", descs, descs, "A"), a.initialize_xfer("READ", descs, descs, "A")
    d = a.prep_xfer_dlist("A", descs)
    for h in (x, d):
        twin = type(h).__new__(type(h))  # another wrapper of the same value (released: its __del__ does nothing)
        twin._handle, twin._agent, twin._released = h._handle, h._agent, True
        assert h == h and h != twin and twin != h and hash(twin) == hash(h)
        assert len({h, twin}) == 2 and twin not in {h}
    assert x != y and len({x, y}) == 2
    assert hash(x) == hash((x._handle,))  # nothing of the object's address
