"""What-if experiments patched into the benchmark worker only (BENCH_WHAT_IF, `throughput.py --what-if`).

They measure what a proposed change would buy before anyone writes it. They weaken guarantees and are tied to
the internals of commit 74b8352 (async-claim refuses to run where those moved):

    no-heartbeat   no lease-renewal thread per job (a job must finish within its lease)
    no-pre-ping    pool_pre_ping=False: no `;` round trip per connection checkout
    async-claim    the claim INSERT's transaction commits with synchronous_commit=off (no WAL flush wait);
                   the completion stays synchronous
    all-async      every transaction synchronous_commit=off (an upper bound: completion is not durable)
    floor-async-claim  bench_floor's claim INSERT runs on a synchronous_commit=off connection (read by bench_app)
    no-browse-indexes  the five task_runs indexes of migration 0028 (Flower's Runs pages) are dropped from the
                   bench database before the rounds (throughput.py; nothing is patched in the worker): what
                   those indexes cost each claim and completion
"""

from __future__ import annotations

from typing import Any

KNOWN_WHAT_IF = {"no-heartbeat", "no-pre-ping", "async-claim", "all-async", "floor-async-claim", "no-browse-indexes"}
#: The indexes `no-browse-indexes` drops (models/migrations/versions/0028).
BROWSE_INDEXES = (
    "ix_task_runs_status_id",
    "ix_task_runs_task_name_status_id",
    "ix_task_runs_tenant_status_id",
    "ix_task_runs_taken_over",
    "ix_task_runs_replayed",
)


def apply_what_if(what_if: set[str]) -> None:
    """Patch Oncelery's internals in this (worker) process for each experiment in `what_if`."""
    if what_if - KNOWN_WHAT_IF:
        raise SystemExit(f"unknown BENCH_WHAT_IF {sorted(what_if - KNOWN_WHAT_IF)}; known: {sorted(KNOWN_WHAT_IF)}")
    if "no-heartbeat" in what_if:
        _no_heartbeat()
    if what_if & {"no-pre-ping", "all-async"}:
        _patch_create_engine(what_if)
    if "async-claim" in what_if:
        _async_claim()


def _no_heartbeat() -> None:
    """no-heartbeat: the delivery starts a Heartbeat that does nothing."""
    import oncelery.delivery.claimed as task_module  # where the delivery starts its Heartbeat (ClaimedRow._attach)

    class _NoHeartbeat:
        def __init__(self, store: Any, claim: Any) -> None:
            pass

        def start(self) -> _NoHeartbeat:
            return self

        def stop(self) -> None:
            pass

        def check(self) -> None:
            pass

    task_module.Heartbeat = _NoHeartbeat  # type: ignore[misc,assignment]


def _patch_create_engine(what_if: set[str]) -> None:
    """no-pre-ping and all-async: engines are created without pre-ping, or with synchronous_commit=off."""
    import oncelery.store.dialects as db  # where engines are created

    real_create_engine = db.create_engine

    def create_engine(url: Any, **kw: Any) -> Any:
        if "no-pre-ping" in what_if:
            kw["pool_pre_ping"] = False
        if "all-async" in what_if and str(url).startswith("postgresql"):
            kw.setdefault("connect_args", {})["options"] = "-c synchronous_commit=off"
        return real_create_engine(url, **kw)

    db.create_engine = create_engine  # type: ignore[assignment]


def _async_claim() -> None:
    """async-claim: the claim INSERT's transaction runs with synchronous_commit=off."""
    import threading
    from contextlib import contextmanager

    from oncelery.runs.claims import RunStore

    if not hasattr(RunStore, "_insert_claim") or not hasattr(RunStore, "_txn"):
        raise SystemExit("what-if async-claim patches RunStore._insert_claim/_txn, which moved: update it")
    flag = threading.local()
    real_insert_claim, real_txn = RunStore._insert_claim, RunStore._txn

    def _insert_claim(self: RunStore, *a: Any, **kw: Any) -> Any:
        flag.on = True
        try:
            return real_insert_claim(self, *a, **kw)
        finally:
            flag.on = False

    @contextmanager
    def _txn(self: RunStore) -> Any:
        with real_txn(self) as conn:
            if getattr(flag, "on", False):
                conn.exec_driver_sql("SET LOCAL synchronous_commit = off")
            yield conn

    RunStore._insert_claim = _insert_claim  # type: ignore[method-assign]
    RunStore._txn = _txn  # type: ignore[method-assign,assignment]
