"""Flower shows what Oncelery decided: a real worker with task events, Redis, and a real Flower 2.2 process.

Checked through Flower's own JSON (`/api/tasks`, what its pages render): an executed job, a replayed duplicate,
an in-progress wait (state IN_PROGRESS, no exception, no traceback) and a 3-step job while a step runs
(state PROGRESS, "step 2/3 ..."). Flower shows only Celery's standard fields, so the decision rides at the start
of the `kwargs` field, before the task's own kwargs, and the task list shows it in its kwargs column (Flower run
with deploy/bin/oncelery-flower's FLOWER_TASKS_COLUMNS). The name stays the task's: Flower's /metrics label by
task; `oncelery_flower_name_suffix = True` writes "[executed]" after the name again (docs/flower.md).
"""

from __future__ import annotations

import json
import os
import re
import shutil
import socket
import subprocess
import sys
import threading
import time
import urllib.parse
import urllib.request
import uuid
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
from celery import Celery
from celery.result import AsyncResult

from oncelery import BatchPolicy, IdempotentTask, output_text
from oncelery.fake_provider import FakeProvider, Knobs
from oncelery.llm.adapters.batch import OpenAIBatches
from oncelery.llm.adapters.openai_responses import OpenAIResponses
from oncelery.testing import in_process_worker
from tests.conftest import ON_SQLITE
from tests.services import wait_for

TIMEOUT = 60.0
# The task list's columns as deploy/bin/oncelery-flower sets them (kwargs shows the decision): read there, so the
# test sees what a deployment sees.
TASKS_COLUMNS = re.search(
    r"FLOWER_TASKS_COLUMNS:-([a-z_,]+)}", (Path(__file__).parents[1] / "deploy/bin/oncelery-flower").read_text()
)


def chromium(url: str, tmp_path: Path, shot: str | None = None) -> str:
    """Load `url` in headless Chromium (Debian's): return the DOM after the page's scripts ran; maybe screenshot it.

    Screenshots go to $ONCELERY_SCREENSHOTS (e.g. docs/img, to refresh the README's) or to tmp_path.
    """
    exe = shutil.which("chromium") or shutil.which("chromium-browser")
    if exe is None:
        if os.environ.get("CI"):
            pytest.fail("Debian's chromium is missing: .ci/run installs it (apt-get install chromium)")
        pytest.skip("headless Chromium is not installed (apt-get install chromium)")
    profile = tmp_path / f"chromium-{uuid.uuid4().hex[:6]}"
    flags = [
        "--headless",
        "--no-sandbox",
        "--disable-gpu",
        "--disable-quic",
        "--disable-background-networking",
        "--disable-component-update",
        "--disable-sync",
        "--no-first-run",
        f"--user-data-dir={profile}",
        "--virtual-time-budget=5000",
        "--window-size=1700,900",
    ]
    # One load does both: the screenshot shows the very DOM the test judges (and Chromium starts once, not twice).
    folder = Path(os.environ.get("ONCELERY_SCREENSHOTS") or tmp_path)
    screenshot = [] if shot is None else [f"--screenshot={folder / shot}"]
    dom = subprocess.run([exe, *flags, *screenshot, "--dump-dom", url], capture_output=True, timeout=120)
    if shot is not None:
        assert (folder / shot).exists(), dom.stderr.decode(errors="replace")[-2000:]
    return dom.stdout.decode(errors="replace")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def flower_tasks(port: int, search: str = "") -> dict[str, Any]:
    """Flower's /api/tasks (every task it knows, or those its `search` finds, by id), or {} while it is not up."""
    query = f"?search={urllib.parse.quote(search)}" if search else ""
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/api/tasks{query}", timeout=5) as resp:
            return dict(json.loads(resp.read()))
    except OSError:
        return {}


