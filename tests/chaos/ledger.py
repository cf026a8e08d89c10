"""The checker's ledger: a SQLite file the runner owns, outside every system the faults hit.

Why SQLite and not a database on the throwaway PostgreSQL cluster: the cluster is the system under test. It is
restarted, its backends are terminated, and the cut-off worker reaches it through a blackholed proxy; a ledger
there would lose or delay exactly the records the verdict needs, and the framework's engines would manage its
connections. The shared server on 5432 belongs to others. A local SQLite file in WAL mode takes concurrent
writes from every process on this machine (the runner, each worker's pool children), each INSERT its own
durable transaction through the standard `sqlite3` module, which no Oncelery code ever opens.

What is written, and by whom (Jepsen's history: every operation, recorded by the client that made it):

- `submissions`: the runner, *before* each send of a job (original, duplicate, or a fault's re-send);
- `deliveries`: each delivery a worker's pool child starts (Celery's task_prerun), with Redis' redelivered flag;
- `attempts`: each execution of the body (its own random attempt id, worker, pid, fencing token), and how it
  ended: `returned` (the body returned: the framework then commits or refuses the completion), `fenced`
  (LeaseLost raised inside the body), or `error:<type>`;
- `staged`: an attempt about to write its effect in `self.effects()` (so every committed effect has a staged
  record; a committed effect without one was invented by the system under test);
- `revokes`: the runner, *before* it revokes a job's parked run (`app.control.revoke` of its task id);
- `marks`: where a process stood when a fault was aimed at it (the relay between a wake's mark and its send);
- `publishes`: each copy of a job any process sends (the runner, the relay, a worker re-sending a copy that
  waits), *before* it is sent, with the time it is due (its ETA, else the send's): the latest a copy held in a
  worker's memory can run, which the settle waits out.

The effect itself is the row the job writes through the framework's fenced `effects()` session, tagged with
its attempt id: only the system under test can say whether that commit happened (a zombie's staged effect
must never commit), so the checker reads those rows at the end, like Jepsen's final drain of a queue. The model
calls are counted by the fake provider, a process of the runner's: its creates per intent are what was paid.
"""

from __future__ import annotations

import os
import sqlite3
import threading
import time
from dataclasses import dataclass
from pathlib import Path

SCHEMA = """
CREATE TABLE IF NOT EXISTS submissions (id INTEGER PRIMARY KEY, job INTEGER NOT NULL, copy INTEGER NOT NULL,
    via TEXT NOT NULL, at REAL NOT NULL);
CREATE TABLE IF NOT EXISTS deliveries (id INTEGER PRIMARY KEY, task_id TEXT, job INTEGER, host TEXT, pid INTEGER,
    redelivered INTEGER NOT NULL, at REAL NOT NULL);
CREATE TABLE IF NOT EXISTS attempts (attempt TEXT PRIMARY KEY, job INTEGER NOT NULL, host TEXT NOT NULL,
    pid INTEGER NOT NULL, token INTEGER NOT NULL, started REAL NOT NULL, ended REAL, how TEXT);
CREATE INDEX IF NOT EXISTS attempts_open ON attempts (ended, host);
CREATE TABLE IF NOT EXISTS staged (attempt TEXT PRIMARY KEY, job INTEGER NOT NULL, token INTEGER NOT NULL,
    at REAL NOT NULL);
CREATE TABLE IF NOT EXISTS revokes (id INTEGER PRIMARY KEY, job INTEGER NOT NULL, task_id TEXT NOT NULL,
    at REAL NOT NULL);
CREATE TABLE IF NOT EXISTS marks (id INTEGER PRIMARY KEY, kind TEXT NOT NULL, job INTEGER, host TEXT, pid INTEGER,
    at REAL NOT NULL);
CREATE TABLE IF NOT EXISTS publishes (id INTEGER PRIMARY KEY, task_id TEXT, host TEXT, pid INTEGER, at REAL NOT NULL,
    due REAL NOT NULL);
"""
# Writers wait this long for SQLite's single write lock (every write is one short INSERT or UPDATE).
BUSY_TIMEOUT = 60.0


@dataclass(frozen=True)
class Attempt:
    """One execution of a job's body, as the ledger saw it."""

    attempt: str
    job: int
    host: str
    pid: int
    token: int
    ended: float | None
    how: str | None


