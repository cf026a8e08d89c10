"""How wide is the window in which a PostgreSQL crash forgets an acknowledged claim? (docs/concepts.md)

Claims commit with `synchronous_commit=off`: acknowledged before their WAL reaches the kernel. A crash of the
server (every postgres process SIGKILLed: the WAL buffers in shared memory are gone) forgets the claims whose
WAL the WAL writer had not written yet. This script, on a throwaway cluster (tests/pg_cluster.py):

- claims new keys in a tight loop through `RunStore.claim` (the production path), noting when each was acked;
- SIGKILLs the whole server at a random moment, restarts it (crash recovery), and looks each acked key up;
- reports, per round, how many acked claims were lost and how long before the kill the oldest lost one was
  acknowledged: the window. PostgreSQL's bound is 3 x wal_writer_delay (200 ms by default).

    python bench/async_claim_window.py [--rounds 10] [--seed 7]
"""

from __future__ import annotations

import argparse
import os
import random
import signal
import statistics
import sys
import threading
import time
from contextlib import suppress
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from sqlalchemy import text

from oncelery.runs.claims import RunStore
from oncelery.runs.keys import Identity
from oncelery.store.database import dispose_engines, get_engine
from oncelery.store.schema import upgrade_schema
from tests.pg_cluster import PgCluster, _alive, _children, postgres_bindir, postgres_runnable

TASK = "oncelery.bench_window"
# An idle server: how long after its ack a lone claim can still be lost (PostgreSQL's bound: 3 x 200 ms).
QUIET_DELAYS = (0.0, 0.05, 0.1, 0.2, 0.3, 0.4, 0.5, 0.7, 1.0)


def claim_until(store: RunStore, prefix: str, stop: threading.Event, acked: list[tuple[str, float]]) -> None:
    """Claim keys `prefix:n` one after another until `stop`, noting each acknowledged claim's time."""
    n = 0
    while not stop.is_set():
        key = f"{prefix}:{n}"
        try:
            store.claim(TASK, Identity(key, "f", {}), lease=60)
        except Exception:  # the server died under this claim: not acknowledged
            return
        acked.append((key, time.monotonic()))
        n += 1


def crash(cluster: PgCluster) -> None:
    """SIGKILL the postmaster first (so it cannot restart its children in place), then every child."""
    pid = cluster.pid()
    if pid is None:
        return
    children = _children(pid)
    for victim in (pid, *children):
        with suppress(ProcessLookupError):
            os.kill(victim, signal.SIGKILL)
    deadline = time.monotonic() + 10
    while any(_alive(p) for p in (pid, *children)) and time.monotonic() < deadline:
        time.sleep(0.02)


def restart(cluster: PgCluster) -> None:
    """Start the crashed server (crash recovery); again while its old postmaster's PID is still being reaped."""
    for attempt in range(20):
        try:
            cluster.start()
            return
        except Exception:
            if attempt == 19:
                raise
            time.sleep(0.25)


def one_round(cluster: PgCluster, url: str, rng: random.Random, r: int) -> tuple[int, int, float]:
    """Claim for a random 0.3-1.3 s, crash the server, restart it; return (acked, lost, window seconds)."""
    store, stop, acked = RunStore(url), threading.Event(), []  # type: ignore[var-annotated]
    claimer = threading.Thread(target=claim_until, args=(store, f"r{r}", stop, acked), daemon=True)
    claimer.start()
    time.sleep(0.3 + rng.random())  # the crash lands at a random moment of the stream
    killed_at = time.monotonic()
    crash(cluster)
    stop.set()
    claimer.join(timeout=30)
    dispose_engines()
    restart(cluster)
    with get_engine(url).connect() as conn:
        kept = {
            k for (k,) in conn.execute(text("SELECT idempotency_key FROM task_runs WHERE task_name = :t"), {"t": TASK})
        }
    lost = [(k, t) for k, t in acked if k not in kept]
    window = killed_at - min(t for _, t in lost) if lost else 0.0
    dispose_engines()
    return len(acked), len(lost), window


def quiet_round(cluster: PgCluster, url: str, delay: float, r: int) -> bool:
    """One claim on an idle server, a crash `delay` seconds after its ack; return whether the claim was lost."""
    store = RunStore(url)
    key = f"quiet{r}"
    store.claim(TASK, Identity(key, "f", {}), lease=60)
    time.sleep(delay)  # the measured quantity: how long after its ack an idle server still loses it
    crash(cluster)
    dispose_engines()
    restart(cluster)
    with get_engine(url).connect() as conn:
        found = conn.execute(text("SELECT 1 FROM task_runs WHERE idempotency_key = :k"), {"k": key}).first()
    dispose_engines()
    return found is None


def main() -> None:
    """Run the rounds and print each, then the widest window seen."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=10)
    parser.add_argument("--seed", type=int, default=7)
    opts = parser.parse_args()
    bindir = postgres_bindir()
    if bindir is None or not postgres_runnable():
        raise SystemExit("needs the PostgreSQL server binaries (initdb, pg_ctl) and a `postgres` user")
    cluster = PgCluster(bindir)
    try:
        cluster.start()
        url = cluster.url
        upgrade_schema(url)
        rng = random.Random(opts.seed)
        windows = []
        for r in range(opts.rounds):
            acked, lost, window = one_round(cluster, url, rng, r)
            windows.append(window)
            print(f"round {r}: acked={acked} lost={lost} window={window * 1000:.0f} ms", flush=True)
        lost_after = [d for r, d in enumerate(QUIET_DELAYS) if quiet_round(cluster, url, d, r)]
        print(
            f"idle server, one claim, crash after {[int(d * 1000) for d in QUIET_DELAYS]} ms: lost after "
            f"{[int(d * 1000) for d in lost_after]} ms"
        )
        wal_writer_delay = cluster.execute("SHOW wal_writer_delay")[0][0]
        print(
            f"wal_writer_delay={wal_writer_delay}; window max={max(windows) * 1000:.0f} ms "
            f"median={statistics.median(windows) * 1000:.0f} ms over {opts.rounds} crashes"
        )
    finally:
        dispose_engines()
        cluster.remove()


if __name__ == "__main__":
    main()
