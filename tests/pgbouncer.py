"""A private PgBouncer in transaction pooling mode, in front of a PostgreSQL, for tests and bench/scale.py.

Debian's `pgbouncer` (`apt-get install pgbouncer`; the package's own service is never used): its ini, auth
file, log and pid file live in a temporary folder, it listens on 127.0.0.1 on a free port with no unix socket,
and it is stopped by its PID. It refuses to run as root, so as root it is started with `-u postgres`, which
switches to that user in the same process (the PID this object holds is the server's). Authentication is
`trust` for the one user it knows; the admin console (database `pgbouncer`) answers `SHOW` commands.
Every other setting is PgBouncer's default, `ignore_startup_parameters` included: a client that sends
`options` is refused, as a production PgBouncer refuses it.
"""

from __future__ import annotations

import os
import pwd
import shutil
import signal
import subprocess
import tempfile
import time
from contextlib import suppress
from pathlib import Path
from typing import Any

from sqlalchemy.engine import make_url

from oncelery.store.pgbouncer import PGBOUNCER_FLAG
from oncelery.testing.cluster import SUPERUSER, _alive, free_port, postgres_user_exists

START_TIMEOUT = 10.0


def pgbouncer_binary() -> str | None:
    """The path of the `pgbouncer` program (PATH, then Debian's /usr/sbin), or None."""
    found = shutil.which("pgbouncer")
    if found is None and Path("/usr/sbin/pgbouncer").exists():
        found = "/usr/sbin/pgbouncer"
    return found


def missing_pgbouncer() -> str | None:
    """Why no private PgBouncer can run here (one line naming the fix), or None when it can."""
    if pgbouncer_binary() is None:
        return "no pgbouncer program: apt-get install -y pgbouncer"
    if os.geteuid() == 0 and not postgres_user_exists():
        return "pgbouncer refuses to run as root, and there is no `postgres` user to run it as"
    return None


class PgBouncer:
    """One pgbouncer process in transaction mode in front of `host:port`, on a free port of 127.0.0.1."""

    def __init__(self, host: str, port: int, user: str = SUPERUSER, pool_size: int = 20) -> None:
        self.target = (host, port)
        self.user = user
        self.pool_size = pool_size
        self.port = free_port()
        self.root = Path(tempfile.mkdtemp(prefix="oncelery-pgbouncer-"))
        self.proc: subprocess.Popen[bytes] | None = None

    @property
    def pid(self) -> int | None:
        """The server's PID while it runs."""
        return self.proc.pid if self.proc is not None and self.proc.poll() is None else None

    def url(self, database_url: str) -> str:
        """`database_url` (same database and user) through this PgBouncer, flagged `oncelery_pgbouncer=1`."""
        through = make_url(database_url).set(host="127.0.0.1", port=self.port)
        return through.update_query_dict({PGBOUNCER_FLAG: "1"}).render_as_string(hide_password=False)

    def _ini(self) -> str:
        host, port = self.target
        return "\n".join(
            [
                "[databases]",
                f"* = host={host} port={port}",
                "[pgbouncer]",
                "listen_addr = 127.0.0.1",
                f"listen_port = {self.port}",
                "unix_socket_dir =",
                "auth_type = trust",
                f"auth_file = {self.root / 'users.txt'}",
                f"admin_users = {self.user}",
                "pool_mode = transaction",
                f"default_pool_size = {self.pool_size}",
                "max_client_conn = 2000",
                f"logfile = {self.root / 'pgbouncer.log'}",
                f"pidfile = {self.root / 'pgbouncer.pid'}",
                "log_connections = 0",
                "log_disconnections = 0",
                "",
            ]
        )

    def start(self) -> PgBouncer:
        """Write the configuration, start the server and wait until its admin console answers."""
        ini = self.root / "pgbouncer.ini"
        ini.write_text(self._ini())
        (self.root / "users.txt").write_text(f'"{self.user}" ""\n')
        binary = pgbouncer_binary() or "pgbouncer"
        cmd = [binary, str(ini)]
        if os.geteuid() == 0:
            entry = pwd.getpwnam(SUPERUSER)
            for path in (self.root, *self.root.iterdir()):
                os.chown(path, entry.pw_uid, entry.pw_gid)
            cmd = [binary, "-u", SUPERUSER, str(ini)]
        self.proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        deadline = time.monotonic() + START_TIMEOUT
        while True:
            try:
                self.show("VERSION")
                return self
            except Exception:
                if self.proc.poll() is not None or time.monotonic() > deadline:
                    self.stop()
                    raise RuntimeError(f"pgbouncer did not start:\n{self.log_tail()}") from None
                time.sleep(0.05)

    def admin(self) -> Any:
        """A new psycopg connection to the admin console (database `pgbouncer`); the caller closes it."""
        import psycopg

        dsn = f"host=127.0.0.1 port={self.port} user={self.user} dbname=pgbouncer connect_timeout=5"
        return psycopg.connect(dsn, autocommit=True)

    def show(self, what: str, conn: Any = None) -> list[dict[str, Any]]:
        """The rows of the admin console's `SHOW <what>` (POOLS, CLIENTS, SERVERS, STATS...), as dicts.

        On `conn` (from `admin()`, for callers that ask often), else on a connection of its own.
        """
        import psycopg

        if conn is None:
            with self.admin() as own:
                return self.show(what, own)
        # The admin console speaks the simple query protocol only.
        result = conn.pgconn.exec_(f"SHOW {what}".encode())
        if result.status != psycopg.pq.ExecStatus.TUPLES_OK:
            raise RuntimeError(f"SHOW {what}: {(result.error_message or b'').decode(errors='replace')}")
        names = [(result.fname(i) or b"").decode() for i in range(result.nfields)]
        return [
            {names[c]: (result.get_value(r, c) or b"").decode() for c in range(result.nfields)}
            for r in range(result.ntuples)
        ]

    def reconnect(self, database: str) -> None:
        """Close its server connections to `database` once released (their backends exit; new ones open on demand)."""
        import psycopg

        with self.admin() as conn:
            result = conn.pgconn.exec_(f"RECONNECT {database}".encode())
            if result.status != psycopg.pq.ExecStatus.COMMAND_OK:
                raise RuntimeError(f"RECONNECT {database}: {(result.error_message or b'').decode(errors='replace')}")

    def log_tail(self, chars: int = 3000) -> str:
        """The end of the server's log."""
        try:
            return (self.root / "pgbouncer.log").read_text(errors="replace")[-chars:]
        except OSError:
            return ""

    def stop(self) -> None:
        """Stop the server by its PID (SIGTERM: immediate shutdown), SIGKILL after 10 s; remove its folder."""
        proc, self.proc = self.proc, None
        if proc is not None and proc.poll() is None:
            proc.send_signal(signal.SIGTERM)
            try:
                proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                with suppress(ProcessLookupError):
                    proc.kill()
                proc.wait()
        if proc is not None and _alive(proc.pid):
            raise RuntimeError(f"pgbouncer {proc.pid} did not exit")
        shutil.rmtree(self.root, ignore_errors=True)
