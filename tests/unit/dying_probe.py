"""``python -m real_backends.probe`` that kills itself with SIGSEGV when it reaches one case, as real NIXL 1.5.1 once
did by a race inside ``transfer()``: the case is ``EPSIM_TEST_DIE_IN``, and it dies there as many times as
``EPSIM_TEST_DEATHS`` says, counted in the file ``EPSIM_TEST_DEATH_COUNT`` across the processes (test_conform.py)."""

from __future__ import annotations

import os
import signal
import sys
from pathlib import Path

from real_backends import probe


def main() -> int:
    target, allowed = os.environ["EPSIM_TEST_DIE_IN"], int(os.environ["EPSIM_TEST_DEATHS"])
    count = Path(os.environ["EPSIM_TEST_DEATH_COUNT"])
    run_case = probe.run_case

    def dying(name: str, *args, **kwargs):
        if name == target:
            deaths = int(count.read_text()) if count.exists() else 0
            if deaths < allowed:
                count.write_text(str(deaths + 1))
                os.kill(os.getpid(), signal.SIGSEGV)
        return run_case(name, *args, **kwargs)

    probe.run_case = dying
    return probe.main()


if __name__ == "__main__":
    sys.exit(main())
