"""A model call's ledger row is never lost to a database outage: the spool it waits in.

When the database cannot take the row (unreachable, restarting, SQLite's file locked: the typed
`StoreUnavailable`), the row is appended to this process's spool file and written later:

    write fails (StoreUnavailable) --> append one JSON line, fsync --> [spooled]
    [spooled] --> this process's next successful ledger write wakes the flusher --> rows written --> file removed
    [spooled] --> the flusher's own retries (0.5 s, doubling to 30 s) until the spool is empty
    process ends with rows left --> its file is an orphan (no lock on it) --> the next worker start replays it
                                    (so does any process's flusher round in that folder)

Files: `<folder>/ledger-<host>-<pid>-<token>-<n>.jsonl`, one JSON object per line,
`{"v": 1, "db": <database URL, password masked>, "row": <the model_calls row>}`. Each process appends only to its
own files (never two writers on one file, so prefork children cannot interleave), each line in ONE write to an
O_APPEND descriptor, fsynced before the block returns. A process holds an exclusive `flock` on each of its files
while it lives: a file whose lock can be taken belongs to nobody, and whoever takes it replays it. A file is
removed only once every row in it is in the database; it is never rewritten in place. A line that cannot be
parsed (a write torn by a crash) or a row the database refuses for good is moved to `<folder>/rejected.jsonl`
and logged, never dropped silently.
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import logging
import os
import socket
import threading
import uuid
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from celery import signals

from oncelery.errors import StoreUnavailable
from oncelery.settings import (
    CONF_LEDGER_SPOOL_DIR,
    DEFAULT_DATA_DIR,
    DEFAULT_LEDGER_SPOOL,
    ENV_DATA_DIR,
    ENV_LEDGER_SPOOL_DIR,
    configured_database_url,
)
from oncelery.store.database import Database, safe_url
from oncelery.task.ledger_rows import write_call

__all__ = [
    "FORMAT",
    "REJECTED_FILE",
    "flush_spools",
    "replay_orphans",
    "spool_folder",
    "spool_row",
    "spooled_rows",
    "wake_spools",
]

logger = logging.getLogger("oncelery.ledger")  # the ledger's stable logger name (users filter on it)

FORMAT = 1  # the spool line's "v"
PREFIX = "ledger-"
SUFFIX = ".jsonl"
REJECTED_FILE = "rejected.jsonl"
RETRY_FIRST = 0.5  # seconds before the flusher's first try: the database has just failed
RETRY_CAP = 30.0

# -- where the spool is ----------------------------------------------------------------------------------


def spool_folder(conf: Any = None) -> Path:
    """The spool's folder: app.conf.oncelery_ledger_spool_dir, else $ONCELERY_LEDGER_SPOOL_DIR, else
    <data folder>/ledger-spool (the data folder: $ONCELERY_DATA_DIR, else ./.oncelery). Not created here."""
    value = (conf.get(CONF_LEDGER_SPOOL_DIR) if conf is not None else None) or os.environ.get(ENV_LEDGER_SPOOL_DIR)
    if value:
        return Path(str(value)).expanduser().resolve()
    return Path(os.environ.get(ENV_DATA_DIR, DEFAULT_DATA_DIR)).resolve() / DEFAULT_LEDGER_SPOOL


def spooled_rows(folder: Path) -> list[dict[str, Any]]:
    """Every row waiting in `folder`'s spool files, of every process (what an operator, or a test, looks at)."""
    rows: list[dict[str, Any]] = []
    for path in _spool_files(folder):
        with contextlib.suppress(FileNotFoundError):
            rows.extend(entry["row"] for entry in _parse(path.read_bytes(), path) if entry is not None)
    return rows


def _spool_files(folder: Path) -> list[Path]:
    try:
        return sorted(p for p in folder.iterdir() if p.name.startswith(PREFIX) and p.name.endswith(SUFFIX))
    except FileNotFoundError:
        return []


# -- this process's spool --------------------------------------------------------------------------------

_urls: dict[str, str] = {}  # masked URL -> URL: the databases this process can replay rows into
_spools: dict[Path, _Spool] = {}
_spools_lock = threading.Lock()
_host = socket.gethostname().replace("-", "_").replace("/", "_") or "host"


@dataclass
class _Segment:
    """One spool file of this process: its path and the descriptor holding its lock (and its appends)."""

    path: Path
    fd: int


