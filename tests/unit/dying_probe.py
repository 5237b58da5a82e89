"""``python -m real_backends.probe`` that dies when it reaches one case, as real NIXL 1.5.1 once did by a race inside
``transfer()`` (tests/unit/test_conform.py).  Set by the environment:

- ``EPSIM_TEST_DIE_IN``: the case; ``EPSIM_TEST_DEATHS``: how many times to die there, counted across processes in
  the file ``EPSIM_TEST_DEATH_COUNT``;
- ``EPSIM_TEST_DIE_HOW``: ``segv`` (SIGSEGV, the default), ``exit5`` (a line on stderr, then exit status 5),
  ``hang`` (never returns) or ``slow`` (does not die: takes 14 s, as a start-up on a loaded machine may, longer
  than the per-case bound of the test, which leaves the other cases room on a loaded machine);
- ``EPSIM_TEST_DIE_WHERE``: ``case`` (inside the case, the default), ``start`` (a process whose first case it is
  dies while it starts, before it announces any case), ``start-alone`` (the same, only in a process that runs that
  case alone), or several, comma-separated;
- ``EPSIM_TEST_RUN_LOG``: a file that gets the name of every case as it runs.
"""

from __future__ import annotations

import os
import signal
import sys
import time
from pathlib import Path

from real_backends import probe


def _die() -> None:
    count = Path(os.environ["EPSIM_TEST_DEATH_COUNT"])
    deaths = int(count.read_text()) if count.exists() else 0
    if deaths >= int(os.environ["EPSIM_TEST_DEATHS"]):
        return
    count.write_text(str(deaths + 1))
    how = os.environ.get("EPSIM_TEST_DIE_HOW", "segv")
    if how == "slow":
        time.sleep(14)
        return
    if how == "hang":  # a case that never returns (a READ that never completes, a deadlock in the library)
        while True:
            time.sleep(60)
    if how == "exit5":
        print("[host:1234] boom", file=sys.stderr, flush=True)
        os._exit(5)
    os.kill(os.getpid(), signal.SIGSEGV)


def main() -> int:
    target = os.environ["EPSIM_TEST_DIE_IN"]
    where = set(os.environ.get("EPSIM_TEST_DIE_WHERE", "case").split(","))
    log = os.environ.get("EPSIM_TEST_RUN_LOG")
    run_case, make_backend = probe.run_case, probe.make_backend
    first = sys.argv[sys.argv.index("--case") + 1] if "--case" in sys.argv else None

    def dying_case(name: str, *args, **kwargs):
        if log:
            with open(log, "a") as f:
                f.write(name + "\n")
        if "case" in where and name == target:
            _die()
        return run_case(name, *args, **kwargs)

    def dying_start(*args, **kwargs):
        alone = sys.argv.count("--case") == 1
        if first == target and ("start" in where or "start-alone" in where and alone):
            _die()
        return make_backend(*args, **kwargs)

    probe.run_case, probe.make_backend = dying_case, dying_start
    return probe.main()


if __name__ == "__main__":
    sys.exit(main())
