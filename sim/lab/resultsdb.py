"""The results database of sweeps: SQLite in WAL mode, one row per run, written as each run finishes.

Every row is committed on its own, so a sweep killed at any moment (SIGKILL included) loses at most the runs that
were still in flight; ``run_key`` is unique, so a resumed sweep can neither skip a run that was not stored nor store
one twice.
"""

from __future__ import annotations

import json
import sqlite3
from pathlib import Path
from typing import Any, Callable, Iterable, Iterator

from ..errors import EpsimError

SCHEMA_VERSION = 1

_COLUMNS = {  # name -> SQL type; JSON columns hold lists and objects
    "run_key": "TEXT NOT NULL UNIQUE",
    "sweep_id": "INTEGER",
    "scenario": "TEXT NOT NULL",
    "scenario_digest": "TEXT NOT NULL",
    "seed": "INTEGER NOT NULL",
    "strategy": "TEXT NOT NULL",
    "profile": "TEXT NOT NULL",
    "faults_requested": "TEXT NOT NULL",  # JSON list: --fault strings given to the sweep
    "swarm": "INTEGER NOT NULL",
    "verdict": "TEXT NOT NULL",  # pass, safety, liveness, crash; or error, timeout, worker_crash (the run itself)
    "invariant": "TEXT",
    "detail": "TEXT",
    "signature": "TEXT",
    "trace_hash": "TEXT",
    "events": "INTEGER",
    "sim_time_s": "REAL",
    "wall_s": "REAL",
    "faults_armed": "TEXT NOT NULL",  # JSON list of SITE:k=v strings actually armed (swarm draws included)
    "faults_fired": "TEXT NOT NULL",  # JSON object: armed fault -> times fired
    "implicated": "TEXT NOT NULL",  # JSON list: armed faults that fired before the failure
    "metrics": "TEXT NOT NULL",  # JSON object
    "bundle": "TEXT",  # folder of the failure bundle written for this run's signature
    "finished_at": "REAL NOT NULL",  # Unix time
}
_JSON = {"faults_requested", "faults_armed", "faults_fired", "implicated", "metrics"}


def _strings(v: Any) -> bool:
    return isinstance(v, list) and all(isinstance(x, str) for x in v)


# The shape each JSON column has when epsim wrote it: a cell of valid JSON and another shape (an edit by hand, another
# tool) is refused in one line where it is read, not as an AttributeError wherever a report first touches it.
_SHAPES: dict[str, tuple[str, Callable[[Any], bool]]] = {
    "faults_requested": ("a list of fault strings", _strings),
    "faults_armed": ("a list of fault strings", _strings),
    "implicated": ("a list of fault strings", _strings),
    "faults_fired": (
        "an object of fault sites and counts",
        lambda v: isinstance(v, dict) and all(type(n) is int for n in v.values()),
    ),
    "metrics": ("an object of metrics", lambda v: isinstance(v, dict)),
}


class DatabaseError(EpsimError, RuntimeError):
    """The results database cannot be opened or is not one of epsim's."""


class NotOurs(DatabaseError):
    """A SQLite file without epsim's tables: someone else's, to be left as it is."""


def _in_wal_mode(path: Path) -> bool:
    """Whether the SQLite file's header says WAL (its read and write format versions, bytes 18 and 19, are 2)."""
    try:
        with open(path, "rb") as f:
            header = f.read(20)
    except OSError:
        return False
    return len(header) == 20 and header[18:20] == b"\x02\x02"


