"""The kit's workers always use the test's claims database, and its worker subprocesses recover a killed job
within seconds.

An app's own configuration names its claims database (`oncelery_database_url`, e.g. from a celeryconfig.py,
as the README shows), and it wins over $ONCELERY_DATABASE_URL; a test worker must not follow it to a
developer's database. So the kit overrides it: an in-process worker's app gets the test database in its conf
for the block, and a worker subprocess is started through this module (`python -m oncelery.testing <app path>
worker ...`), which imports the app, loads its configuration, sets the test database over it, and
then runs Celery's own command line on that same app object. Should the URL change again afterwards (a
celeryd_init or worker_init handler of the app), the worker stops at once with `WorkerDatabaseMismatch`,
naming both URLs, before it takes a job.

On Redis the subprocess also merges the kit's transport options into the app's (`kit_transport_options`: a
short visibility timeout, a restore sweep every second), never replacing the app's other options.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from contextlib import ExitStack
from pathlib import Path
from typing import Any

import pytest
from celery.app.utils import find_app
from celery.utils.imports import symbol_by_name
from sqlalchemy.engine import make_url

from oncelery.errors import ConfigurationError
from oncelery.settings import CONF_DATABASE_URL, ENV_DATABASE_URL, configured_database_url
from oncelery.settings_files import FILE_SUFFIX
from oncelery.testing.broker import TEST_VISIBILITY_TIMEOUT, kit_transport_options
from oncelery.testing.db import OnceleryDb
from oncelery.testing.isolation import isolate, isolated
from oncelery.testing.waiting import wait_until

__all__ = [
    "ENV_WORKER_DATABASE_URL",
    "ENV_WORKER_VISIBILITY",
    "WorkerDatabaseMismatch",
    "WorkerProcess",
    "check_test_database",
    "import_app",
    "main",
    "prepare_worker_app",
]

#: The test database a kit worker subprocess must use (set by WorkerProcess, read by `main`).
ENV_WORKER_DATABASE_URL = "ONCELERY_TEST_WORKER_DATABASE_URL"
#: The visibility timeout (seconds) a kit worker subprocess sets on Redis; empty: the app's own.
ENV_WORKER_VISIBILITY = "ONCELERY_TEST_WORKER_VISIBILITY_TIMEOUT"
_MARK = "oncelery.testing: WorkerDatabaseMismatch: "  # how a refusing subprocess tells the test process why


class WorkerDatabaseMismatch(ConfigurationError):
    """Raised when a test worker would use a claims database other than the test's."""

    @classmethod
    def of(cls, who: str, seen: str | None, wanted: str) -> WorkerDatabaseMismatch:
        """The error naming both URLs (passwords hidden) and what to do."""
        return cls(
            f"{who} would use the claims database {_shown(seen)}, not the test database {_shown(wanted)}: "
            f"something in the app set {CONF_DATABASE_URL} again after the kit's override (a celeryd_init or "
            "worker_init handler?); leave it alone under the test kit, which gives every worker the test database"
        )


def _shown(url: str | None) -> str:
    if not url:
        return "(none)"
    try:
        return make_url(url).render_as_string(hide_password=True)
    except Exception:  # not a URL SQLAlchemy parses: show it as it is, it holds no password we could hide
        return url


def check_test_database(app: Any, url: str, who: str) -> None:
    """Raise WorkerDatabaseMismatch unless the app's claims database is now `url`."""
    seen = configured_database_url(app.conf)
    if seen != url:
        raise WorkerDatabaseMismatch.of(who, seen, url)


def prepare_worker_app(app: Any, url: str, visibility_timeout: float | None) -> dict[str, Any]:
    """Isolate the app on the test database `url` over its own configuration (its claims database, the test's
    queues and results: oncelery.testing.isolation), merge the kit's transport options (returned), and have the
    worker re-assert the database at celeryd_init and refuse at worker_init if it changed. Called in the worker
    subprocess, before Celery's command line starts the worker."""
    from celery import signals  # imported here: only the worker subprocess connects these handlers

    isolate(app, url)  # loads the app's configuration first; the test's database, queues and results win over it
    options = kit_transport_options(app, visibility_timeout)  # named after the test's default queue
    if options:
        app.conf.broker_transport_options = {**(app.conf.broker_transport_options or {}), **options}
    check_test_database(app, url, "this kit worker")

    def settle(sender: Any = None, **_: Any) -> None:
        app.conf[CONF_DATABASE_URL] = url  # after the app's own celeryd_init handlers (connected before this)

    def refuse(sender: Any = None, **_: Any) -> None:
        try:
            check_test_database(app, url, f"kit worker {getattr(sender, 'hostname', '') or ''}".strip())
        except WorkerDatabaseMismatch as exc:
            # SystemExit passes through Celery's signal dispatch (it catches Exception): the worker exits 1.
            raise SystemExit(f"{_MARK}{exc}") from None

    signals.celeryd_init.connect(settle, weak=False, dispatch_uid="oncelery.testing.settle")
    signals.worker_init.connect(refuse, weak=False, dispatch_uid="oncelery.testing.refuse")
    return options


