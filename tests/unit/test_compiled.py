"""sim/compiled.py: fresh module instances share one compilation of their file, and an edited file is compiled
again."""

from __future__ import annotations

import importlib.util
import os

from sim.compiled import CompiledOnce


def _instance(path, name):
    spec = importlib.util.spec_from_file_location(name, path, loader=CompiledOnce(name, str(path)))
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_instances_are_separate_modules_over_one_compilation(tmp_path):
    path = tmp_path / "strategy_file.py"
    path.write_text("state = []\n\ndef f():\n    return 1\n")
    a, b = _instance(path, "inst_a"), _instance(path, "inst_b")
    a.state.append("only a's")
    assert b.state == [] and a.f is not b.f  # module-level state is each instance's own
    assert a.f.__code__ is b.f.__code__  # compiled once


def test_an_edited_file_is_compiled_again(tmp_path):
    path = tmp_path / "edited.py"
    path.write_text("def f():\n    return 1\n")
    assert _instance(path, "ed_1").f() == 1
    path.write_text("def f():\n    return 22\n")
    os.utime(path, ns=(os.stat(path).st_atime_ns, os.stat(path).st_mtime_ns + 1_000_000))
    assert _instance(path, "ed_2").f() == 22