class _Spool:
    """This process's spool in one folder: the file it appends to, the files it has closed and not yet
    written to the database, and the flusher thread that writes them."""

    def __init__(self, folder: Path) -> None:
        self.folder = folder
        self._lock = threading.Lock()  # appends and the list of files
        self._flushing = threading.Lock()  # one replay of this process's files at a time
        self._open: _Segment | None = None
        self._closed: list[_Segment] = []
        self._wake = threading.Event()
        self._flusher: threading.Thread | None = None
        self._token = uuid.uuid4().hex[:8]  # a pid is reused, and two containers on one volume share pids
        self._seq = 0

    @property
    def pending(self) -> bool:
        """Whether rows of this process wait here."""
        return self._open is not None or bool(self._closed)

    def append(self, line: bytes) -> Path:
        """Append one line durably (one O_APPEND write, then fsync) and make sure the flusher runs."""
        with self._lock:
            segment = self._open or self._new_segment()
            written = os.write(segment.fd, line)
            if written != len(line):  # a full disk: the line is torn, say so rather than claim it is kept
                raise OSError(f"wrote {written} of {len(line)} bytes to {segment.path}")
            os.fsync(segment.fd)
            if self._flusher is None:
                self._flusher = threading.Thread(target=self._run, name="oncelery-ledger-spool", daemon=True)
                self._flusher.start()
            return segment.path

    def _new_segment(self) -> _Segment:
        # Created under a name no scanner lists, locked, then renamed: a scanner never sees it unlocked (it
        # would take it for an orphan, replay it empty and remove it under our appends).
        self.folder.mkdir(parents=True, exist_ok=True)
        self._seq += 1
        name = f"{PREFIX}{_host}-{os.getpid()}-{self._token}-{self._seq}{SUFFIX}"
        hidden = self.folder / f".{name}.new"
        fd = os.open(hidden, os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_APPEND | os.O_CLOEXEC, 0o600)
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        os.rename(hidden, self.folder / name)
        _fsync_folder(self.folder)
        self._open = _Segment(self.folder / name, fd)
        return self._open

    def flush(self) -> bool:
        """Write every row this process spooled here; return whether none is left (False: try again later)."""
        with self._flushing:
            return self._flush()

    def _flush(self) -> bool:
        with self._lock:
            if self._open is not None:  # later appends start a new file: this one is read and removed whole
                self._closed.append(self._open)
                self._open = None
            segments = list(self._closed)
        for segment in segments:
            if not _replay_file(segment.path, segment.fd):
                return False
            with self._lock:
                self._closed.remove(segment)
            os.close(segment.fd)  # after the unlink: the lock is held until the file is gone
        return True

    def _run(self) -> None:
        delay = RETRY_FIRST
        while True:
            self._wake.wait(delay)
            self._wake.clear()
            try:
                empty = self.flush()
                replay_orphans(self.folder)
            except Exception:  # a bug must not end the thread while rows wait: log it and try again later
                logger.exception("ledger spool %s: replay failed", self.folder)
                empty = False
            with self._lock:
                if empty and not self.pending:
                    self._flusher = None
                    return
            delay = RETRY_FIRST if empty else min(delay * 2, RETRY_CAP)

    def forget_after_fork(self) -> None:
        """In a forked child: let go of the parent's files (the parent still holds their locks)."""
        for segment in [*self._closed, *([self._open] if self._open else [])]:
            with contextlib.suppress(OSError):
                os.close(segment.fd)


def spool_row(url: str, conf: Any, row: Mapping[str, Any]) -> Path:
    """Append `row` (for the database at `url`) to this process's spool; return the file. Raises OSError when
    the spool cannot be written (the caller logs the row)."""
    masked = safe_url(url)
    _urls[masked] = url
    folder = spool_folder(conf)
    line = json.dumps({"v": FORMAT, "db": masked, "row": dict(row)}, separators=(",", ":"), default=str)
    with _spools_lock:
        spool = _spools.get(folder)
        if spool is None:
            spool = _spools[folder] = _Spool(folder)
    return spool.append(line.encode("utf-8") + b"\n")


def wake_spools() -> None:
    """After a successful ledger write: the database answers again, so write what this process spooled now."""
    for spool in list(_spools.values()):
        if spool.pending:
            spool._wake.set()


def flush_spools() -> bool:
    """Write every row this process spooled, now, in the caller's thread; return whether none is left."""
    return all([spool.flush() for spool in list(_spools.values())])


