"""The NIXL behaviour catalogue: pytest-free checks that run against the fake and the real library alike.

A case drives a backend through the real ``nixl._api`` surface and returns an *observation*: plain data (return
values, exception class names, ``"SIGSEGV"`` for a crash).  Each case states what it expects on the ``dram``
profile (real NIXL 1.5.1 on host memory) and, where a stricter profile deliberately differs, what that profile
expects instead.  ``tests/conformance`` runs every case for ``fake`` and ``real``; ``epsim conform`` runs them
against one backend and names the profile whose expectations all hold.
"""

from .catalogue import CASES, Case, expected, matched_profile, observe

__all__ = ["CASES", "Case", "expected", "matched_profile", "observe"]
