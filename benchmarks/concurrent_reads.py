"""``python -m benchmarks.concurrent_reads``: k READs posted together against k posted one at a time, on the real
NIXL between two processes (the evidence for the simulated link model, docs/validation.md). The measurement lives
in ``real_backends/concurrent_reads.py``, which ``epsim calibrate`` uses too."""

from real_backends.concurrent_reads import main

if __name__ == "__main__":
    main()
