"""`./dev test`'s pytest options end a run whose worker crashes, instead of waiting for ever.

pytest-xdist 3.8 under ``--dist loadfile`` can hang after replacing a crashed worker (a file whose only test
crashed leaves the replacement waiting for work that never comes); real NIXL crashed a worker once in this suite
and the session hung. The options are read from the ``dev`` script itself and run on a small suite in a temporary
folder: one file whose only test segfaults, two that pass.
"""

from __future__ import annotations

import shlex
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def dev_test_options() -> list[str]:
    line = next(line for line in (ROOT / "dev").read_text().splitlines() if line.strip().startswith("test)"))
    words = shlex.split(line.split("-m pytest", 1)[1].split(";;", 1)[0])
    return [w for w in words if w != "$@"]


def test_a_crashed_worker_fails_its_test_and_the_run_ends(tmp_path) -> None:
    (tmp_path / "test_crash.py").write_text(
        "import os, signal\n\ndef test_segfaults():\n    os.kill(os.getpid(), signal.SIGSEGV)\n"
    )
    for name in ("a", "b"):
        (tmp_path / f"test_{name}.py").write_text("def test_one():\n    pass\n\ndef test_two():\n    pass\n")
    options = dev_test_options()
    assert "--max-worker-restart=0" in options
    options[options.index("auto")] = "2"  # two workers on any machine: the hang needs a crash and another worker
    done = subprocess.run(
        [sys.executable, "-m", "pytest", *options, "-q", "-p", "no:cacheprovider", "-p", "no:randomly", str(tmp_path)],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 1, done.stdout[-2000:]
    assert "crashed while running 'test_crash.py::test_segfaults'" in done.stdout
    assert "1 failed, 4 passed" in done.stdout
