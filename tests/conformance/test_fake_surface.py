"""The fake has every public name of the real NIXL 1.5.1 modules and classes (``_api``, ``_bindings``, ``_utils``,
``logging``), with the real signatures."""

from __future__ import annotations

from real_backends.coverage import real_extras, surface_gaps
from tests.conftest import real_nixl_or_skip


def test_no_unlisted_gaps() -> None:
    real_api, real_bindings, package = real_nixl_or_skip()
    gaps = surface_gaps(real_api, real_bindings, real_extras(package))
    assert not gaps, (
        f"fake NIXL lacks or differs from the real surface (list it in NOT_MODELLED with a reason, or add it): {gaps}"
    )
