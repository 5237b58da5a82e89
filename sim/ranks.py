"""Simulated ranks of one fake process group, for code written against a collective library (the fake DeepEP's
tests, its behaviour catalogue, the pytest plugin's ``fake_deep_ep`` fixture). Imports nothing heavy until used."""

from __future__ import annotations


class SimulatedRanks:
    """``n`` simulated ranks (one thread each, pids 0..n-1) of one fake process group, in a kernel of their own."""

    def __init__(self, n: int, seed: int = 0, nvshmem: str = "stock") -> None:
        from fakes import deep_ep
        from fakes.torch_dist import Rendezvous
        from sim.kernel import Kernel

        self.kernel = Kernel(seed)
        deep_ep.configure(self.kernel, nvshmem)
        self.groups = Rendezvous(self.kernel, "ep", list(range(n))).groups()

    def new_group(self, name: str, pids: list[int]) -> list:
        """Another group over some of the same processes (an elastic reconfiguration's new EP group)."""
        from fakes.torch_dist import Rendezvous

        return Rendezvous(self.kernel, name, list(pids)).groups()

    def run(self, body) -> list:
        results: list = [None] * len(self.groups)

        def rank_main(g):
            try:
                results[g.rank()] = body(g)
            except BaseException as exc:  # noqa: BLE001 - handed back to the test
                results[g.rank()] = exc

        for g in self.groups:
            self.kernel.spawn(f"rank{g.rank()}", rank_main, g, pid=g.rank())
        self.kernel.run()
        return results
