"""Flower's Runs section (`oncelery flower`), in a real headless Chromium against a real worker and PostgreSQL.

One Flower process started as deploy/bin/oncelery-flower starts it (`celery -A app oncelery flower`, basic auth from
FLOWER_BASIC_AUTH), jobs run by an in-process worker with `self.llm` calls on the fake provider, and one Chromium
that loads the pages, fills their forms and clicks their buttons. It proves: the list's filters (task, status incl.
WAITING, tenant, outcome; one through the form), a run page's steps and each model call's intent state, provider
reference and cost (the ledger's), a fork's dry-run preview (the ledger's tokens at the override's price; nothing
sent), a dead letter replayed from its page (Flower's auth and cross-site rule hold), and that a secret-looking
argument kept with a run or a letter is never on a page.
"""

from __future__ import annotations

import base64
import json
import os
import re
import subprocess
import sys
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from celery import Celery
from click.testing import CliRunner
from sqlalchemy import func, select

from oncelery import BatchPolicy, IdempotentTask, output_text
from oncelery.cli import EXIT_CONFIGURATION
from oncelery.cli import oncelery as oncelery_cli
from oncelery.fake_provider import FakeProvider, Knobs
from oncelery.llm.adapters.batch import OpenAIBatches
from oncelery.llm.adapters.openai_responses import OpenAIResponses
from oncelery.models import RunStatus
from oncelery.ops.fork import preview_fork
from oncelery.runs.views import Runs
from oncelery.store.database import get_engine
from oncelery.store.tables import CALLS, FORKS, INTENTS, LETTERS, RUNS
from oncelery.testing.waiting import poll
from tests.browser import Browser
from tests.conftest import ON_POSTGRESQL
from tests.services import port_open, wait_for
from tests.test_flower import free_port

JOB = 60.0
PRICES = {"gpt-a": {"input": 1.0, "output": 2.0}, "gpt-b": {"input": 5.0, "output": 15.0}}
SECRET = "sk-live-51HxQ9SECRETdoNotShow"
AUTH = ("ops", "runs-pw-7")
TEXT = "The council approved the new library budget on Tuesday after a long debate."
# Where to keep the screenshots (docs/img for the docs); unset: the test's own temporary folder. Not Path(""):
# that is ".", the working directory.
SHOTS = os.environ.get("ONCELERY_SCREENSHOTS") or ""
REPO = Path(__file__).parents[1]


@pytest.fixture
def flower_url(app: Celery, db_url: str, redis_url: str, tmp_path: Path) -> Iterator[str]:
    """`oncelery flower` for the test's database and queue, behind basic auth; its base URL."""
    port = free_port()
    env = {
        **os.environ, "ONCELERY_DATABASE_URL": db_url, "ONCELERY_BROKER_URL": redis_url,
        "ONCELERY_RESULT_BACKEND": redis_url, "ONCELERY_OUTBOX_QUEUE": app.conf.task_default_queue,
        "ONCELERY_TEST_PRICES": json.dumps(PRICES), "FLOWER_BASIC_AUTH": ":".join(AUTH),
    }  # fmt: skip
    cmd = [sys.executable, "-m", "celery", "-A", "tests.apps.flower_app:app", "oncelery", "flower", f"--port={port}",
           "--address=127.0.0.1"]  # fmt: skip
    log_path = tmp_path / "flower.log"
    with open(log_path, "wb") as log:
        flower = subprocess.Popen(cmd, env=env, cwd=REPO, stdout=log, stderr=subprocess.STDOUT)
        try:
            wait_for(lambda: flower.poll() is not None or port_open("127.0.0.1", port), JOB, what="Flower's port")
            assert flower.poll() is None, log_path.read_text()
            yield f"http://127.0.0.1:{port}"
        finally:
            flower.terminate()
            try:
                flower.wait(30)
            except subprocess.TimeoutExpired:
                flower.kill()
                flower.wait(30)


def shown_ids(dom: str) -> set[int]:
    """The run ids of the list's rows."""
    return {int(i) for i in re.findall(r'class="run-row" data-run-id="(\d+)"', dom)}


def shot(browser: Browser, tmp_path: Path, name: str) -> None:
    browser.screenshot((Path(SHOTS) if SHOTS else tmp_path) / name)


