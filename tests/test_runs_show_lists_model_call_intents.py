"""`oncelery runs show` lists each model call's intent as it is stored now: a background call still generating
(the run parked WAITING, no checkpoint, no ledger row) shows `sent` with its provider reference, and `done` once the
relay woke the run and it finished. A real worker, the real relay loop and the fake provider.
"""

from __future__ import annotations

import json
from typing import Any

from celery import Celery
from click.testing import CliRunner

from oncelery.cli import oncelery as oncelery_cli
from oncelery.fake_provider import FakeProvider, generate_text
from oncelery.llm.adapters.openai_responses import OpenAIResponses
from oncelery.testing import relay_running, wait_until
from tests.conftest import ON_SQLITE
from tests.test_llm_waiting import JOB, TEXT, fake, summarizer, waiting

__all__ = ["fake"]  # a fixture, used by name (`responses` is conftest's, on it)


def show(db_url: str, *options: str) -> Any:
    """`oncelery runs show doc:s` (text, or with --json its document)."""
    result = CliRunner().invoke(oncelery_cli, ["--database-url", db_url, "runs", "show", "doc:s", *options])
    assert result.exit_code == 0, result.output
    return json.loads(result.output) if "--json" in options else result.output


def intent_row(text: str) -> list[str]:
    """The first six cells of the one row under `model call intents`."""
    lines = text.split("model call intents (1):\n", 1)[1].splitlines()
    return lines[2].split()[:6]


@ON_SQLITE
def test_runs_show_lists_a_call_in_flight_as_sent_then_done(
    app: Celery, worker_factory: Any, db_url: str, fake: FakeProvider, responses: OpenAIResponses
) -> None:
    fake.set_knobs(generation_s=1.5)  # in flight for as long as the first look takes
    task = summarizer(app, responses)
    with worker_factory(app):
        pending = task.delay("s", TEXT)
        wait_until(lambda: waiting(db_url) == 1, timeout=JOB, what="the run parked")
        (run,) = show(db_url, "--json")["runs"]
        assert run["status"] == "WAITING" and run["steps"] == [] and run["model_calls"] == []
        (intent,) = run["intents"]
        assert (intent["step"], intent["attempt"], intent["state"]) == ("summary", 1, "sent"), intent
        assert intent["reference"] in fake.state.calls and intent["provider"] == "openai"
        assert (intent["repeat_reason"], intent["label"], intent["ended_at"]) == (None, None, None)
        text = show(db_url)
        assert "model call intents (1):" in text and intent["reference"] in text
        assert intent_row(text) == ["summary", "1", "sent", "openai", "gpt-test", intent["reference"]], text
        with relay_running(app, db_url):
            assert pending.get(timeout=JOB) == generate_text("gpt-test", TEXT)
    (run,) = show(db_url, "--json")["runs"]
    (done,) = run["intents"]
    assert done["state"] == "done" and done["reference"] == intent["reference"] and done["ended_at"]
    assert [c["step"] for c in run["model_calls"]] == ["summary"] and done["label"] is None
    assert intent_row(show(db_url)) == ["summary", "1", "done", "openai", "gpt-test", intent["reference"]]
