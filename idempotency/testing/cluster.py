"""A throwaway PostgreSQL cluster that a test starts, restarts, stops and kills backends of, by itself.

Never a shared server: `initdb` makes a cluster in a temporary folder (owned by the `postgres` user when the
tests run as root: initdb and postgres refuse to run as root), `pg_ctl` starts it on 127.0.0.1 on a free port,
with its unix socket inside that folder, trust authentication and `fsync=off` (a test cluster need not survive
a power cut). The kit's session-scoped fixture `oncelery_pg_cluster` is one cluster for the whole test session,
started when a test first asks for it, and skipped with the reason when PostgreSQL's server binaries
(initdb, pg_ctl, postgres) are missing; a test that stops, restarts or kills it leaves it running for the next
one (`ensure_running`). At the session's end the fixture stops the server (by its PID) and removes the folder.
psycopg is imported only when a statement runs (the `postgres` extra).
"""

from __future__ import annotations

import glob
import itertools
import os
import pwd
import shutil
import signal
import socket
import subprocess
import tempfile
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager, suppress
from pathlib import Path

__all__ = [
    "PG_CTL_TIMEOUT",
    "SERVER_SETTINGS",
    "SUPERUSER",
    "PgCluster",
    "free_port",
    "missing_binaries",
    "postgres_bindir",
    "postgres_runnable",
    "postgres_user_exists",
    "teardown_on_sigterm",
]

SUPERUSER = "postgres"
# How long pg_ctl may wait for the server to start or stop (a loaded 2-core machine can be slow).
PG_CTL_TIMEOUT = 60
_database_numbers = itertools.count(1)
# A test cluster's settings: it need not survive a power cut.
SERVER_SETTINGS = {"fsync": "off", "full_page_writes": "off", "max_connections": "200", "shared_buffers": "32MB"}


def postgres_bindir() -> Path | None:
    """Return the folder of initdb/pg_ctl/postgres (`pg_config --bindir`, else /usr/lib/postgresql/*/bin)."""
    candidates: list[str] = []
    pg_config = shutil.which("pg_config")
    if pg_config:
        with suppress(OSError, subprocess.SubprocessError):
            out = subprocess.run([pg_config, "--bindir"], capture_output=True, text=True, check=True, timeout=30)
            candidates.append(out.stdout.strip())
    candidates += sorted(glob.glob("/usr/lib/postgresql/*/bin"), reverse=True)
    for folder in candidates:
        if folder and all(os.access(Path(folder, exe), os.X_OK) for exe in ("initdb", "pg_ctl", "postgres")):
            return Path(folder)
    return None


def postgres_user_exists() -> bool:
    """Return whether the `postgres` system user exists (initdb and the server run as it)."""
    try:
        pwd.getpwnam(SUPERUSER)
    except KeyError:
        return False
    return True


def free_port() -> int:
    """Return a TCP port on 127.0.0.1 that nothing listens on right now."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def _alive(pid: int) -> bool:
    """Return whether `pid` is a process that has not exited (a zombie has)."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except FileNotFoundError:
        if Path("/proc/self/stat").exists():
            return False  # Linux, and the process is gone
        try:  # no /proc (macOS): ask the kernel, which cannot tell a zombie
            os.kill(pid, 0)
        except ProcessLookupError:
            return False
        except PermissionError:
            return True
        return True
    except OSError:
        return False
    return stat.rsplit(")", 1)[1].split()[0] != "Z"