@ON_POSTGRESQL
def test_runs_list_run_page_fork_preview_and_replay_in_flower(
    app: Celery, worker_factory: Any, db_url: str, flower_url: str, tmp_path: Path
) -> None:
    app.conf.oncelery_prices = PRICES
    fixed = threading.Event()
    with (
        FakeProvider(Knobs(poll_after_ms=5, generation_s=0.01)) as fake,
        OpenAIResponses(fake.openai_base_url, "sk") as responses,
        OpenAIBatches(fake.openai_base_url, "sk") as batches,
    ):

        @app.task(shared=False, base=IdempotentTask, bind=True, name="oncelery.t_runs_article",
                  idempotency_key="doc:{doc}", tenant="{org}", keep_arguments=True)  # fmt: skip
        def article(self: IdempotentTask, org: str, doc: str, text: str, api_key: str) -> dict[str, str]:
            summary = output_text(self.llm("summarize", adapter=responses, model="gpt-a", input=text,
                                           max_output_tokens=40))  # fmt: skip
            quality = self.llm("quality", adapter=responses, model="gpt-a", input=summary, max_output_tokens=20)
            return {"summary": summary, "quality": output_text(quality)}

        @app.task(shared=False, base=IdempotentTask, bind=True, name="oncelery.t_runs_fragile",
                  idempotency_key="f:{n}", dead_on=(ValueError,))  # fmt: skip
        def fragile(self: IdempotentTask, n: int, token: str) -> int:
            if not fixed.is_set():
                raise ValueError("the upstream answered 500")
            return n

        @app.task(shared=False, base=IdempotentTask, bind=True, name="oncelery.t_runs_batch", idempotency_key="b:{n}",
                  llm_batch_adapter=batches)  # fmt: skip
        def parked(self: IdempotentTask, n: int) -> str:
            answer = self.llm("score", adapter=responses, model="gpt-a", input=f"Article {n}.", max_output_tokens=8,
                              mode="batch", batch=BatchPolicy(max_items=10, max_wait_s=600))  # fmt: skip
            return output_text(answer)

        reader = Runs(db_url)
        with worker_factory(app):
            article.delay("acme", "a1", TEXT, SECRET).get(timeout=JOB)
            article.delay("acme", "a1", TEXT, SECRET).get(timeout=JOB)  # a duplicate: replayed
            article.delay("globex", "a2", TEXT + " Again.", SECRET).get(timeout=JOB)
            fragile.delay(1, SECRET)
            parked.delay(1)
            dead = poll(lambda: _run(reader, "f:1", RunStatus.DEAD), JOB)
            waiting = poll(lambda: _run(reader, "b:1", RunStatus.WAITING), JOB)
            assert dead and waiting, reader.list()
            a1, a2 = reader.get(article.name, "doc:a1", "acme"), reader.get(article.name, "doc:a2", "globex")
            assert a1 and a2 and a1.replays == 1
            assert SECRET in json.dumps(a1.message)  # kept (keep_arguments): the pages must not show it

            basic = base64.b64encode(":".join(AUTH).encode()).decode()
            with Browser(tmp_path, headers={"Authorization": f"Basic {basic}"}) as browser:
                # The list, and each filter (task and status through the form, the others as links would send).
                listing = browser.open(f"{flower_url}/runs")
                assert shown_ids(listing) == {a1.run_id, a2.run_id, dead.run_id, waiting.run_id}, listing[-3000:]
                assert 'href="/runs"' in listing and ">Runs</a>" in listing  # the tab in Flower's navbar
                shot(browser, tmp_path, "flower-runs.png")
                browser.fill("#f-task", article.name)
                browser.fill("#f-status", "COMPLETED")
                assert shown_ids(browser.click("#run-filters button[type=submit]")) == {a1.run_id, a2.run_id}
                for query, expected in (
                    ("status=DEAD", {dead.run_id}),
                    ("status=WAITING", {waiting.run_id}),
                    ("tenant=acme", {a1.run_id}),
                    ("outcome=replayed", {a1.run_id}),
                    (f"outcome=executed&tenant=globex&task={article.name}", {a2.run_id}),
                ):
                    assert shown_ids(browser.open(f"{flower_url}/runs?{query}")) == expected, query

                # A run page: its steps, each model call's intent state, provider reference and cost (the ledger's).
                page = browser.open(f"{flower_url}/runs/{a1.run_id}")
                text = browser.text()
                assert SECRET not in page and "<kept for recovery until the run completes" in text
                assert "Dead letter" not in text and "Replay" not in text  # the letter is another run's
                steps = re.findall(r"\d+\tstep\t(\w+)\tcheckpointed", text)
                assert steps == ["summarize", "quality"], text
                with get_engine(db_url).connect() as conn:
                    intents = conn.execute(select(INTENTS.c.state, INTENTS.c.reference)
                                           .where(INTENTS.c.run_id == a1.run_id)).all()  # fmt: skip
                    costs = conn.execute(select(CALLS.c.cost_micros).where(CALLS.c.run_id == a1.run_id)).scalars()
                    costs = sorted(costs)
                assert len(intents) == 2 and all(state.value == "done" for state, _ in intents), intents
                calls = re.findall(r"model call\t(\w+) \(attempt 1\)\t(\w+)\t.*?cost ([\d.]+) USD", text)
                assert [(step, state) for step, state, _ in calls] == [("summarize", "done"), ("quality", "done")]
                assert sorted(f"{c / 1e6:.6f}" for c in costs) == sorted(cost for _, _, cost in calls), text
                assert all(ref in text for _, ref in intents if ref), text

                # A fork from step 2 as a dry run: the preview `oncelery fork --dry-run` gives, and nothing sent.
                browser.fill("#fork-from", "quality")
                browser.fill("#fork-set", "quality.model=gpt-b")
                preview = browser.click("#fork-preview")
                expected = preview_fork(app, article.name, "doc:a1", from_step="quality",
                                        overrides=["quality.model=gpt-b"], tenant="acme")  # fmt: skip
                assert expected.total_micros > 0
                assert f"Preview total: {expected.total_micros / 1e6:.6f} USD" in browser.text(), preview[-3000:]
                assert _count(db_url, FORKS) == 0 and _count(db_url, RUNS) == 4
                shot(browser, tmp_path, "flower-run.png")

                # A dead letter: redacted; Flower's own checks on the POST; replayed from its page's button.
                letter_page = browser.open(f"{flower_url}/runs/{dead.run_id}")
                assert SECRET not in letter_page and "<kept to replay it" in browser.text()
                shot(browser, tmp_path, "flower-run-letter.png")
                with get_engine(db_url).connect() as conn:
                    letter_id, kept = conn.execute(
                        select(LETTERS.c.id, LETTERS.c.message).where(LETTERS.c.run_id == dead.run_id)
                    ).one()
                assert SECRET in json.dumps(kept)  # kept to replay it: the page must not show it
                replay = f"{flower_url}/runs/{dead.run_id}/replay/{letter_id}"
                assert httpx.post(replay, timeout=10).status_code == 401
                cross_site = {"Origin": "http://evil.example", "Sec-Fetch-Site": "cross-site"}
                assert httpx.post(replay, auth=AUTH, headers=cross_site, timeout=10).status_code == 403
                fixed.set()
                browser.click(f"#replay-{letter_id}")
                assert f"Dead letter {letter_id} replayed" in browser.text()
                assert poll(lambda: _run(reader, "f:1", RunStatus.COMPLETED), JOB), reader.list()
                again = httpx.post(replay, auth=AUTH, timeout=10)  # the CLI's guard: not DEAD any more
                assert again.status_code == 409 and "not replayed" in again.text
                assert "COMPLETED" in browser.open(f"{flower_url}/runs/{dead.run_id}")


def _run(reader: Runs, key: str, status: RunStatus) -> Any:
    found = reader.find(key)
    return found[0] if found and found[0].status is status else None


def _count(db_url: str, table: Any) -> int:
    with get_engine(db_url).connect() as conn:
        return int(conn.execute(select(func.count()).select_from(table)).scalar_one())


def test_oncelery_flower_without_flower_is_one_line_naming_the_extra(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "flower", None)  # as if `pip install oncelery` had no [flower]
    monkeypatch.setitem(sys.modules, "flower.command", None)
    result = CliRunner().invoke(oncelery_cli, ["flower", "--port=5555"])
    assert result.exit_code == EXIT_CONFIGURATION, result.output
    assert "pip install 'oncelery[flower]'" in result.output and "Traceback" not in result.output
