"""Under SIGKILL, OpenTelemetry's token totals stay at or below the ledger's, by at most what the killed process
recorded after its last export.

A `celery worker` (prefork, 2 children) on the fake provider, each child exporting its metrics every second to a
file (tests/apps/otel_export.py). Each job makes two model calls and its child is SIGKILLed in the second call (at
its poll, or in its create window); the next holder replays the first call and makes (or re-attaches to) the
second. The killed child had committed the first call's ledger row and recorded its points, which are lost unless
an export ran in between: so totals <= ledger, and ledger - totals <= the tokens of the calls the killed children
committed (the loss bound: the calls completed in a killed process's last export interval).
"""

from __future__ import annotations

import json
import time
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from sqlalchemy import select

from oncelery.fake_provider import FakeProvider, Knobs
from oncelery.store.tables import CALLS
from tests.test_crash import JOB_TIMEOUT, Cluster, cluster

pytestmark = pytest.mark.crash

TASK = "oncelery.crash_llm_twice"
TEXT = "The ferry timetable changes on Monday, when the winter service begins."
INTERVAL_S = 1.0


@pytest.fixture
def fake() -> Iterator[FakeProvider]:
    """The provider the workers call; its calls take 0.2 s."""
    with FakeProvider(Knobs(generation_s=0.2, poll_after_ms=50)) as provider:
        yield provider


def exported(folder: Path) -> dict[str, int]:
    """gen_ai.client.token.usage by token type: each process's last complete export (cumulative), summed."""
    totals: dict[str, int] = {"input": 0, "output": 0}
    for path in folder.glob("metrics-*.jsonl"):
        last = None
        for line in path.read_text().splitlines():
            try:
                last = json.loads(line)
            except ValueError:  # the line a SIGKILL cut short
                continue
        for resource in (last or {}).get("resource_metrics", []):
            for scope in resource["scope_metrics"]:
                for metric in scope["metrics"]:
                    if metric["name"] != "gen_ai.client.token.usage":
                        continue
                    for point in metric["data"]["data_points"]:
                        totals[point["attributes"]["gen_ai.token.type"]] += int(point["sum"])
    return totals


def rows_of(c: Cluster, keys: list[str]) -> list[dict[str, Any]]:
    with c.engine.connect() as conn:
        wanted = [f"llm2:{k}" for k in keys]
        return [dict(r._mapping) for r in conn.execute(select(CALLS).where(CALLS.c.idempotency_key.in_(wanted)))]


def tokens(rows: list[dict[str, Any]]) -> dict[str, int]:
    return {"input": sum(r["input_tokens"] for r in rows), "output": sum(r["output_tokens"] for r in rows)}


@pytest.mark.parametrize("db_url", ["sqlite"], indirect=True)
def test_a_killed_worker_loses_at_most_its_unexported_points(
    tmp_path: Path, db_url: str, redis_url: str, fake: FakeProvider
) -> None:
    folder = tmp_path / "otel"
    folder.mkdir()
    marks = tmp_path / "marks"
    marks.mkdir()
    with cluster(tmp_path, db_url, redis_url, lease=2) as c:
        c.env.update(
            ONCELERY_FAKE_PROVIDER_URL=fake.url, ONCELERY_CRASH_MARKS=str(marks), ONCELERY_CRASH_OTEL_DIR=str(folder),
            ONCELERY_CRASH_OTEL_INTERVAL_MS=str(int(INTERVAL_S * 1000)),
        )  # fmt: skip
        c.wait_ready(c.start("otel", concurrency=2))
        keys = {point: f"{point}-{uuid.uuid4().hex[:6]}" for point in ("llm_poll", "llm_created")}
        sent = [c.sender.send_task(TASK, args=[key, TEXT], kwargs={"at": point}) for point, key in keys.items()]
        for result in sent:
            result.get(timeout=JOB_TIMEOUT)
        for key in keys.values():
            assert c.executions(key) == 2, "killed once, finished by the next holder"
        time.sleep(INTERVAL_S * 2.5)  # every live process has exported what it recorded
        rows = rows_of(c, list(keys.values()))
    real = [r for r in rows if r["reason"] != "unknown_outcome"]
    assert len(real) == 4 and [r["reason"] for r in real].count("create_window") == 1
    ledger, otel = tokens(real), exported(folder)
    # What the killed children committed before the kill: each job's first call (its row precedes the kill).
    first_calls = [r for r in real if r["step"] == "summary"]
    bound = tokens(first_calls)
    for kind in ("input", "output"):
        assert otel[kind] <= ledger[kind], kind
        assert ledger[kind] - otel[kind] <= bound[kind], f"{kind}: lost more than the killed processes recorded"
    print(f"ledger {ledger}, exported {otel}, loss bound {bound}")
