"""Python source compiled once per process, however many times its module is executed afresh.

epsim gives every simulated process its own instance of the code under test (vLLM's EPLB modules, a strategy
loaded fresh), so that module-level state belongs to one process and nothing of one run leaks into the next.  The
module bodies must run again for that; compiling them need not: code objects are immutable, and with bytecode
caching off (PYTHONDONTWRITEBYTECODE, or a read-only checkout) the import system would compile each file at every
instance.
"""

from __future__ import annotations

import importlib.machinery
import os
from types import CodeType


class CompiledOnce(importlib.machinery.SourceFileLoader):
    """A source loader whose code objects are kept for the life of the process, keyed by the file's path, size and
    modification time (an edited file is compiled again)."""

    _code: dict[tuple[str, int, int], CodeType] = {}

    def get_code(self, fullname: str) -> CodeType:
        st = os.stat(self.path)
        key = (self.path, st.st_mtime_ns, st.st_size)
        code = self._code.get(key)
        if code is None:
            code = super().get_code(fullname)
            assert code is not None  # a source file always has code
            self._code[key] = code
        return code