class Ledger:
    """Append-only records in a SQLite file; one connection per process and thread (reopened after a fork)."""

    def __init__(self, path: str | Path) -> None:
        self.path = str(path)
        self._local = threading.local()

    def create(self) -> None:
        """Create the file and its tables (WAL: writers in many processes, readers never blocked)."""
        conn = sqlite3.connect(self.path, timeout=BUSY_TIMEOUT, isolation_level=None)
        try:
            conn.execute("PRAGMA journal_mode=WAL")
            conn.executescript(SCHEMA)
        finally:
            conn.close()

    def _db(self) -> sqlite3.Connection:
        # A connection must not cross a fork (the prefork pool forks after the app module is imported), and
        # sqlite3 connections belong to the thread that opened them (the runner submits from a thread).
        local = self._local
        if getattr(local, "pid", None) != os.getpid():
            local.conn = sqlite3.connect(self.path, timeout=BUSY_TIMEOUT, isolation_level=None)
            local.conn.execute("PRAGMA synchronous=NORMAL")
            local.pid = os.getpid()
        return local.conn  # type: ignore[no-any-return]

    def _write(self, sql: str, params: tuple[object, ...]) -> None:
        self._db().execute(sql, params)

    def close(self) -> None:
        """Close this thread's connection."""
        local = self._local
        if getattr(local, "pid", None) == os.getpid():
            local.conn.close()
        local.pid = None

    # -- writes ------------------------------------------------------------------------------------

    def submitted(self, job: int, copy: int, via: str) -> None:
        """Record a send of `job` before it is made (a job is never sent unrecorded)."""
        self._write("INSERT INTO submissions (job, copy, via, at) VALUES (?, ?, ?, ?)", (job, copy, via, time.time()))

    def delivery(self, task_id: str, job: int | None, host: str, redelivered: bool) -> None:
        """Record that a worker's pool child starts a delivery."""
        self._write(
            "INSERT INTO deliveries (task_id, job, host, pid, redelivered, at) VALUES (?, ?, ?, ?, ?, ?)",
            (task_id, job, host, os.getpid(), int(redelivered), time.time()),
        )

    def attempt_started(self, attempt: str, job: int, host: str, token: int) -> None:
        """Record that the body of `job` starts executing under fencing token `token`."""
        self._write(
            "INSERT INTO attempts (attempt, job, host, pid, token, started) VALUES (?, ?, ?, ?, ?, ?)",
            (attempt, job, host, os.getpid(), token, time.time()),
        )

    def attempt_ended(self, attempt: str, how: str) -> None:
        """Record how an attempt's body ended (returned, fenced, error:<type>)."""
        self._write("UPDATE attempts SET ended = ?, how = ? WHERE attempt = ?", (time.time(), how, attempt))

    def staged(self, attempt: str, job: int, token: int) -> None:
        """Record that an attempt is about to write its effect (before the fenced write)."""
        self._write(
            "INSERT INTO staged (attempt, job, token, at) VALUES (?, ?, ?, ?)", (attempt, job, token, time.time())
        )

    def revoked(self, job: int, task_id: str) -> None:
        """Record that the runner is about to revoke `job`'s parked run (its message `task_id`)."""
        self._write("INSERT INTO revokes (job, task_id, at) VALUES (?, ?, ?)", (job, task_id, time.time()))

    def mark(self, kind: str, job: int, host: str) -> None:
        """Record that this process stands at `kind` for `job` (a fault's victim, waiting to be hit)."""
        self._write(
            "INSERT INTO marks (kind, job, host, pid, at) VALUES (?, ?, ?, ?, ?)",
            (kind, job, host, os.getpid(), time.time()),
        )

    def published(self, task_id: str | None, host: str, due: float | None) -> None:
        """Record a copy about to be sent, due at `due` (its ETA, wall clock; None: at once)."""
        now = time.time()
        self._write(
            "INSERT INTO publishes (task_id, host, pid, at, due) VALUES (?, ?, ?, ?, ?)",
            (task_id, host, os.getpid(), now, max(now, due or now)),
        )

    # -- reads -------------------------------------------------------------------------------------

    def rows(self, sql: str, params: tuple[object, ...] = ()) -> list[tuple[object, ...]]:
        """Return the rows of a read query."""
        return list(self._db().execute(sql, params).fetchall())

    def scalar(self, sql: str, params: tuple[object, ...] = ()) -> int:
        """Return the first column of the first row of `sql` as an int (0 for NULL)."""
        row = self._db().execute(sql, params).fetchone()
        return int(row[0] or 0) if row else 0

    def last_delivery(self) -> float:
        """Return the wall-clock time of the latest delivery recorded (0 if none)."""
        row = self._db().execute("SELECT max(at) FROM deliveries").fetchone()
        return float(row[0] or 0.0) if row else 0.0

    def last_due(self) -> float:
        """Return the wall-clock time the latest-due copy ever sent was due (0 if none)."""
        row = self._db().execute("SELECT max(due) FROM publishes").fetchone()
        return float(row[0] or 0.0) if row else 0.0

    def open_attempts(self, hosts: tuple[str, ...], staged: bool = False) -> list[Attempt]:
        """Return attempts on `hosts` whose body is running (started, not ended), newest first.

        `staged`: only those about to commit (their effect staged, not yet written).
        """
        marks = ",".join("?" * len(hosts))
        only = "AND attempt IN (SELECT attempt FROM staged) " if staged else ""
        rows = self._db().execute(
            f"SELECT attempt, job, host, pid, token, ended, how FROM attempts WHERE ended IS NULL "
            f"AND host IN ({marks}) {only}ORDER BY started DESC",
            hosts,
        )
        return [Attempt(*row) for row in rows]

    def attempt(self, attempt: str) -> Attempt | None:
        """Return one attempt as recorded now, or None."""
        row = (
            self._db()
            .execute("SELECT attempt, job, host, pid, token, ended, how FROM attempts WHERE attempt = ?", (attempt,))
            .fetchone()
        )
        return Attempt(*row) if row else None

    def writable(self, timeout: float = 0.5) -> bool:
        """Return whether the write lock can be taken within `timeout` (no frozen process holds it)."""
        conn = sqlite3.connect(self.path, timeout=timeout, isolation_level=None)
        try:
            conn.execute("BEGIN IMMEDIATE")
            conn.execute("ROLLBACK")
            return True
        except sqlite3.OperationalError:
            return False
        finally:
            conn.close()
