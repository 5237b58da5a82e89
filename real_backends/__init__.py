"""Adapters to the real libraries: real NIXL for the conformance catalogue and (later) the multi-process runner."""
