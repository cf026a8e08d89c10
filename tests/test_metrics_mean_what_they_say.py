"""Metrics that mean what they say: a wait counted once, the duplicate ratio over first deliveries, histograms
equal to the rows they count, series present before any run, a capped tenant label, a letters counter no purge
lowers, and alert expressions that page for what they say (promtool)."""

from __future__ import annotations

import shutil
import subprocess
import threading
from bisect import bisect_left
from collections.abc import Iterator
from datetime import datetime, timedelta
from pathlib import Path
from typing import Any

import pytest
from celery import Celery
from celery.signals import task_prerun
from sqlalchemy import insert, select, text

from oncelery import IdempotentTask, model_call
from oncelery.models import Outcome
from oncelery.models.migrate import downgrade, head_revision
from oncelery.models.totals import HISTOGRAMS
from oncelery.runs.outcomes import record_outcome
from oncelery.store.database import Database, get_engine
from oncelery.store.schema import upgrade_schema
from oncelery.store.tables import CALLS, LETTERS, RUNS, STEPS
from oncelery.testing import wait_until
from tests import services
from tests.test_metrics import Samples, migrated_database, samples, scrape

ROOT = Path(__file__).resolve().parent.parent
TASK = "oncelery.t_waits_once"
OLD_TASK = "oncelery.t_before_0012"  # rows written before the upgrade


