"""One root seed, a named random stream per component, and the tape of every recorded draw.

A stream's seed is derived from the root seed and the stream's name only, so adding a stream (or drawing more from
one) never changes what another stream produces.  Streams that make *decisions* (faults, GC placement, routing
drift) record each draw on the tape; the scheduler's tie-break stream does not (it is replayed from its seed).
"""

from __future__ import annotations

import hashlib
import random
from dataclasses import dataclass, field
from typing import Any, Sequence

_Random = random.Random  # (inside the class, `random` is the method of that name)


def derive_seed(root: int, name: str) -> int:
    digest = hashlib.sha256(f"{root}:{name}".encode()).digest()
    return int.from_bytes(digest[:8], "big")


@dataclass
class Tape:
    """Every recorded decision, in order: (stream, what, value)."""

    entries: list[tuple[str, str, Any]] = field(default_factory=list)

    def record(self, stream: str, what: str, value: Any) -> None:
        self.entries.append((stream, what, value))

    def __len__(self) -> int:
        return len(self.entries)


class Stream:
    """A named ``random.Random`` whose draws go on the tape (if ``record``)."""

    def __init__(self, name: str, seed: int, tape: Tape | None) -> None:
        self.name = name
        self._rng = random.Random(seed)
        self._tape = tape

    def _note(self, what: str, value: Any) -> Any:
        if self._tape is not None:
            self._tape.record(self.name, what, value)
        return value

    def random(self) -> float:
        return self._note("random", self._rng.random())

    def uniform(self, lo: float, hi: float) -> float:
        return self._note("uniform", self._rng.uniform(lo, hi))

    def randint(self, lo: int, hi: int) -> int:
        return self._note("randint", self._rng.randint(lo, hi))

    def choice(self, seq: Sequence) -> Any:
        return self._note("choice", seq[self._rng.randrange(len(seq))])

    def chance(self, p: float) -> bool:
        return self._note("chance", self._rng.random() < p)

    def shuffled(self, seq: Sequence) -> list:
        out = list(seq)
        self._rng.shuffle(out)
        return self._note("shuffle", out)

    def getrandbits(self, k: int) -> int:
        return self._note("bits", self._rng.getrandbits(k))

    def raw(self) -> _Random:
        """The underlying generator, for bulk draws (numpy seeding) that are reproduced from the seed alone."""
        return self._rng


class Streams:
    def __init__(self, seed: int, tape: Tape | None = None) -> None:
        self.seed = seed
        self.tape = tape if tape is not None else Tape()
        self._streams: dict[str, Stream] = {}

    def get(self, name: str, record: bool = True) -> Stream:
        stream = self._streams.get(name)
        if stream is None:
            stream = Stream(name, derive_seed(self.seed, name), self.tape if record else None)
            self._streams[name] = stream
        return stream
