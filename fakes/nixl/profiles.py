"""Named behaviour profiles of the fake NIXL.

Each profile says what it changes against ``dram`` (real NIXL 1.5.1 on host memory, the parity profile) and on what
evidence.  ``epsim conform`` runs the behaviour catalogue against a backend and names the profile it matches.
"""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(frozen=True)
class Profile:
    name: str
    summary: str
    evidence: str
    # Memory types that registrations of (fake) host memory may carry.  Real UCX refuses host pointers as VRAM.
    vram_ok: bool = False
    # Re-registering the same range gives the same remote key (cma: metadata byte-identical), or a new one (RDMA).
    stable_keys: bool = True
    # A transfer touching memory that is no longer registered: "copy" as cma/NVLink do, "fail" as an RDMA NIC does.
    unregistered_access: str = "copy"
    # Loading a peer's metadata in which a known region carries a new remote key: merged (dram) or NOT_ALLOWED.
    refuse_changed_keys: bool = False
    # A second registration of memory overlapping a live registration within one (simulated) process fails.
    exclusive_pages: bool = False
    # Use of a released handle: "crash" (SIGSEGV as in 1.5.1) or "raise" (nixlInvalidParamError, a stricter fake).
    released_handle_use: str = "crash"
    # A remembered range reused with a different extent (address recycled by the allocator) is refused at post.
    detect_recycled: bool = False
    memory: str = "DRAM"  # what the profile's memory is on real hardware
    differs_from_dram: tuple[str, ...] = field(default=())


PROFILES: dict[str, Profile] = {
    p.name: p
    for p in (
        Profile(
            name="dram",
            summary="Real NIXL 1.5.1 over UCX on host memory (cma/tcp on one host).",
            evidence="nixl-cu12 1.5.1 on CPU: the conformance catalogue, run by `epsim conform --backend real` in CI.",
        ),
        Profile(
            name="cuda",
            summary="Real NIXL 1.5.1 over UCX on NVIDIA VRAM (NVLink between two H200s).",
            evidence="nixl-cu13 1.5.1 on 2x H200 (docs/conformance-h200.md): duplicate registration benign, READ after "
            "deregistration still copies, destroyed or exited peers give nixlRemoteDisconnectError.",
            vram_ok=True,
            released_handle_use="raise",
            detect_recycled=True,
            memory="VRAM",
            differs_from_dram=(
                "VRAM registrations of simulated device memory are accepted",
                "use of a released handle raises nixlInvalidParamError instead of SIGSEGV",
                "a recycled address with a new extent is refused at post",
            ),
        ),
        Profile(
            name="rdma",
            summary="UCX over an RDMA NIC (InfiniBand/RoCE): memory keys are checked by the hardware.",
            evidence="Modelled, not confirmed here: NIXL's source notes on rkeys; modelexpress PR #575; ray PR #60602 "
            "(deregister + re-register between refreshes gives NOT_ALLOWED); nixl#380 (unmapped memory).",
            stable_keys=False,
            unregistered_access="fail",
            refuse_changed_keys=True,
            released_handle_use="raise",
            detect_recycled=True,
            differs_from_dram=(
                "a transfer touching deregistered or freed memory fails with nixlRemoteDisconnectError",
                "re-registration gives a new remote key; a peer reload carrying it is NOT_ALLOWED",
                "use of a released handle raises nixlInvalidParamError instead of SIGSEGV",
                "a recycled address with a new extent is refused at post",
            ),
        ),
        Profile(
            name="rocm-strict",
            summary="RIXL / nixl_rocm on AMD MI355: a second registration of the same pages in one process fails.",
            evidence="Modelled, not confirmed here: vLLM #53025 (EPLB test failed after repeatedly registering NIXL "
            "memory on MI355); ray#60432; nixl PR #1773 (proposal to reject duplicate registration).",
            vram_ok=True,
            exclusive_pages=True,
            released_handle_use="raise",
            detect_recycled=True,
            memory="VRAM",
            differs_from_dram=(
                "registering memory that overlaps a live registration in the same process raises nixlBackendError",
                "use of a released handle raises nixlInvalidParamError instead of SIGSEGV",
                "a recycled address with a new extent is refused at post",
            ),
        ),
    )
}

DEFAULT = "dram"


def get(name: str) -> Profile:
    try:
        return PROFILES[name]
    except KeyError:
        known = ", ".join(PROFILES)
        raise LookupError(f"NIXL profile {name!r} not found; known: {known}") from None
