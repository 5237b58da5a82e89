"""epsim: a simulation and fault-injection testbed for elastic expert-parallel communicator lifecycles.

The front door imports nothing heavy (no torch, no NIXL): importing ``sim`` must stay cheap for the CLI and the
pytest plugin.
"""

from importlib.metadata import PackageNotFoundError, version

from .errors import BackendUnavailable, EpsimError, ScenarioError, UnknownName, UnknownStrategy

try:
    __version__ = version("epsim")
except PackageNotFoundError:  # running from a source tree that was not installed
    __version__ = "0+unknown"

__all__ = ["__version__", "EpsimError", "ScenarioError", "UnknownStrategy", "UnknownName", "BackendUnavailable"]