def replay_orphans(folder: Path, url: str | None = None) -> int:
    """Write the rows of `folder`'s files that no live process holds (their writer died or exited), into the
    databases this process knows (and `url`); return how many files were written and removed."""
    if url is not None:
        _urls[safe_url(url)] = url
    done = 0
    for path in _spool_files(folder):
        try:
            fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
        except FileNotFoundError:
            continue  # replayed and removed by someone else meanwhile
        try:
            with _locked(fd) as mine:
                # Held by a live writer, or by another replayer; or removed since we opened it.
                if mine and _same_file(path, fd) and _replay_file(path, fd):
                    done += 1
        finally:
            os.close(fd)
    return done


@contextlib.contextmanager
def _locked(fd: int) -> Iterator[bool]:
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        yield False
        return
    yield True  # released when the descriptor is closed


def _same_file(path: Path, fd: int) -> bool:
    try:
        return os.stat(path).st_ino == os.fstat(fd).st_ino
    except FileNotFoundError:
        return False


def _replay_file(path: Path, fd: int) -> bool:
    """Write every row of the file `fd` (locked by us); remove the file once all are in; False: not all are."""
    data = os.pread(fd, os.fstat(fd).st_size, 0) if os.fstat(fd).st_size else b""
    for entry in _parse(data, path):
        if entry is None:
            continue
        url = _urls.get(entry["db"])
        if url is None:
            return False  # rows for a database this process cannot name: left for a process that can
        try:
            new = write_call(_database(url), entry["row"])
        except StoreUnavailable as exc:
            logger.info("ledger spool %s: the database still cannot take its rows (%s); later", path.name, exc)
            return False
        except Exception as exc:  # refused for good (e.g. a value the database rejects): kept aside, not lost
            _reject(path.parent, json.dumps(entry, default=str).encode("utf-8"), f"{type(exc).__name__}: {exc}")
            continue
        row = entry["row"]
        logger.info(
            "ledger: spooled model call %s %s[%s] call_id=%s %s",
            row.get("model"),
            row.get("task_name"),
            row.get("idempotency_key"),
            row.get("call_id"),
            "written" if new else "was already written",
        )
    with contextlib.suppress(FileNotFoundError):
        path.unlink()
    _fsync_folder(path.parent)
    return True


def _parse(data: bytes, path: Path) -> Iterator[dict[str, Any] | None]:
    """The file's entries; a line that is not one (torn by a crash, or from a newer format) is set aside."""
    for raw in data.splitlines():
        if not raw.strip():
            continue
        try:
            entry = json.loads(raw)
            ok = isinstance(entry, dict) and entry.get("v") == FORMAT and isinstance(entry.get("row"), dict)
        except ValueError:
            ok = False
        if not ok:
            _reject(path.parent, raw, "not a spool line of this version")
            yield None
            continue
        yield entry


def _reject(folder: Path, raw: bytes, why: str) -> None:
    target = folder / REJECTED_FILE
    logger.error("ledger spool: a row cannot be written (%s); kept in %s: %s", why, target, raw[:500])
    fd = os.open(target, os.O_WRONLY | os.O_CREAT | os.O_APPEND | os.O_CLOEXEC, 0o600)
    try:
        os.write(fd, raw.rstrip(b"\n") + b"\n")
        os.fsync(fd)
    finally:
        os.close(fd)


def _fsync_folder(folder: Path) -> None:
    fd = os.open(folder, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


_databases: dict[str, Database] = {}


def _database(url: str) -> Database:
    db = _databases.get(url)
    if db is None:
        db = _databases[url] = Database(url)
    return db


def _forget_after_fork() -> None:
    global _spools_lock
    for spool in _spools.values():
        spool.forget_after_fork()
    _spools.clear()
    _spools_lock = threading.Lock()  # it may have been held by a parent's thread at the fork


os.register_at_fork(after_in_child=_forget_after_fork)


def _replay_at_worker_start(sender: Any = None, **_: Any) -> None:
    # worker_init: in the worker's main process, before its pool starts (no thread is left running across the
    # prefork pool's forks). A file left by a process that died or exited is written here, never raised.
    conf = getattr(getattr(sender, "app", None), "conf", None)
    url = configured_database_url(conf) if conf is not None else None
    if url is None:
        return
    folder = spool_folder(conf)
    if not _spool_files(folder):
        return
    try:
        done = replay_orphans(folder, url)
    except Exception:
        logger.exception("ledger spool %s: could not replay it at worker start; the next start tries again", folder)
        return
    if done:
        logger.info("ledger spool %s: %d file(s) left by earlier processes written at worker start", folder, done)


signals.worker_init.connect(_replay_at_worker_start, weak=False, dispatch_uid="oncelery.ledger_spool")
