"""The ledger spool's files: where they are, what a line holds, and how a file is replayed into the database.

A line: `{"v": 1, "db": <database URL, password masked>, "row": <the model_calls row>}` (a row spooled before
migration 0015 carries `cost`, float USD, instead of `cost_micros`: read as the micro-USD rounded up, the rule
every call's cost follows since, so an upgrade never strands a spool). A file is replayed by
whoever holds its `flock` (its live writer, or anyone once the writer is gone), each row written with
`write_call` (its call_id makes a second write a no-op), and removed only once every row in it is in the
database. A line that cannot be parsed (a write torn by a crash) or a row the database refuses for good is moved
to `<folder>/rejected.jsonl` and logged, never dropped silently. oncelery.ledger.spool appends them.
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import logging
import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from oncelery.errors import StoreError
from oncelery.ledger.rows import write_call
from oncelery.models.money import micros_up
from oncelery.settings import (
    CONF_LEDGER_SPOOL_DIR,
    DEFAULT_DATA_DIR,
    DEFAULT_LEDGER_SPOOL,
    ENV_DATA_DIR,
    ENV_LEDGER_SPOOL_DIR,
    configured_database_url,
)
from oncelery.store.database import Database, safe_url

__all__ = [
    "FORMAT",
    "PREFIX",
    "REJECTED_FILE",
    "SUFFIX",
    "fsync_folder",
    "remember_database",
    "replay_at_worker_start",
    "replay_file",
    "replay_orphans",
    "spool_files",
    "spool_folder",
    "spool_line",
    "spooled_rows",
]

logger = logging.getLogger("oncelery.ledger")  # the ledger's stable logger name (users filter on it)

FORMAT = 1  # the spool line's "v"
PREFIX = "ledger-"
SUFFIX = ".jsonl"
REJECTED_FILE = "rejected.jsonl"

_urls: dict[str, str] = {}  # masked URL -> URL: the databases this process can replay rows into
_databases: dict[str, Database] = {}


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
    for path in spool_files(folder):
        with contextlib.suppress(FileNotFoundError):
            rows.extend(entry["row"] for _, entry in _lines(path.read_bytes()) if entry is not None)
    return rows


def spool_files(folder: Path) -> list[Path]:
    try:
        return sorted(p for p in folder.iterdir() if p.name.startswith(PREFIX) and p.name.endswith(SUFFIX))
    except FileNotFoundError:
        return []


def remember_database(url: str) -> str:
    """Note that this process can write rows spooled for `url`; return the name its lines carry (masked)."""
    masked = safe_url(url)
    _urls.setdefault(masked, url)
    return masked


def spool_line(masked_url: str, row: Any) -> bytes:
    """The spool line of `row` for the database named `masked_url`, newline included."""
    line = json.dumps({"v": FORMAT, "db": masked_url, "row": dict(row)}, separators=(",", ":"), default=str)
    return line.encode("utf-8") + b"\n"


def replay_orphans(folder: Path, url: str | None = None) -> int:
    """Write the rows of `folder`'s files that no live process holds (their writer died or exited), into the
    databases this process knows (and `url`); return how many files were written and removed."""
    if url is not None:
        remember_database(url)
    done = 0
    for path in spool_files(folder):
        try:
            fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
        except FileNotFoundError:
            continue  # replayed and removed by someone else meanwhile
        try:
            with _locked(fd) as mine:
                # Held by a live writer, or by another replayer; or removed since we opened it.
                if mine and _same_file(path, fd) and replay_file(path, fd):
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


def replay_file(path: Path, fd: int) -> bool:
    """Write every row of the file `fd` (locked by us); remove the file once all are in; False: not all are."""
    size = os.fstat(fd).st_size
    rejected: list[tuple[bytes, str]] = []  # set aside once, as the file is removed (a retry would repeat them)
    for raw, entry in _lines(os.pread(fd, size, 0) if size else b""):
        if entry is None:
            rejected.append((raw, "not a spool line of this version (torn by a crash?)"))
            continue
        url = _urls.get(entry["db"])
        if url is None:
            return False  # rows for a database this process cannot name: left for a process that can
        try:
            db = _database(url)
            db.require_file()  # a SQLite file that is gone is not created empty by a replay
            new = write_call(db, entry["row"])
        except StoreError as exc:  # unreachable, locked, gone, or not upgraded yet: the rows wait for it
            logger.info("ledger spool %s: the database still cannot take its rows (%s); later", path.name, exc)
            return False
        except Exception as exc:  # refused for good (e.g. a value the database rejects): kept aside, not lost
            rejected.append((raw, f"{type(exc).__name__}: {exc}"))
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
    for raw, why in rejected:
        _reject(path.parent, raw, why)
    with contextlib.suppress(FileNotFoundError):
        path.unlink()
    fsync_folder(path.parent)
    return True


def _lines(data: bytes) -> Iterator[tuple[bytes, dict[str, Any] | None]]:
    """Each line and its entry (None: not a line of this format, e.g. torn by a crash mid-write)."""
    for raw in data.splitlines():
        if not raw.strip():
            continue
        try:
            entry = json.loads(raw)
        except ValueError:
            entry = None
        ok = isinstance(entry, dict) and entry.get("v") == FORMAT and isinstance(entry.get("row"), dict)
        if ok and "cost" in entry["row"]:
            entry["row"] = _priced_in_micros(entry["row"])
        yield raw, entry if ok else None


def _priced_in_micros(row: dict[str, Any]) -> dict[str, Any]:
    """A row spooled by a version before 0015 (`cost`: float USD or None) with `cost_micros` instead."""
    usd = row.pop("cost")
    try:
        row["cost_micros"] = None if usd is None else micros_up(usd)
    except (TypeError, ValueError, ArithmeticError):  # not a number: write_call refuses it, the row is set aside
        row["cost_micros"] = usd
    return row


def _reject(folder: Path, raw: bytes, why: str) -> None:
    target = folder / REJECTED_FILE
    logger.error("ledger spool: a row cannot be written (%s); kept in %s: %s", why, target, raw[:500])
    fd = os.open(target, os.O_WRONLY | os.O_CREAT | os.O_APPEND | os.O_CLOEXEC, 0o600)
    try:
        os.write(fd, raw.rstrip(b"\n") + b"\n")
        os.fsync(fd)
    finally:
        os.close(fd)


def fsync_folder(folder: Path) -> None:
    """Make a file's creation, rename or removal in `folder` durable."""
    fd = os.open(folder, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _database(url: str) -> Database:
    db = _databases.get(url)
    if db is None:
        db = _databases[url] = Database(url)
    return db


def replay_at_worker_start(conf: Any) -> None:
    """Write every spool file left by an earlier process of this app's database, logging (never raising) a failure.

    Called by the worker's main process before its pool starts (oncelery.basetask.startup connects it to
    Celery's worker_init): no thread is left running across the prefork pool's forks."""
    url = configured_database_url(conf) if conf is not None else None
    if url is None:
        return
    folder = spool_folder(conf)
    if not spool_files(folder):
        return
    try:
        done = replay_orphans(folder, url)
    except Exception:
        logger.exception("ledger spool %s: could not replay it at worker start; the next start tries again", folder)
        return
    if done:
        logger.info("ledger spool %s: %d file(s) left by earlier processes written at worker start", folder, done)
