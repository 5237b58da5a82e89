"""epsim's pytest plugin (entry point ``pytest11: epsim``): fixtures for testing code against the fakes.

It imports nothing heavy at load time (no torch, no NIXL, no simulator): pytest loads it in every session of every
project that installed epsim.
"""

from __future__ import annotations

import pytest


def pytest_configure(config) -> None:
    config.addinivalue_line("markers", "nixl_profile(name): the fake NIXL profile for the fake_nixl fixture "
                                       "(dram, cuda, rdma, rocm-strict)")


@pytest.fixture
def fake_nixl(request):
    """A fresh fake-NIXL world with the import shims installed: inside the test, ``import nixl._api`` (and the
    nixl_cu12, nixl_cu13, rixl, nixl_rocm variants) gives the fake, and every agent lives in the yielded
    :class:`fakes.nixl.FakeFabric`.  ``@pytest.mark.nixl_profile("rdma")`` picks the profile."""
    import fakes
    from fakes.nixl import FakeFabric

    marker = request.node.get_closest_marker("nixl_profile")
    fabric = FakeFabric(marker.args[0] if marker else "dram")
    with fakes.installed(fabric):
        yield fabric
