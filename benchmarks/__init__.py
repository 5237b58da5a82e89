"""epsim's benchmarks (``epsim bench``): every figure is a ratio against a baseline measured in the same run, or a
count, so that it holds on a noisy machine.  One module per figure; :mod:`benchmarks.suite` runs them."""
