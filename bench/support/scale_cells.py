"""bench/scale.py's results: one measured phase (`Cell`), the table of all of them, and the capacity model."""

from __future__ import annotations

import statistics
from dataclasses import dataclass
from typing import Any


@dataclass
class Cell:
    """One phase (first executions or duplicates) at one worker count, direct or through PgBouncer; per job."""

    workers: int
    mode: str
    phase: str
    jobs: int  # measured after the warm-up
    rate: float  # jobs/s
    pg_ms: float  # CPU of every PostgreSQL process
    backend_ms: float  # CPU of the bench database's client backends
    worker_ms: float
    bouncer_ms: float
    wal_bytes: float
    wal_records: float
    wal_fpi: float
    wal_sync: float
    xact: float
    deadlocks: int
    lock_mean: float  # backends waiting on a heavyweight lock, mean per sample
    lock_share: float  # share of samples with one
    lwlock_mean: float
    conns: int  # client backends of the bench database, max sampled
    clients: int  # PgBouncer's clients, max sampled (0 direct)
    clients_waiting: float  # PgBouncer's clients waiting for a server connection, mean
    waits: dict[str, int]  # the waits sampled most often (type:event -> samples)
    verified: str

    @property
    def per_process(self) -> float:
        """PostgreSQL connections per worker process."""
        return self.conns / self.workers

    def line(self) -> str:
        """One progress line."""
        return (
            f"{self.workers:>3} {self.mode:<9} {self.phase:<4} {self.jobs} jobs {self.rate:6.0f}/s  "
            f"PG {self.pg_ms:.3f} ms (backends {self.backend_ms:.3f})  "
            f"WAL {self.wal_bytes:.0f} B {self.wal_records:.2f} rec "
            f"{self.wal_sync:.2f} flush  xact {self.xact:.2f}  lock {self.lock_mean:.2f} LWL {self.lwlock_mean:.2f}  "
            f"conns {self.conns} clients {self.clients}  worker {self.worker_ms:.2f} ms pgb {self.bouncer_ms:.3f} ms  "
            f"waits {self.waits} [{self.verified}]" + (f" DEADLOCKS {self.deadlocks}" if self.deadlocks else "")
        )


HEADER = (
    f"{'N':>3} {'mode':<9} {'phase':<5} {'jobs/s':>7} {'PG ms':>6} {'bk ms':>6} {'WAL B':>6} {'rec':>5} "
    f"{'FPI':>5} {'flush':>6} {'xact':>5} {'lock':>5} {'lock%':>6} {'LWL':>5} {'conns':>5} {'/proc':>5} "
    f"{'clients':>7} {'cl_wait':>7} {'worker ms':>9} {'pgb ms':>6}"
)


def print_cells(cells: list[Cell]) -> None:
    """Print every cell as one row of a table."""
    print()
    print(HEADER)
    print("-" * len(HEADER))
    for c in cells:
        print(
            f"{c.workers:>3} {c.mode:<9} {c.phase:<5} {c.rate:>7.0f} {c.pg_ms:>6.3f} {c.backend_ms:>6.3f} "
            f"{c.wal_bytes:>6.0f} {c.wal_records:>5.2f} {c.wal_fpi:>5.3f} {c.wal_sync:>6.3f} {c.xact:>5.2f} "
            f"{c.lock_mean:>5.2f} {c.lock_share:>6.1%} {c.lwlock_mean:>5.2f} {c.conns:>5} {c.per_process:>5.2f} "
            f"{c.clients:>7} {c.clients_waiting:>7.2f} {c.worker_ms:>9.2f} {c.bouncer_ms:>6.3f}"
        )


def print_model(cells: list[Cell]) -> dict[str, Any]:
    """Print and return the model per mode and phase: medians over the worker counts, and claims/s per PG core."""
    model: dict[str, Any] = {}
    print()
    print(
        f"{'model (median over N)':<22} {'PG ms/job':>9} {'jobs/s per PG core':>18} {'WAL B/job':>9} "
        f"{'flush/job':>9} {'conns/process':>13} {'pgb ms/job':>10}"
    )
    for mode in dict.fromkeys(c.mode for c in cells):
        for phase in ("idem", "dup"):
            group = [c for c in cells if c.mode == mode and c.phase == phase]
            if not group:
                continue
            pg_ms = statistics.median(c.pg_ms for c in group)
            entry = {
                "pg_ms": pg_ms,
                "per_core": 1000 / pg_ms,
                "wal_bytes": statistics.median(c.wal_bytes for c in group),
                "wal_sync": statistics.median(c.wal_sync for c in group),
                "conns_per_process": statistics.median(c.per_process for c in group),
                "bouncer_ms": statistics.median(c.bouncer_ms for c in group),
            }
            model[f"{mode}/{phase}"] = entry
            print(
                f"{mode + ' ' + phase:<22} {pg_ms:>9.3f} {entry['per_core']:>18.0f} {entry['wal_bytes']:>9.0f} "
                f"{entry['wal_sync']:>9.3f} {entry['conns_per_process']:>13.2f} {entry['bouncer_ms']:>10.3f}"
            )
    return model