@ON_SQLITE
def test_flower_shows_outcomes_waits_and_steps(app: Celery, redis_url: str, tmp_path: Path) -> None:
    app.conf.update(worker_send_task_events=True, task_send_sent_event=True)
    gate, step_gate = threading.Event(), threading.Event()

    @app.task(shared=False, base=IdempotentTask, bind=True, name="oncelery.t_flower_job", idempotency_key="f:{n}")
    def job(self: IdempotentTask, n: int) -> int:
        if n == 3 and not gate.wait(TIMEOUT):
            raise TimeoutError("the test never released the holder")
        return n * 10

    @app.task(
        shared=False,
        base=IdempotentTask,
        bind=True,
        name="oncelery.t_flower_steps",
        total_steps=3,
        idempotency_key="s:{text}",
    )
    def steps(self: IdempotentTask, text: str) -> str:
        a = self.step("summarize", str.upper, text)
        b = self.step("keywords", lambda t: t if step_gate.wait(TIMEOUT) else "", a)
        return str(self.step("score", str.lower, b))

    @app.task(shared=False, name="oncelery.t_flower_ping")
    def ping() -> str:
        return "pong"

    # A batch step with no batcher running (no relay here): its run parks WAITING on the batch, and stays so.
    fake = FakeProvider(Knobs())
    fake.start()
    sync, batches = OpenAIResponses(fake.openai_base_url, "sk"), OpenAIBatches(fake.openai_base_url, "sk")
    policy = BatchPolicy(max_items=10, max_wait_s=600)

    @app.task(shared=False, base=IdempotentTask, bind=True, name="oncelery.t_flower_batch", idempotency_key="b:{n}",
              llm_batch_adapter=batches)  # fmt: skip
    def batched(self: IdempotentTask, n: int) -> str:
        answer = self.llm("score", adapter=sync, model="gpt-test", input=f"Article {n}.", max_output_tokens=8,
                          mode="batch", batch=policy)  # fmt: skip
        return output_text(answer)

    port = free_port()
    assert TASKS_COLUMNS is not None, "deploy/bin/oncelery-flower no longer sets FLOWER_TASKS_COLUMNS"
    env = {**os.environ, "FLOWER_UNAUTHENTICATED_API": "true", "FLOWER_TASKS_COLUMNS": TASKS_COLUMNS.group(1)}
    cmd = [sys.executable, "-m", "celery", f"--broker={redis_url}", "flower", f"--port={port}", "--address=127.0.0.1"]
    log = open(tmp_path / "flower.log", "wb")  # noqa: SIM115  (closed below, after the process)
    flower = subprocess.Popen(cmd, env=env, stdout=log, stderr=subprocess.STDOUT)
    try:
        wait_for(lambda: flower.poll() is not None or _up(port), TIMEOUT, what="Flower to answer")
        assert flower.poll() is None, (tmp_path / "flower.log").read_text()
        with in_process_worker(app, task_events=True):
            _until_flower_listens(port, ping.delay)
            executed = job.delay(1)
            assert executed.get(timeout=TIMEOUT) == 10
            replayed = job.delay(1)
            assert replayed.get(timeout=TIMEOUT) == 10
            holder = job.delay(3)
            wait_for(lambda: _kwargs(port, holder.id) is not None, TIMEOUT, what="the holder in Flower")
            waiter = job.delay(3)
            wait_for(
                lambda: _state(port, waiter.id) == "IN_PROGRESS", TIMEOUT, what="the waiter as IN_PROGRESS in Flower"
            )
            seen = flower_tasks(port)[waiter.id]
            assert not seen.get("exception") and not seen.get("traceback"), seen
            # The result column says it waits (kwargs may already show the re-sent copy's own, as received).
            assert "oncelery: in_progress key=f:3 token=1" in str(seen["result"]), seen
            page = chromium(f"http://127.0.0.1:{port}/task/{waiter.id}", tmp_path, "flower-wait.png")
            assert "IN_PROGRESS" in page and "oncelery: in_progress key=f:3" in page, page[-3000:]
            assert "Traceback" not in page
            gate.set()
            assert holder.get(timeout=TIMEOUT) == waiter.get(timeout=TIMEOUT) == 30
            running = steps.delay("ab")
            wait_for(lambda: _state(port, running.id) == "PROGRESS", TIMEOUT, what="the steps job as PROGRESS")
            wait_for(
                lambda: "step 2/3 keywords executing" in (_kwargs(port, running.id) or ""),
                TIMEOUT,
                what="step 2/3 in Flower",
            )
            page = chromium(f"http://127.0.0.1:{port}/task/{running.id}", tmp_path, "flower-progress.png")
            assert "PROGRESS" in page and "step 2/3 keywords executing" in page, page[-3000:]
            step_gate.set()
            assert running.get(timeout=TIMEOUT) == "ab"
            for result, outcome in ((executed, "executed"), (replayed, "replayed"), (running, "executed")):
                wait_for(
                    lambda r=result, o=outcome: (
                        _state(port, r.id) == "SUCCESS" and f"oncelery: {o} " in (_kwargs(port, r.id) or "")
                    ),
                    TIMEOUT,
                    what=f"{outcome} in Flower",
                )
            # The waiter, once its re-sent copy ran, says what that copy did: replayed the holder's result.
            wait_for(lambda: "oncelery: replayed key=f:3" in (_kwargs(port, waiter.id) or ""), TIMEOUT, what="w")
            assert "token=1" in (_kwargs(port, executed.id) or "")
            listing = _task_list(port, tmp_path, [executed.id, replayed.id, waiter.id, running.id])
            # In the task list, a replay and an execution differ in the kwargs column; the name is the task's.
            for result, outcome in ((executed, "executed"), (replayed, "replayed"), (waiter, "replayed")):
                row = _row(listing, result.id)
                assert ">oncelery.t_flower_job<" in row and f"oncelery: {outcome} key=f:" in row, row
            assert "oncelery: executed key=" in _row(listing, running.id), listing[-3000:]
            assert "[executed]" not in listing and "[replayed]" not in listing, listing[-3000:]
            replays = flower_tasks(port, 'kwargs:"oncelery: replayed"')  # Flower's search box finds them
            assert {replayed.id, waiter.id} <= set(replays) and executed.id not in replays, replays
            page = chromium(f"http://127.0.0.1:{port}/task/{replayed.id}", tmp_path, "flower-replayed.png")
            assert "SUCCESS" in page and "oncelery: replayed key=f:1 token=1" in page, page[-3000:]
            # Flower's own /metrics: one task label per task, whatever the outcomes and steps were.
            # (Other tests' workers may publish events on the same Redis: only this test's tasks are judged.)
            labels = {(task, kind) for task, kind in _metric_labels(port) if task.startswith("oncelery.t_flower_")}
            assert {task for task, _ in labels} <= {job.name, steps.name, ping.name}, labels
            for seen_pair in ((job.name, "task-executed"), (job.name, "task-replayed"), (steps.name, "task-progress")):
                assert seen_pair in labels, labels
            # A run parked on a batch: Flower's state and result column say what it waits for (no traceback).
            parked = batched.delay(1)
            wait_for(lambda: _state(port, parked.id) == "WAITING", TIMEOUT, what="the batch step as WAITING")
            seen = flower_tasks(port)[parked.id]
            assert "waiting on a batch at openai (item queued)" in str(seen["result"]), seen
            assert not seen.get("exception") and not seen.get("traceback"), seen
            # Opted in, the name carries the outcome again, and so does every monitor's task label (asked of
            # /metrics, which labels by the event's own name: the task's name may be overwritten later by a
            # task-sent event that reaches Flower after the worker's, when the producer is descheduled).
            app.conf.oncelery_flower_name_suffix = True
            suffixed = job.delay(5)
            assert suffixed.get(timeout=TIMEOUT) == 50
            wait_for(
                lambda: (f"{job.name} [executed]", "task-executed") in _metric_labels(port),
                TIMEOUT,
                what="the suffixed task label in Flower's /metrics",
            )
    finally:
        gate.set()
        step_gate.set()
        sync.close()
        batches.close()
        fake.stop()
        flower.terminate()
        try:
            flower.wait(30)
        except subprocess.TimeoutExpired:
            flower.kill()
            flower.wait(30)
        log.close()


