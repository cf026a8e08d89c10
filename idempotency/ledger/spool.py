"""A model call's ledger row is never lost to a database outage: the spool it waits in.

When the database cannot take the row (unreachable, restarting, SQLite's file locked: the typed
`StoreUnavailable`), the row is appended to this process's spool file and written later:

    write fails (StoreUnavailable) --> append one JSON line, fsync --> [spooled]
    [spooled] --> this process's next successful ledger write wakes the flusher --> rows written --> file removed
    [spooled] --> the flusher's own retries (0.5 s, doubling to 30 s) until the spool is empty
    process ends with rows left --> its file is an orphan (no lock on it) --> replayed by the next worker start,
        by any process's first successful ledger write and then one every 60 s, and by every flusher round

Files: `<folder>/ledger-<host>-<pid>-<token>-<n>.jsonl`, one JSON line per row (oncelery.ledger.spool_files reads
and replays them). Each process appends only to its own files (never two writers on one file, so prefork
children cannot interleave), each line in ONE write to an O_APPEND descriptor, fsynced before the block returns.
A process holds an exclusive `flock` on each of its files while it lives: a file whose lock can be taken belongs
to nobody, and whoever takes it replays it. A file is removed only once every row in it is in the database; it
is never rewritten in place.
"""

from __future__ import annotations

import contextlib
import fcntl
import logging
import os
import socket
import threading
import time
import uuid
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from oncelery.ledger.spool_files import (
    PREFIX,
    SUFFIX,
    fsync_folder,
    remember_database,
    replay_file,
    replay_orphans,
    spool_files,
    spool_folder,
    spool_line,
)

__all__ = ["ORPHAN_CHECK_SECONDS", "after_write", "flush_spools", "spool_row"]

logger = logging.getLogger("oncelery.ledger")  # the ledger's stable logger name (users filter on it)

RETRY_FIRST = 0.5  # seconds before the flusher's first try: the database has just failed
RETRY_CAP = 30.0
ORPHAN_CHECK_SECONDS = 60.0  # how often a process that writes ledger rows looks for files others left

_spools: dict[Path, _Spool] = {}
_spools_lock = threading.Lock()
_next_orphan_check = 0.0  # time.monotonic(): the first successful write of a process looks
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
            self._start_flusher()
            return segment.path

    def kick(self) -> None:
        """Run the flusher now (started if it is not running)."""
        with self._lock:
            self._start_flusher()
        self._wake.set()

    def _start_flusher(self) -> None:
        if self._flusher is None:  # under self._lock
            self._flusher = threading.Thread(target=self._run, name="oncelery-ledger-spool", daemon=True)
            self._flusher.start()

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
        fsync_folder(self.folder)
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
            if not replay_file(segment.path, segment.fd):
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
    return _spool_in(spool_folder(conf)).append(spool_line(remember_database(url), row))


def _spool_in(folder: Path) -> _Spool:
    with _spools_lock:
        spool = _spools.get(folder)
        if spool is None:
            spool = _spools[folder] = _Spool(folder)
        return spool


def after_write(url: str, conf: Any) -> None:
    """After a successful ledger write: the database answers, so write what this process spooled, now; and, at
    most every ORPHAN_CHECK_SECONDS, what processes that ended left in the folder (a recycled prefork child)."""
    global _next_orphan_check
    for spool in list(_spools.values()):
        if spool.pending:
            spool.kick()
    now = time.monotonic()
    if now < _next_orphan_check:
        return  # the hot path: one comparison per call
    _next_orphan_check = now + ORPHAN_CHECK_SECONDS
    folder = spool_folder(conf)
    if spool_files(folder):
        remember_database(url)
        _spool_in(folder).kick()


def flush_spools() -> bool:
    """Write every row this process spooled, now, in the caller's thread; return whether none is left."""
    return all([spool.flush() for spool in list(_spools.values())])


def _forget_after_fork() -> None:
    global _spools_lock
    for spool in _spools.values():
        spool.forget_after_fork()
    _spools.clear()
    _spools_lock = threading.Lock()  # it may have been held by a parent's thread at the fork


os.register_at_fork(after_in_child=_forget_after_fork)
