"""``--strategy vllm[:PATH]``: vLLM's ``NixlEplbCommunicator``, built by vLLM's own ``create_eplb_communicator``
with the arguments vLLM's ``EplbState.create_communicator`` passes: a group coordinator, the ``"nixl"`` backend,
the model's ``expert_weights`` (every MoE layer's tensors) and the ``expert_buffer``, the same list objects every
time.  vLLM 0.33.0's factory takes no previous communicator; the one epsim hands over is dropped, as vLLM drops it.

This module is loaded afresh for every simulated process (as every strategy is), and loads that process's own
instance of vLLM's modules when it is configured.
"""

from __future__ import annotations

import importlib
from typing import Any

import torch

from sim.errors import UnknownStrategy

from . import device, loader, source

COMMUNICATOR_MODULE = "vllm.distributed.eplb.eplb_communicator"
BACKEND = "nixl"  # ParallelConfig.eplb_config.communicator

_vllm: loader.VllmModules | None = None
_views: device.ViewCache | None = None
_bound = False


def configure(path: str | None, name: str):
    """Load this process's vLLM modules; the factory to hand to the workers.  A source that does not load is a
    bad ``--strategy``, in one line."""
    global _vllm
    where = source.locate(path)
    try:
        _vllm = loader.load(where, COMMUNICATOR_MODULE)
    except UnknownStrategy:
        raise
    except (Exception, SystemExit) as exc:  # noqa: BLE001 - a vLLM branch that does not import here
        raise UnknownStrategy(f"strategy {name!r}: vLLM's {COMMUNICATOR_MODULE} from {where.origin} does not load "
                              f"here: {type(exc).__name__}: {exc}") from exc
    if not hasattr(_vllm[COMMUNICATOR_MODULE], "create_eplb_communicator"):
        raise UnknownStrategy(f"strategy {name!r}: {where.origin} has no create_eplb_communicator in "
                              f"{COMMUNICATOR_MODULE}")
    return create


def modules() -> loader.VllmModules:
    assert _vllm is not None, "configure() first"
    return _vllm


def coordinator(group: Any, stateless: bool) -> Any:
    """vLLM's coordinator of the EPLB group: a stateless one for groups made at an elastic reconfiguration."""
    name = "vllm.distributed.stateless_coordinator" if stateless else "vllm.distributed.parallel_state"
    cls = "StatelessGroupCoordinator" if stateless else "GroupCoordinator"
    return getattr(modules()[name], cls)(group)


def views(group: Any, expert_weights: Any, expert_buffer: Any) -> tuple[list, list]:
    """The weights and buffer as the code under test sees them: on this process's GPU (``cuda:<rank at start>``)."""
    global _views
    if _views is None:
        _views = device.ViewCache(torch.device("cuda", group.rank() % 8))
    return _views.views(expert_weights), _views.views(expert_buffer)


def bind_nixl(expert_weights: Any) -> None:
    """Once per process, before vLLM first asks for NIXL: the platform the stand-ins report, and where the world's
    memory is host memory, vLLM's ``NixlWrapper`` bound to the NIXL it would import wrapped by
    :func:`sim.vllm.device.host_memory_agent`.  Elsewhere vLLM's ``nixl_utils`` binds it itself, on first use."""
    global _bound
    if _bound:
        return
    _bound = True
    vllm = modules()
    fake = _fake_profile()
    if fake is not None:
        vllm.world.platform = "rocm" if fake.name == "rocm-strict" else "cuda"
        takes_device_memory = fake.vram_ok
    else:
        vllm.world.platform = "rocm" if getattr(torch.version, "hip", None) else "cuda"
        first = expert_weights[0][0]
        takes_device_memory = torch.Tensor.device.__get__(first).type != "cpu"
    if takes_device_memory:
        return
    nixl_utils = vllm["vllm.distributed.nixl_utils"]
    package = "nixl_rocm" if vllm.world.platform == "rocm" else "nixl"
    try:
        api = importlib.import_module(f"{package}._api")
    except ImportError:
        return  # vLLM finds no NIXL either, and says so
    nixl_utils.NixlWrapper = device.host_memory_agent(api.nixl_agent)
    nixl_utils.nixl_agent_config = getattr(api, "nixl_agent_config", None)


def _fake_profile():
    """The fake NIXL's profile if ``nixl._api`` is the fake now, else None."""
    import sys

    import fakes.install

    api = sys.modules.get("nixl._api")
    if api is None or not fakes.install.is_fake(api):
        return None
    from fakes.nixl._fabric import current_fabric

    return current_fabric().profile


def create(group: Any, expert_weights: Any, expert_buffer: Any, prev_communicator: Any = None) -> Any:
    weights, buffer = views(group, expert_weights, expert_buffer)
    bind_nixl(expert_weights)
    factory = modules()[COMMUNICATOR_MODULE].create_eplb_communicator
    return factory(coordinator(group, stateless=prev_communicator is not None), BACKEND, weights, buffer)