def _until_flower_listens(port: int, send: Callable[[], AsyncResult]) -> None:
    """Wait until Flower's event receiver is subscribed: it answers HTTP before it listens, and misses what was
    published before. A plain task is sent (again each 2 s) until Flower shows one as SUCCESS."""
    sent: list[tuple[float, str]] = []

    def seen() -> bool:
        if not sent or time.monotonic() - sent[-1][0] > 2.0:
            sent.append((time.monotonic(), send().id))
        return any(_state(port, task_id) == "SUCCESS" for _, task_id in sent)

    wait_for(seen, TIMEOUT, what="Flower to receive task events")


def _up(port: int) -> bool:
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/api/tasks", timeout=5) as resp:
            return resp.status == 200
    except OSError:
        return False


def _state(port: int, task_id: str) -> str | None:
    task = flower_tasks(port).get(task_id)
    return None if task is None else task.get("state")


def _task_list(port: int, tmp_path: Path, task_ids: list[str]) -> str:
    """Flower's task list as Chromium rendered it (screenshot flower-tasks.png), once it has a row per task id.

    Its rows come from an AJAX call: on a loaded machine the page may be dumped before they arrive, so it is
    loaded again (bounded) rather than judged empty.
    """
    deadline = time.monotonic() + TIMEOUT
    while True:
        listing = chromium(f"http://127.0.0.1:{port}/tasks", tmp_path, "flower-tasks.png")
        if all(_row(listing, task_id) for task_id in task_ids) or time.monotonic() > deadline:
            return listing


def _row(listing: str, task_id: str) -> str:
    """The task list's table row (HTML) of `task_id`, or "" when the list does not show it."""
    return next((row for row in re.findall(r"<tr\b.*?</tr>", listing, re.S) if task_id in row), "")


def _metric_labels(port: int) -> set[tuple[str, str]]:
    """The (task, event type) label pairs of Flower's flower_events_total on its /metrics (none if it is slow)."""
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5) as resp:
            text = resp.read().decode()
    except OSError:
        return set()
    pairs = set()
    for line in text.splitlines():
        if line.startswith("flower_events_total{"):
            task, kind = re.search(r'task="([^"]*)"', line), re.search(r'type="([^"]*)"', line)
            if task and kind:
                pairs.add((task.group(1), kind.group(1)))
    return pairs


def _kwargs(port: int, task_id: str) -> str | None:
    task = flower_tasks(port).get(task_id)
    return None if task is None else str(task.get("kwargs"))
