"""How long until a job whose worker was killed with `kill -9` on Redis is done? (README, docs/benchmarks.md)

The issue-37 figure: a synchronous model-call job, its worker SIGKILLed whole right after the provider answered;
Oncelery's defaults (60 s lease, no `store_message`); the workers' visibility timeout at an hour, so that only the
relay's sweeper (oncelery.relay.unacked) can bring the job back sooner. Before it, the job waited out the
visibility timeout (the worker derives `max_lease + lease` when the app sets none; 398 s in the issue's trial).

Each round: `celery worker` subprocesses on Redis (tests/apps/crash_app.py) and SQLite, the fake provider as a
thread, the relay's loop in a thread (`relay_running`, its sweeper on); the job stops itself once answered, the
whole worker is SIGKILLed, a second worker is started, and the time from the kill to the job's result is taken.

    python bench/redis_kill_recovery.py [--rounds 3] [--lease 60]
"""

from __future__ import annotations

import argparse
import os
import signal
import statistics
import sys
import tempfile
import time
import uuid
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
os.chdir(Path(__file__).resolve().parents[1])  # the workers import tests.apps.crash_app from here

from oncelery.fake_provider import FakeProvider, Knobs  # noqa: E402
from oncelery.testing import relay_running  # noqa: E402
from tests.conftest import migrated  # noqa: E402
from tests.services import proc_state, wait_for  # noqa: E402
from tests.test_a_killed_workers_job_is_back_within_its_lease import TASK, TEXT, relay_app  # noqa: E402
from tests.test_crash import cluster  # noqa: E402

REDIS = os.environ.get("ONCELERY_TEST_REDIS_URL", "redis://127.0.0.1:6379/11")
HOUR = 3600


def one_round(work: Path, n: int, lease: float, fake: FakeProvider) -> float:
    """One kill; returns the seconds from the SIGKILL to the job's result."""
    url = f"sqlite:///{work / f'round-{n}.db'}"
    migrated(url)  # the schema, and the crash app's executions and effects tables
    key = f"bench-{uuid.uuid4().hex[:8]}"
    folder = work / f"round-{n}"
    folder.mkdir()
    with cluster(folder, url, REDIS, lease=lease, visibility_timeout=HOUR) as c:
        marks = folder / "marks"
        marks.mkdir()
        c.env.update(ONCELERY_FAKE_PROVIDER_URL=fake.url, ONCELERY_CRASH_MARKS=str(marks))
        holder = c.start("holder")
        c.wait_ready(holder)
        result = c.sender.send_task(TASK, args=[key, TEXT], kwargs={"at": "llm_created", "sig": "SIGSTOP"})
        child = c.wait_executing(key)
        wait_for(lambda: proc_state(child) == "T", timeout=60, what="the holder to stop once answered")
        os.killpg(holder.pid, signal.SIGKILL)
        killed = time.monotonic()
        holder.proc.wait(timeout=30)
        c.wait_ready(c.start("survivor"))
        with relay_running(relay_app(c), url, interval=0.5, sweep_interval=60.0):  # the CLI defaults
            result.get(timeout=HOUR)
        seconds = time.monotonic() - killed
        if c.effects(key) != 1:
            raise SystemExit(f"round {n}: {c.effects(key)} effects")
        return seconds


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--lease", type=float, default=60.0, help="the task's lease (Oncelery's default: 60)")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(prefix="oncelery-bench-kill-") as work, FakeProvider(Knobs()) as fake:
        times = [one_round(Path(work), n, args.lease, fake) for n in range(args.rounds)]
    print("| lease | visibility timeout | rounds | kill to result, median (min-max) | goal |")
    print("| --- | --- | --- | --- | --- |")
    print(
        f"| {args.lease:.0f} s | {HOUR} s | {len(times)} | {statistics.median(times):.1f} s "
        f"({min(times):.1f}-{max(times):.1f}) | within the lease (<= {args.lease:.0f} s + a relay round) |"
    )


if __name__ == "__main__":
    main()
