"""How long does a kill-and-resume test of a user's task take under the test kit? (docs/benchmarks.md)

The user's app is tests/user_app/labels.py, configured as the README shows: its own claims database, Redis with
a visibility timeout of 3600 s, Oncelery's default 60 s lease. Before the kit's fixes such a test waited out
both (the visibility timeout plus the lease: minutes). Each round, with the kit's own helpers:

- starts a kit worker subprocess (`WorkerProcess`: the test database, the kit's Redis options merged in),
  sends a job whose body holds after its first step, and SIGKILLs the worker there (`kill_holder`);
- starts a second worker and waits for the job's result: RESUMED, its effect written once.

Two ways of recovering are timed: `kill_holder`'s default (the dead holder's message restored and its lease
expired at once), and `--wait-timeouts` (the kit's 10 s visibility timeout waited out, the lease expired by
hand: what a test that kills with `worker.kill()` gets). The figure is from the job's send to its result.

    python bench/kit_kill_and_resume.py [--rounds 3] [--json FILE]
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import sys
import tempfile
import time
import uuid
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
os.chdir(Path(__file__).resolve().parents[1])  # the worker imports tests.user_app.labels from here

REDIS = os.environ.get("ONCELERY_TEST_REDIS_URL", "redis://127.0.0.1:6379/11")
WORK = Path(tempfile.mkdtemp(prefix="oncelery-bench-kit-"))
os.environ["LABELS_BROKER_URL"] = REDIS
os.environ["LABELS_QUEUE"] = f"labels-bench-{uuid.uuid4().hex[:8]}"
os.environ["LABELS_DATABASE_URL"] = f"sqlite:///{WORK}/dev.db"  # the developer's own: must stay untouched
os.environ["LABELS_HOLD_DIR"] = str(WORK)

from sqlalchemy import create_engine  # noqa: E402

from oncelery import Outcome, outcome_of  # noqa: E402
from oncelery.store.schema import upgrade_schema  # noqa: E402
from oncelery.testing import OnceleryDb, expire_lease, flush_broker, kill_holder  # noqa: E402
from oncelery.testing.worker import WorkerProcess  # noqa: E402
from tests.user_app import labels  # noqa: E402

APP_PATH = "tests.user_app.labels:app"
GOAL_S = 30.0  # issue 23: a kill-and-resume test of a user's task in well under a minute


def fresh_db(name: str) -> OnceleryDb:
    url = f"sqlite:///{WORK / name}.db"
    upgrade_schema(url)
    engine = create_engine(url)
    labels.metadata.create_all(engine)
    engine.dispose()
    return OnceleryDb(url)


def one_round(n: int, wait_timeouts: bool) -> dict[str, float]:
    """One kill-and-resume; returns the seconds from the send to the result, and the workers' start times."""
    db = fresh_db(f"round-{n}-{int(wait_timeouts)}")
    doc = f"doc-{n}"
    hold = WORK / doc
    hold.touch()
    env = {"ONCELERY_TEST_LOG_DIR": str(WORK)}
    started = time.monotonic()
    first = WorkerProcess(APP_PATH, db, f"bench-first-{n}@%h", 1, env)
    boot = time.monotonic() - started
    workers = [first]
    try:
        sent = time.monotonic()
        result = labels.label.delay(doc)
        kill_holder(first, db, labels.label, f"label:{doc}", after_steps=1, wait_timeouts=wait_timeouts)
        if wait_timeouts:
            expire_lease(db, labels.label, f"label:{doc}")  # only the visibility timeout is waited out here
        hold.unlink()
        workers.append(WorkerProcess(APP_PATH, db, f"bench-second-{n}@%h", 1, env))
        value = result.get(timeout=600)
        total = time.monotonic() - sent
        if value != "short" or outcome_of(result) is not Outcome.RESUMED:
            raise SystemExit(f"round {n}: {value!r} {outcome_of(result)}")
        effects = db.count("SELECT count(*) FROM doc_labels WHERE doc = :d", d=doc)
        if effects != 1:
            raise SystemExit(f"round {n}: {effects} effects")
        return {"send_to_result_s": total, "worker_boot_s": boot}
    finally:
        for worker in workers:
            worker.stop()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--json", type=Path, default=None)
    args = parser.parse_args()
    dev = fresh_db("dev")
    results: dict[str, list[dict[str, float]]] = {"kill_holder": [], "wait_timeouts": []}
    try:
        for n in range(args.rounds):
            results["kill_holder"].append(one_round(n, wait_timeouts=False))
            results["wait_timeouts"].append(one_round(n, wait_timeouts=True))
        if dev.count("SELECT count(*) FROM task_runs"):
            raise SystemExit("a kit worker wrote to the app's own database")
    finally:
        flush_broker(labels.app)
        shutil.rmtree(WORK, ignore_errors=True)
    print("| recovery | rounds | send to result, median (min-max) | worker boot, median | goal |")
    print("| --- | --- | --- | --- | --- |")
    for name, rows in results.items():
        totals = [r["send_to_result_s"] for r in rows]
        boots = [r["worker_boot_s"] for r in rows]
        print(
            f"| {name} | {len(rows)} | {statistics.median(totals):.1f} s ({min(totals):.1f}-{max(totals):.1f}) "
            f"| {statistics.median(boots):.1f} s | < {GOAL_S:.0f} s |"
        )
    if args.json:
        args.json.write_text(json.dumps(results, indent=2))


if __name__ == "__main__":
    main()