@pytest.fixture(params=["sqlite", "postgresql"])
def metrics_url(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[str]:
    """A migrated claims database of this test alone (SQLite file or a new PostgreSQL database)."""
    yield from migrated_database(request.param, tmp_path)


def _buckets(got: Samples, metric: str, **labels: str) -> list[float]:
    """The cumulative bucket counts of one histogram series, in bound order (+Inf last)."""
    family = HISTOGRAMS[metric]
    name = {
        "run_duration": "oncelery_run_duration_seconds",
        "step_duration": "oncelery_step_duration_seconds",
        "llm_call_duration": "oncelery_llm_call_duration_seconds",
        "in_progress_wait": "oncelery_in_progress_wait_seconds",
    }[metric]
    les = [repr(float(b)) for b in family] + ["+Inf"]
    return [got.get((f"{name}_bucket", tuple(sorted({**labels, "le": le}.items()))), 0.0) for le in les]


def _expected(metric: str, values: list[float]) -> list[float]:
    """Cumulative bucket counts of `values` with the bounds models.totals declares (le: value <= bound)."""
    bounds = HISTOGRAMS[metric]
    per = [0] * (len(bounds) + 1)
    for value in values:
        per[bisect_left(bounds, max(0.0, value))] += 1
    return [float(sum(per[: i + 1])) for i in range(len(per))]


def _s(seconds: float) -> timedelta:
    return timedelta(seconds=seconds)


def _seconds(later: datetime, earlier: datetime) -> float:
    if (later.tzinfo is None) != (earlier.tzinfo is None):
        later, earlier = later.replace(tzinfo=None), earlier.replace(tzinfo=None)
    return (later - earlier).total_seconds()


def test_a_waiting_duplicate_counts_one_wait_and_the_histograms_equal_the_rows(
    app: Celery, worker_factory: Any, db_url: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A duplicate re-checks a held key at least 4 times: in_progress is 1, its wait is one observation (ended
    replayed), the duplicate ratio over first deliveries is 1/3 (2 keys, 1 duplicate), and the run, step and
    model-call histograms equal what task_runs, step_results and model_calls hold (real worker, both stores)."""
    monkeypatch.setattr("oncelery.basetask.idempotent.wait_backoff", lambda waits: 0.02)  # re-checks come quickly
    release, started = threading.Event(), threading.Event()
    deliveries: dict[str, int] = {}

    def double(n: int) -> int:
        with model_call("gpt-x", prompt="double") as call:  # a real ledger row, written by the worker
            call.usage((10, 2))
        return n * 2

    @app.task(shared=False, base=IdempotentTask, bind=True, name=TASK, idempotency_key="k:{n}", lease=30)
    def held(self: IdempotentTask, n: int) -> int:
        value = int(self.step("double", double, n))
        started.set()
        if not release.wait(30):
            raise TimeoutError("never released")
        return value

    def seen(task_id: str | None = None, task: Any = None, **_: Any) -> None:
        if getattr(task, "name", None) == TASK and task_id is not None:
            deliveries[task_id] = deliveries.get(task_id, 0) + 1

    task_prerun.connect(seen, weak=False)
    try:
        with worker_factory(app, concurrency=3):
            first = held.delay(1)
            assert started.wait(30)
            second = held.delay(1)
            wait_until(lambda: deliveries.get(second.id, 0) >= 5, 30, what="the duplicate to re-check 4 times")
            release.set()
            assert first.get(timeout=30) == 2 and second.get(timeout=30) == 2
            assert held.delay(2).get(timeout=30) == 4  # a second run: the histograms hold two runs
    finally:
        task_prerun.disconnect(seen)

    counts = held.outcome_counts()
    assert counts == {"executed": 2, "in_progress": 1, "replayed": 1}, counts
    got = scrape(db_url)
    labels = {"name": TASK, "tenant": ""}
    assert got["oncelery_deliveries_total", (("name", TASK), ("outcome", "in_progress"), ("tenant", ""))] == 1
    # First deliveries: 2 of key 1 (one a duplicate) and 1 of key 2; the wait's ending replay is not one.
    assert got["oncelery_duplicate_ratio", (("name", TASK),)] == pytest.approx(1 / 3)
    waited = _buckets(got, "in_progress_wait", **labels, ended="replayed")
    assert waited[-1] == 1 and got["oncelery_in_progress_wait_seconds_sum", _key(labels, ended="replayed")] > 0

    with Database(db_url).read() as conn:
        runs = conn.execute(select(RUNS.c.created_at, RUNS.c.finished_at).where(RUNS.c.task_name == TASK))
        durations = [_seconds(done, begun) for begun, done in runs]
        steps = list(conn.execute(select(STEPS.c.seconds)).scalars())
        calls = [ms / 1000 for ms in conn.execute(select(CALLS.c.latency_ms)).scalars()]
    assert len(durations) == 2 and len(steps) == 2 and all(s is not None and s >= 0 for s in steps)
    assert len(calls) == 2
    assert _buckets(got, "llm_call_duration", **labels, model="gpt-x") == _expected("llm_call_duration", calls)
    assert _buckets(got, "run_duration", **labels) == _expected("run_duration", durations)
    assert got["oncelery_run_duration_seconds_sum", _key(labels)] == pytest.approx(sum(durations), abs=0.01)
    assert _buckets(got, "step_duration", **labels) == _expected("step_duration", steps)


def _key(labels: dict[str, str], **more: str) -> tuple[tuple[str, str], ...]:
    return tuple(sorted({**labels, **more}.items()))


def test_an_upgraded_database_series_before_any_run_tenant_cap_call_latency_and_letters_created(
    metrics_url: str,
) -> None:
    """Upgraded from 0011 with rows: histograms and letters backfilled. Before a known task's first run: each of
    its outcomes at 0, and oncelery_build_info; then 4 tenants capped to 2 (the most active) plus "other", the
    model-call histogram equal to the ledger rows, and a letters counter that no purge lowers (both stores)."""
    _the_upgrade_to_0012_counts_what_is_already_there(metrics_url)  # one database for all: cheaper
    empty = samples(_exposition(metrics_url, tasks=["oncelery.known"]))
    for outcome in Outcome:
        assert (
            empty["oncelery_deliveries_total", (("name", "oncelery.known"), ("outcome", outcome.value), ("tenant", ""))]
            == 0
        )
    assert empty["oncelery_runs_completed_total", (("name", "oncelery.known"), ("tenant", ""))] == 0
    info = [labels for (name, labels), value in empty.items() if name == "oncelery_build_info" and value == 1]
    assert len(info) == 1 and dict(info[0])["schema_revision"] == head_revision() and dict(info[0])["version"]

    db = Database(metrics_url)
    for tenant, n in (("acme", 5), ("globex", 3), ("initech", 2), ("umbrella", 1)):
        for _ in range(n):
            record_outcome(db, TASK, Outcome.EXECUTED, tenant)
    latencies = {"acme": [40.0, 300.0, 2500.0], "initech": [90_000.0], "umbrella": [700.0]}
    with db.begin() as conn:
        for tenant, values in latencies.items():
            for ms in values:
                conn.execute(
                    text(
                        "INSERT INTO model_calls (task_name, tenant, model, input_tokens, output_tokens, latency_ms, "
                        "ok) VALUES (:t, :tenant, 'gpt-x', 1, 1, :ms, true)"
                    ),
                    {"t": TASK, "tenant": tenant, "ms": ms},
                )
    got = samples(_exposition(metrics_url, max_tenants=2))
    executed = {
        dict(labels)["tenant"]: value
        for (name, labels), value in got.items()
        if name == "oncelery_deliveries_total" and dict(labels)["outcome"] == "executed"
    }
    assert executed == {"acme": 5, "globex": 3, "other": 3}
    calls = {"acme": [ms / 1000 for ms in latencies["acme"]], "other": [90.0, 0.7]}
    for tenant, seconds in calls.items():
        labels = {"name": TASK, "tenant": tenant, "model": "gpt-x"}
        assert _buckets(got, "llm_call_duration", **labels) == _expected("llm_call_duration", seconds)
    other = (("model", "gpt-x"), ("name", TASK), ("tenant", "other"))
    assert got["oncelery_llm_call_duration_seconds_sum", other] == pytest.approx(90.7)
    _letters_created_is_a_counter_no_purge_lowers(metrics_url)  # the same database: one fewer to create


def _letters_created_is_a_counter_no_purge_lowers(metrics_url: str) -> None:
    """3 letters, then purged (DELETE; on PostgreSQL also a TRUNCATE): oncelery_dead_letters falls to 0, while
    oncelery_dead_letters_created_total stays 3 and counts the next one."""
    db = Database(metrics_url)

    def created() -> float:
        return scrape(metrics_url).get(("oncelery_dead_letters_created_total", (("name", TASK), ("reason", "dead"))), 0)

    def kept() -> float:
        return scrape(metrics_url).get(("oncelery_dead_letters", (("name", TASK), ("reason", "dead"))), 0)

    with db.begin() as conn:
        for _ in range(3):
            conn.execute(insert(LETTERS).values(task_name=TASK, reason="dead", attempts=1))
    assert created() == kept() == 3
    with db.begin() as conn:
        conn.execute(text("DELETE FROM dead_letters"))  # what `oncelery dlq purge` and retention do
    assert kept() == 0 and created() == 3
    if metrics_url.startswith("postgresql"):
        with db.begin() as conn:
            conn.execute(text("TRUNCATE dead_letters"))
        assert created() == 3
    with db.begin() as conn:
        conn.execute(insert(LETTERS).values(task_name=TASK, reason="dead", attempts=1))
    assert kept() == 1 and created() == 4


def _exposition(url: str, tasks: list[str] | None = None, max_tenants: int = 20) -> str:
    from prometheus_client import generate_latest

    from oncelery.ops.metrics import claims_registry

    return generate_latest(claims_registry(url, tasks or [], max_tenants)).decode()


def test_alert_rules_page_for_what_they_say(tmp_path: Path) -> None:
    """promtool: alerts.yml is valid, and its unit tests pass (a conflict letter never pages, a purge neither,
    a new retries_exhausted letter does; the duplicate ratio is over first deliveries)."""
    promtool = shutil.which("promtool")
    services.need("promtool", promtool is not None, "install Debian's prometheus package (.ci/run does)")
    assert promtool is not None
    folder = ROOT / "deploy" / "prometheus"
    for argv in (["check", "rules", "alerts.yml"], ["test", "rules", "alerts_test.yml"]):
        done = subprocess.run([promtool, *argv], cwd=folder, capture_output=True, text=True, timeout=60, check=False)
        assert done.returncode == 0, done.stdout + done.stderr
    # Without the conflict filter the same unit test fails: the filter is what keeps a conflict from paging.
    rules = (folder / "alerts.yml").read_text()
    unfiltered = rules.replace(
        'oncelery_dead_letters_created_total{reason!="conflict"}', "oncelery_dead_letters_created_total"
    )
    assert unfiltered != rules
    (tmp_path / "alerts.yml").write_text(unfiltered)
    shutil.copy(folder / "alerts_test.yml", tmp_path / "alerts_test.yml")
    done = subprocess.run(
        [promtool, "test", "rules", "alerts_test.yml"],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert done.returncode != 0 and "OnceleryDeadLettersIncreasing" in done.stdout + done.stderr


def _the_upgrade_to_0012_counts_what_is_already_there(metrics_url: str) -> None:
    """A database at 0011 with completed runs, model calls and letters: after `db upgrade` the run and latency
    histograms equal the rows, letters created equals the letters kept, and the next completion is counted."""
    engine = get_engine(metrics_url)
    downgrade(engine, "0011")
    with engine.begin() as conn:
        for key, seconds in (("a", 0.2), ("b", 7.0), ("c", 4000.0)):
            conn.execute(
                text(
                    "INSERT INTO task_runs (task_name, tenant, idempotency_key, fingerprint, field_digests, status, "
                    "fencing_token, attempts, created_at, finished_at) VALUES (:t, '', :k, 'f', '{}', 'COMPLETED', "
                    "1, 1, :begun, :done)"
                ),
                {"t": OLD_TASK, "k": key, "begun": datetime(2026, 1, 1), "done": datetime(2026, 1, 1) + _s(seconds)},
            )
        conn.execute(
            text(
                "INSERT INTO model_calls (task_name, tenant, model, input_tokens, output_tokens, latency_ms, ok) "
                "VALUES (:t, '', 'gpt-x', 1, 1, 1500, true)"
            ),
            {"t": OLD_TASK},
        )
        conn.execute(insert(LETTERS).values(task_name=OLD_TASK, reason="dead", attempts=1))
    upgrade_schema(metrics_url)
    got = scrape(metrics_url)
    labels = {"name": OLD_TASK, "tenant": ""}
    assert _buckets(got, "run_duration", **labels) == _expected("run_duration", [0.2, 7.0, 4000.0])
    assert _buckets(got, "llm_call_duration", **labels, model="gpt-x") == _expected("llm_call_duration", [1.5])
    assert got["oncelery_dead_letters_created_total", (("name", OLD_TASK), ("reason", "dead"))] == 1
    with engine.begin() as conn:  # the trigger counts the next completion
        conn.execute(
            text(
                "INSERT INTO task_runs (task_name, tenant, idempotency_key, fingerprint, field_digests, status, "
                "fencing_token, attempts) VALUES (:t, '', 'd', 'f', '{}', 'RUNNING', 1, 1)"
            ),
            {"t": OLD_TASK},
        )
        conn.execute(
            text("UPDATE task_runs SET status = 'COMPLETED', finished_at = created_at WHERE idempotency_key = 'd'")
        )
    assert _buckets(scrape(metrics_url), "run_duration", **labels)[-1] == 4
