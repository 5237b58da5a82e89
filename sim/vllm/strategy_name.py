"""The ``vllm`` strategy names: ``vllm``, ``vllm:PATH``, ``vllm+shared-agent``, ``vllm+shared-agent:PATH``.

``+shared-agent`` is vLLM's communicator with the change under review applied as epsim's own subclass (the
previous communicator's agent passed on; see :mod:`sim.vllm.shared_agent`).  Kept apart from :mod:`.strategy` so
that naming a strategy imports nothing heavy.
"""

from __future__ import annotations

from typing import Callable

VARIANTS = {
    "vllm": "sim.vllm.strategy",
    "vllm+shared-agent": "sim.vllm.shared_agent",
}


def is_vllm(name: str) -> bool:
    return name.partition(":")[0] in VARIANTS


def split(name: str) -> tuple[str, str | None]:
    """(variant, source path or None)."""
    variant, _, path = name.partition(":")
    return variant, (path or None)


def load(name: str, fresh: bool) -> Callable:
    """The factory of a ``vllm`` strategy, over this process's own instance of vLLM's modules."""
    import importlib

    variant, path = split(name)
    # Each call makes a new process's vLLM (``fresh`` or not: a rank process loads it once).
    return importlib.import_module(VARIANTS[variant]).configure(path, name)