def main(argv: list[str] | None = None) -> None:
    """`python -m oncelery.testing <app path> worker [options]`: Celery's `celery -A <app path> worker
    [options]` on the test database ($ONCELERY_TEST_WORKER_DATABASE_URL) whatever the app configures."""
    # Imported here: Celery's command line (click and every subcommand) loads only in the worker subprocess.
    from celery.bin.celery import main as celery_main

    args = list(sys.argv[1:] if argv is None else argv)
    if not args or ENV_WORKER_DATABASE_URL not in os.environ:
        raise SystemExit(f"usage: {ENV_WORKER_DATABASE_URL}=<url> python -m oncelery.testing <app> worker ...")
    app_path, rest = args[0], args[1:]
    sys.path.insert(0, os.getcwd())  # as `celery -A` finds the app's package from the working folder
    app = find_app(app_path, symbol_by_name=symbol_by_name)
    visibility = os.environ.get(ENV_WORKER_VISIBILITY, "")
    try:
        prepare_worker_app(app, os.environ[ENV_WORKER_DATABASE_URL], float(visibility) if visibility else None)
    except WorkerDatabaseMismatch as exc:
        raise SystemExit(f"{_MARK}{exc}") from None
    sys.argv = ["celery", "-A", app_path, *rest]  # the same module, already imported: the same app object
    celery_main()


def import_app(path: str) -> Any:
    """The Celery app at the import path `path` ("pkg.module:app"), imported in this process as `celery -A`
    finds it; ConfigurationError naming the path if it cannot be."""

    try:
        return find_app(path, symbol_by_name=symbol_by_name)
    except Exception as exc:
        raise ConfigurationError(
            f"the test process imports the app {path!r} too (the jobs it sends must go to the test's queues), "
            f"and could not: {exc}"
        ) from exc


class WorkerProcess:
    """A real `celery worker` subprocess (its own process group) on the test database, stopped by its PID.

    From its start to its `stop()`, the app at its path is isolated in this process too (the test's database,
    queues and results: oncelery.testing.isolation), so the jobs this process sends go where the worker takes
    them. On Redis it recovers a killed worker's job after `visibility_timeout` seconds (default
    TEST_VISIBILITY_TIMEOUT; None keeps the app's own).
    """

    def __init__(
        self,
        app_path: str,
        db: OnceleryDb,
        hostname: str,
        concurrency: int,
        env: dict[str, str],
        visibility_timeout: float | None = TEST_VISIBILITY_TIMEOUT,
    ) -> None:
        self.hostname = hostname
        self.visibility_timeout = visibility_timeout
        self.log = Path(env.get("ONCELERY_TEST_LOG_DIR", "/tmp")) / f"{hostname}.log"
        cmd = [sys.executable, "-m", "oncelery.testing", app_path, "worker", "--loglevel=INFO", "-n", hostname]
        cmd += ["--pool", "prefork", "--concurrency", str(concurrency), "--without-gossip", "--without-mingle"]
        env = {
            **{k: v for k, v in os.environ.items() if k != ENV_DATABASE_URL + FILE_SUFFIX},  # never both set
            **env,
            ENV_DATABASE_URL: db.url,  # for model calls made outside any task, too
            ENV_WORKER_DATABASE_URL: db.url,
            ENV_WORKER_VISIBILITY: "" if visibility_timeout is None else str(visibility_timeout),
        }
        self._isolation = ExitStack()
        self._isolation.enter_context(isolated(import_app(app_path), db.url))
        try:
            with open(self.log, "wb") as out:
                self.proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, env=env, start_new_session=True)
            wait_until(lambda: self.ready() or self.proc.poll() is not None, 120, what=f"worker {hostname} to be ready")
        except BaseException:
            self.stop()  # never left running, nor the app isolated, by a start that failed
            raise
        if self.proc.poll() is not None:
            self._isolation.close()
            refused = [line for line in self.output().splitlines() if line.startswith(_MARK)]
            if refused:
                raise WorkerDatabaseMismatch(refused[-1][len(_MARK) :])
            pytest.fail(f"worker {hostname} exited with {self.proc.returncode}:\n{self.output()[-3000:]}")

    def transport_options(self, app: Any) -> dict[str, Any]:
        """The transport options this worker merged into `app`'s (its unacked keys, its visibility timeout)."""
        return kit_transport_options(app, self.visibility_timeout)

    @property
    def pid(self) -> int:
        """The worker's main process id (its pool children share its process group)."""
        return self.proc.pid

    def output(self) -> str:
        """What the worker has logged so far."""
        return self.log.read_text(errors="replace") if self.log.exists() else ""

    def ready(self) -> bool:
        """Whether the worker has started consuming."""
        return " ready." in self.output()

    def signal(self, sig: int) -> None:
        """Send `sig` to the worker and its pool children (its process group)."""
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, sig)

    def kill(self) -> None:
        """SIGKILL the worker and its children at once (as the OOM killer would) and reap it."""
        self.signal(signal.SIGKILL)
        self.proc.wait(30)

    def stop(self) -> None:
        """Stop the worker: SIGCONT (if frozen), SIGTERM, then SIGKILL after 30 s; then this process's isolation
        of the app ends (the app's settings are back when no other worker or fixture of the test holds it)."""
        try:
            proc = getattr(self, "proc", None)
            if proc is None or proc.poll() is not None:
                return
            self.signal(signal.SIGCONT)
            self.signal(signal.SIGTERM)
            try:
                proc.wait(30)
            except subprocess.TimeoutExpired:
                self.kill()
        finally:
            self._isolation.close()