class PgCluster:
    """One PostgreSQL cluster in a temporary folder: start/stop/restart it, create databases, kill backends."""

    def __init__(self, bindir: Path, settings: dict[str, str] | None = None) -> None:
        self.bindir = bindir
        # The server's settings (`-c name=value`): fast and throwaway unless a caller asks otherwise
        # (bench/scale.py measures WAL with fsync and full-page writes on, as a production server writes it).
        self.settings = {**SERVER_SETTINGS, **(settings or {})}
        self.root = Path(tempfile.mkdtemp(prefix="oncelery-pg-"))
        self.data = self.root / "data"
        self.sockets = self.root / "sockets"
        self.logfile = self.root / "server.log"
        self.port = free_port()
        self._initialized = False

    # -- addresses ---------------------------------------------------------------------------------

    @property
    def url(self) -> str:
        """The SQLAlchemy URL of the cluster's `postgres` database (psycopg 3, TCP, trust auth)."""
        return self.database_url("postgres")

    def database_url(self, name: str) -> str:
        """The SQLAlchemy URL of database `name` on this cluster."""
        return f"postgresql+psycopg://{SUPERUSER}@127.0.0.1:{self.port}/{name}"

    def _dsn(self, dbname: str = "postgres") -> str:
        return f"host=127.0.0.1 port={self.port} user={SUPERUSER} dbname={dbname} connect_timeout=10"

    # -- processes ---------------------------------------------------------------------------------

    def _as_postgres(self, *argv: str, timeout: float = PG_CTL_TIMEOUT + 30) -> subprocess.CompletedProcess[str]:
        cmd = ["runuser", "-u", SUPERUSER, "--", *argv] if os.geteuid() == 0 else list(argv)
        return subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, cwd=self.root)

    def _check(self, done: subprocess.CompletedProcess[str], what: str) -> None:
        if done.returncode != 0:
            raise RuntimeError(f"{what} failed ({done.returncode}):\n{done.stdout}\n{done.stderr}\n{self.log_tail()}")

    def _initdb(self) -> None:
        self.sockets.mkdir()
        if os.geteuid() == 0:
            entry = pwd.getpwnam(SUPERUSER)
            for path in (self.root, self.sockets):
                os.chown(path, entry.pw_uid, entry.pw_gid)
        done = self._as_postgres(
            str(self.bindir / "initdb"),
            "-D",
            str(self.data),
            "-U",
            SUPERUSER,
            "-A",
            "trust",
            "-E",
            "UTF8",
            "--no-locale",
            "--no-sync",
        )
        self._check(done, "initdb")
        self._initialized = True

    def start(self) -> None:
        """Start the server (initdb on first use) and wait until it accepts connections."""
        if not self._initialized:
            self._initdb()
        options = " ".join(
            [
                f"-p {self.port}",
                "-c listen_addresses=127.0.0.1",
                f"-c unix_socket_directories={self.sockets}",
                *(f"-c {name}={value}" for name, value in self.settings.items()),
            ]
        )
        done = self._as_postgres(
            str(self.bindir / "pg_ctl"),
            "start",
            "-D",
            str(self.data),
            "-l",
            str(self.logfile),
            "-o",
            options,
            "-w",
            "-t",
            str(PG_CTL_TIMEOUT),
        )
        self._check(done, "pg_ctl start")

    def pid(self) -> int | None:
        """Return the postmaster's PID while it runs (from postmaster.pid), else None."""
        try:
            first = (self.data / "postmaster.pid").read_text().split("\n", 1)[0]
            pid = int(first)
        except (OSError, ValueError):
            return None
        return pid if _alive(pid) else None

    def running(self) -> bool:
        """Return whether the postmaster runs."""
        return self.pid() is not None

    def stop(self, mode: str = "fast") -> None:
        """Stop the server by its PID: "fast" (SIGINT: roll back, disconnect) or "immediate" (SIGQUIT: crash)."""
        signals = {"smart": signal.SIGTERM, "fast": signal.SIGINT, "immediate": signal.SIGQUIT}
        if mode not in signals:
            raise ValueError(f"stop mode {mode!r}: choose one of {', '.join(signals)}")
        pid = self.pid()
        if pid is None:
            return
        children = _children(pid)
        with suppress(ProcessLookupError):
            os.kill(pid, signals[mode])
        deadline = time.monotonic() + PG_CTL_TIMEOUT
        while _alive(pid) and time.monotonic() < deadline:
            time.sleep(0.02)
        if _alive(pid):
            self.kill()
        # A backend can outlive its postmaster by a moment; the next start must find the port and shared
        # memory free.
        deadline = time.monotonic() + 10
        while any(_alive(c) for c in children) and time.monotonic() < deadline:
            time.sleep(0.02)

    def kill(self) -> None:
        """SIGKILL the postmaster and each of its children, by PID (the last resort of a teardown)."""
        pid = self.pid()
        if pid is None:
            return
        for child in _children(pid):
            with suppress(ProcessLookupError):
                os.kill(child, signal.SIGKILL)
        with suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)
        deadline = time.monotonic() + 10
        while _alive(pid) and time.monotonic() < deadline:
            time.sleep(0.02)

    def ensure_running(self) -> None:
        """Start the server again if a test left it stopped or killed (the session's next test needs it)."""
        if not self.running():
            self.start()

    def restart(self, mode: str = "fast") -> None:
        """Stop the server (`mode`) and start it again on the same port and data."""
        self.stop(mode)
        self.start()

    def remove(self) -> None:
        """Stop the server if it runs, then delete the cluster's folder."""
        try:
            self.stop("immediate")
        finally:
            self.kill()
            shutil.rmtree(self.root, ignore_errors=True)

    def log_tail(self, chars: int = 4000) -> str:
        """Return the end of the server's log (for failure messages)."""
        try:
            return self.logfile.read_text(errors="replace")[-chars:]
        except OSError:
            return ""

    # -- SQL ---------------------------------------------------------------------------------------

    def execute(self, sql: str, params: tuple[object, ...] = (), dbname: str = "postgres") -> list[tuple[object, ...]]:
        """Run one statement on a short-lived autocommit admin connection; return its rows."""
        import psycopg  # the `postgres` extra: a throwaway cluster is PostgreSQL, the kit runs without it

        with psycopg.connect(self._dsn(dbname), autocommit=True) as conn:
            cur = conn.execute(sql.encode(), params)  # type: ignore[arg-type]
            return list(cur.fetchall()) if cur.description else []

    def create_database(self, prefix: str = "faults") -> tuple[str, str]:
        """Create a fresh database `<prefix>_<n>`; return (its name, its URL)."""
        name = f"{prefix}_{next(_database_numbers)}"
        self.execute(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')
        self.execute(f'CREATE DATABASE "{name}"')
        return name, self.database_url(name)

    def drop_database(self, name: str) -> None:
        """Drop database `name`, disconnecting whoever is still on it."""
        self.execute(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')

    def terminate_backends(self, exclude_pid: int | None = None, database: str | None = None) -> int:
        """pg_terminate_backend every other client backend (of `database`, if given); return how many."""
        import psycopg  # the `postgres` extra, as in execute()

        with psycopg.connect(self._dsn(), autocommit=True) as conn:
            rows = conn.execute(
                # MATERIALIZED: the filter runs first (the planner must not call pg_terminate_backend on
                # rows the WHERE would have excluded, such as this very connection).
                "WITH victims AS MATERIALIZED (SELECT pid FROM pg_stat_activity "
                "WHERE backend_type = 'client backend' AND pid <> pg_backend_pid() "
                "AND pid IS DISTINCT FROM %s AND (%s::text IS NULL OR datname = %s)) "
                "SELECT pid FROM victims WHERE pg_terminate_backend(pid)",
                (exclude_pid, database, database),
            ).fetchall()
            killed = [int(pid) for (pid,) in rows]
            # pg_terminate_backend only signals: wait (bounded) until those backends are gone, so the next
            # statement on any of their client sockets fails for certain.
            deadline = time.monotonic() + 10
            while killed and time.monotonic() < deadline:
                left = conn.execute("SELECT count(*) FROM pg_stat_activity WHERE pid = ANY(%s)", (killed,)).fetchone()
                if not left or not left[0]:
                    break
                time.sleep(0.01)
        return len(killed)

    def client_backends(self, database: str | None = None) -> int:
        """Return how many client backends (other than this query's) are connected (to `database`)."""
        rows = self.execute(
            "SELECT count(*) FROM pg_stat_activity WHERE backend_type = 'client backend' "
            "AND pid <> pg_backend_pid() AND (%s::text IS NULL OR datname = %s)",
            (database, database),
        )
        return int(str(rows[0][0]))


def _children(pid: int) -> list[int]:
    """Return the PIDs whose parent is `pid` (the postmaster's backends and auxiliary processes)."""
    found = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            stat = (entry / "stat").read_text()
        except OSError:
            continue
        fields = stat.rsplit(")", 1)[1].split()
        if len(fields) > 1 and fields[1] == str(pid):
            found.append(int(entry.name))
    return found


def postgres_runnable() -> bool:
    """Return whether this machine can run a throwaway cluster (binaries and the postgres user are there)."""
    return missing_binaries() is None


def missing_binaries() -> str | None:
    """Why this machine cannot run a throwaway cluster (what to install), or None when it can."""
    if postgres_bindir() is None:
        return (
            "PostgreSQL's server binaries (initdb, pg_ctl, postgres) are not installed: install the PostgreSQL "
            "server package (e.g. apt install postgresql), or put pg_config on PATH"
        )
    if os.geteuid() == 0 and not postgres_user_exists():
        return "running as root needs a `postgres` system user to run initdb and the server as"
    return None


@contextmanager
def teardown_on_sigterm() -> Iterator[None]:
    """Turn SIGTERM (e.g. `timeout pytest ...` expiring) into KeyboardInterrupt, so the teardown still runs.

    Without it the server would outlive the killed test session; pytest tears fixtures down on an interrupt.
    """
    if threading.current_thread() is not threading.main_thread():
        yield
        return

    def interrupt(signum: int, frame: object) -> None:
        raise KeyboardInterrupt(f"signal {signum}: stopping the throwaway PostgreSQL cluster")

    previous = signal.signal(signal.SIGTERM, interrupt)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, previous)