class ResultsDB:
    _writer = False  # this connection made or extends the database (a sweep), as opposed to a report's

    def __init__(self, path: str | Path, create: bool = True) -> None:
        """``create``: make the file and its tables if missing (a sweep); else open an existing epsim results
        database read-only and refuse anything else (a report must not turn someone's file into a database)."""
        if not str(path).strip():
            raise DatabaseError("--db: an empty path; give a file name")
        self.path = Path(path)
        if self.path.is_dir():
            raise DatabaseError(f"{self.path}: that is a directory; give a file name")
        try:
            if create:
                if self.path.is_file():
                    with open(self.path, "r+b"):  # a read-only file: refused here, before SQLite makes its -wal
                        pass
                    if self.path.stat().st_size:
                        # Someone's file stays as it was unless it is already one of ours (WAL mode alone rewrites
                        # it).
                        try:
                            ResultsDB(self.path, create=False).close()
                        except NotOurs:
                            raise DatabaseError(
                                f"{self.path}: a file that is not an epsim results database; give a "
                                f"new file, or one that epsim sweep wrote"
                            ) from None
                self.path.parent.mkdir(parents=True, exist_ok=True)
                self._db = sqlite3.connect(str(self.path), timeout=30.0)
                self._writer = True
                self._db.execute("PRAGMA journal_mode=WAL")
                self._db.execute("PRAGMA synchronous=NORMAL")  # WAL + NORMAL: a committed row survives a kill
                self._create()
            else:
                self._db = self._read_only()
                self._check_schema()
        except sqlite3.DatabaseError as exc:
            raise DatabaseError(f"{self.path}: not a usable SQLite results database ({exc})") from None
        except PermissionError as exc:
            raise DatabaseError(
                f"{self.path}: cannot write to it ({exc.strerror or exc}); give a file you can write"
            ) from None
        except OSError as exc:
            raise DatabaseError(f"{self.path}: cannot open it ({exc.strerror or exc})") from None

    def _read_only(self) -> sqlite3.Connection:
        """A read-only connection.  A database in WAL mode needs its -shm file even to be read, and a read-only
        connection that made it cannot remove it: so one with no -wal beside it (no sweep has it open: a sweep
        that ends leaves rollback-journal mode) is opened as immutable, which creates nothing; so is one in a folder
        this process cannot write (a read-only mount, an archive).  Immutable is right as long as no sweep writes
        it meanwhile."""
        uri = self.path.resolve().as_uri()
        wal = self.path.with_name(self.path.name + "-wal")
        if _in_wal_mode(self.path) and not wal.exists():
            return sqlite3.connect(f"{uri}?mode=ro&immutable=1", uri=True, timeout=30.0)
        db = sqlite3.connect(f"{uri}?mode=ro", uri=True, timeout=30.0)
        try:
            db.execute("SELECT name FROM sqlite_master LIMIT 1").fetchall()
            return db
        except sqlite3.OperationalError as exc:
            db.close()
            if "readonly" not in str(exc) and "unable to open" not in str(exc):
                raise
        return sqlite3.connect(f"{uri}?mode=ro&immutable=1", uri=True, timeout=30.0)

    def _check_schema(self) -> None:
        tables = {name for (name,) in self._db.execute("SELECT name FROM sqlite_master WHERE type='table'")}
        if not {"meta", "runs"} <= tables:
            self._db.close()
            raise NotOurs(
                f"{self.path}: not an epsim results database (write one with `epsim sweep ... --db {self.path}`)"
            )
        found = self._db.execute("SELECT value FROM meta WHERE key='schema'").fetchone()
        try:
            self._same_schema("unknown" if found is None else found[0])
            columns = [row[1] for row in self._db.execute("PRAGMA table_info(runs)")]
            missing = [c for c in _COLUMNS if c not in columns]
            if missing:
                raise DatabaseError(
                    f"{self.path}: its runs table lacks {', '.join(missing)}; not a results database "
                    f"of schema {SCHEMA_VERSION}"
                )
        except DatabaseError:
            self._db.close()
            raise

    def _same_schema(self, found: str) -> None:
        if found != str(SCHEMA_VERSION):
            raise DatabaseError(f"{self.path}: results schema {found}, this epsim reads {SCHEMA_VERSION}")

    def _create(self) -> None:
        cols = ", ".join(f"{name} {kind}" for name, kind in _COLUMNS.items())
        with self._db:
            self._db.execute("CREATE TABLE IF NOT EXISTS meta (key TEXT PRIMARY KEY, value TEXT NOT NULL)")
            found = self._db.execute("SELECT value FROM meta WHERE key='schema'").fetchone()
            if found is None:
                self._db.execute("INSERT INTO meta VALUES ('schema', ?)", (str(SCHEMA_VERSION),))
            else:
                self._same_schema(found[0])
            self._db.execute(f"CREATE TABLE IF NOT EXISTS runs (id INTEGER PRIMARY KEY, {cols})")
            self._db.execute(
                "CREATE TABLE IF NOT EXISTS sweeps (id INTEGER PRIMARY KEY, command TEXT NOT NULL, "
                "planned INTEGER NOT NULL, started_at REAL NOT NULL)"
            )

    def close(self) -> None:
        if self._writer:
            # WAL only while a sweep writes: back in rollback-journal mode a finished database is one file, and a
            # report reading it creates no -wal and -shm beside it.  Another connection still open keeps WAL (the
            # switch needs the database to itself); its own close tries again.
            try:
                self._db.execute("PRAGMA journal_mode=DELETE")
            except sqlite3.Error:
                pass
        self._db.close()

    def __enter__(self) -> ResultsDB:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    # -- writing ----------------------------------------------------------------------------------------------
    def new_sweep(self, command: str, planned: int, started_at: float) -> int:
        try:
            with self._db:
                cur = self._db.execute(
                    "INSERT INTO sweeps (command, planned, started_at) VALUES (?, ?, ?)", (command, planned, started_at)
                )
        except sqlite3.OperationalError as exc:  # the first write of a sweep: before any run
            raise DatabaseError(f"{self.path}: cannot write to it ({exc})") from None
        return int(cur.lastrowid or 0)  # set by the INSERT above

    def add(self, row: dict[str, Any]) -> bool:
        """Store one finished run (committed at once); False if a run with its key is already stored."""
        values = [json.dumps(row.get(c), sort_keys=True) if c in _JSON else row.get(c) for c in _COLUMNS]
        marks = ", ".join("?" for _ in _COLUMNS)
        with self._db:
            cur = self._db.execute(f"INSERT OR IGNORE INTO runs ({', '.join(_COLUMNS)}) VALUES ({marks})", values)
        return cur.rowcount == 1

    def set_bundle(self, run_key: str, bundle: str) -> None:
        with self._db:
            self._db.execute("UPDATE runs SET bundle=? WHERE run_key=?", (bundle, run_key))

    # -- reading ----------------------------------------------------------------------------------------------
    def keys(self) -> set[str]:
        return {k for (k,) in self._db.execute("SELECT run_key FROM runs")}

    def signatures(self) -> set[str]:
        return {s for (s,) in self._db.execute("SELECT DISTINCT signature FROM runs WHERE signature IS NOT NULL")}

    def bundled_signatures(self) -> set[str]:
        return {s for (s,) in self._db.execute("SELECT DISTINCT signature FROM runs WHERE bundle IS NOT NULL")}

    def count(self) -> int:
        return int(self._db.execute("SELECT COUNT(*) FROM runs").fetchone()[0])

    def rows(self, where: str = "", params: Iterable[Any] = ()) -> Iterator[dict[str, Any]]:
        cur = self._db.execute(f"SELECT id, {', '.join(_COLUMNS)} FROM runs {where} ORDER BY id", tuple(params))
        for row_id, *values in cur:
            row = dict(zip(_COLUMNS, values))
            for c in _COLUMNS:  # (in column order, so that the first bad cell named is always the same)
                if c in _JSON and row[c] is not None:
                    try:
                        row[c] = json.loads(row[c])
                    except (ValueError, RecursionError):
                        raise DatabaseError(
                            f"{self.path}: run {row_id}'s {c} is not JSON; the database was changed "
                            f"by something other than epsim"
                        ) from None
                    shape, fits = _SHAPES[c]
                    if not fits(row[c]):
                        raise DatabaseError(
                            f"{self.path}: run {row_id}'s {c} is not {shape}; the database was "
                            f"changed by something other than epsim"
                        )
            yield row


def open_existing(path: str | Path) -> ResultsDB:
    """A database that must already exist (``epsim report``): a missing file is an error, not an empty report."""
    if not Path(path).exists():  # (a directory is refused by ResultsDB itself)
        raise DatabaseError(f"{path}: no such results database (write one with `epsim sweep ... --db {path}`)")
    return ResultsDB(path, create=False)
