"""vLLM's own EPLB code under test: ``--strategy vllm`` (the installed vLLM, else the released 0.33.0's sources) and
``--strategy vllm:PATH`` (a vLLM source tree or wheel).

vLLM's files run unmodified.  :mod:`.source` finds them, :mod:`.standins` supplies the few vLLM modules they import
that need a GPU deployment to import (each says why), :mod:`.loader` loads a fresh instance of them for every
simulated process, :mod:`.device` lets host memory stand in for the GPU memory vLLM insists on, and
:mod:`.strategy` calls vLLM's own factory with the arguments vLLM's ``EplbState`` passes.
"""
