"""The fake provider speaks OpenAI's and Anthropic's protocols faithfully: the official OpenAI SDK drives it
unchanged (background create, poll, stream resume, cancel, errors), Anthropic's wire format is checked request by
request, and its counters record exactly what a real provider would have created, served and billed.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from typing import Any

import httpx
import openai
import pytest

from oncelery.fake_provider import FakeProvider, FakeProviderControl, Knobs, count_tokens, generate_text

TIMEOUT = 10.0


@pytest.fixture
def fake() -> Iterator[FakeProvider]:
    """A fake provider in a thread of the test, stopped afterwards."""
    with FakeProvider(Knobs(poll_after_ms=20)) as provider:
        yield provider


def sdk(fake: FakeProvider, timeout: float = TIMEOUT) -> openai.OpenAI:
    """The official OpenAI client on the fake, with the SDK's own retries off (a retry is a new create)."""
    return openai.OpenAI(base_url=fake.openai_base_url, api_key="sk-test", max_retries=0, timeout=timeout)


def poll_until_done(client: openai.OpenAI, response_id: str) -> Any:
    deadline = time.monotonic() + TIMEOUT
    while True:
        response = client.responses.retrieve(response_id)
        if response.status not in ("queued", "in_progress"):
            return response
        assert time.monotonic() < deadline, f"still {response.status}"
        time.sleep(0.01)


def test_background_create_returns_at_once_and_polls_to_the_deterministic_answer(fake: FakeProvider) -> None:
    fake.set_knobs(generation_s=0.3)
    client = sdk(fake)
    created = client.responses.with_raw_response.create(
        model="gpt-test", input="Summarise the article.", background=True, metadata={"oncelery_intent": "i-1"}
    )
    assert created.headers["openai-poll-after-ms"] == "20"
    first = created.parse()
    assert first.status == "queued" and first.output == [] and first.usage is None and first.background
    done = poll_until_done(client, first.id)
    expected = generate_text("gpt-test", "Summarise the article.")
    assert (done.status, done.output_text) == ("completed", expected)
    assert (done.usage.input_tokens, done.usage.output_tokens) == (4, count_tokens(expected))
    stats = fake.stats()
    assert stats["creates"] == {"responses": 1} and stats["creates_by_intent"] == {"i-1": 1}
    assert stats["polls"] >= 1 and stats["billed_output_tokens"] == count_tokens(expected)


def test_a_stream_resumes_after_the_last_sequence_number_it_saw(fake: FakeProvider) -> None:
    fake.set_knobs(generation_s=0.4)
    client = sdk(fake)
    seen: list[Any] = []
    with client.responses.create(model="gpt-test", input="Long story.", background=True, stream=True) as stream:
        for event in stream:
            seen.append(event)
            if event.sequence_number == 5:
                break  # the worker dies here
    response_id = seen[0].response.id
    resumed = list(client.responses.retrieve(response_id, stream=True, starting_after=5))
    numbers = [e.sequence_number for e in seen + resumed]
    assert numbers == list(range(len(numbers))), "no event lost or repeated across the reconnect"
    assert resumed[0].sequence_number == 6 and resumed[-1].type == "response.completed"
    text = "".join(e.delta for e in seen + resumed if e.type == "response.output_text.delta")
    assert text == generate_text("gpt-test", "Long story.") == resumed[-1].response.output_text
    assert fake.stats()["creates"] == {"responses": 1} and fake.stats()["stream_resumes"] == 1


def test_cancel_is_idempotent_and_best_effort(fake: FakeProvider) -> None:
    client = sdk(fake)
    fake.set_knobs(stuck_queued=True)
    stuck = client.responses.create(model="gpt-test", input="x", background=True)
    assert client.responses.retrieve(stuck.id).status == "queued"
    assert client.responses.cancel(stuck.id).status == "cancelled"
    assert client.responses.cancel(stuck.id).status == "cancelled"
    fake.set_knobs(stuck_queued=False, complete_after_cancel=True, generation_s=0.2)
    racing = client.responses.create(model="gpt-test", input="y", background=True)
    client.responses.cancel(racing.id)
    assert poll_until_done(client, racing.id).status == "completed"  # seen at OpenAI: cancelled, yet completed
    foreground = client.responses.create(model="gpt-test", input="z")
    with pytest.raises(openai.BadRequestError, match="background=true"):
        client.responses.cancel(foreground.id)
    assert fake.stats()["cancels"] == 3


def test_a_background_response_is_gone_after_its_retention(fake: FakeProvider) -> None:
    fake.set_knobs(retention_s=0.2)
    client = sdk(fake)
    kept = client.responses.create(model="gpt-test", input="x", background=True, store=True)
    dropped = client.responses.create(model="gpt-test", input="x", background=True)
    deadline = time.monotonic() + TIMEOUT
    while True:
        try:
            client.responses.retrieve(dropped.id)
        except openai.NotFoundError as exc:
            assert dropped.id in str(exc)
            break
        assert time.monotonic() < deadline
        time.sleep(0.02)
    assert client.responses.retrieve(kept.id).status == "completed"  # store=true: kept past the polling window


def test_injected_errors_and_rate_limits_create_nothing_and_say_when_to_retry(fake: FakeProvider) -> None:
    client = sdk(fake)
    fake.set_knobs(fail_next=1, fail_status=429, retry_after_s=2.5)
    with pytest.raises(openai.RateLimitError) as caught:
        client.responses.create(model="gpt-test", input="x")
    assert caught.value.response.headers["retry-after"] == "3"
    fake.set_knobs(fail_next=1, fail_status=500)
    with pytest.raises(openai.InternalServerError):
        client.chat.completions.create(model="gpt-test", messages=[{"role": "user", "content": "x"}])
    fake.set_knobs(rpm_limit=2)
    for _ in range(2):
        client.responses.create(model="gpt-limited", input="x")
    with pytest.raises(openai.RateLimitError) as limited:
        client.responses.create(model="gpt-limited", input="x")
    headers = limited.value.response.headers
    assert headers["x-ratelimit-limit-requests"] == "2" and headers["x-ratelimit-remaining-requests"] == "0"
    assert 0 < float(headers["x-ratelimit-reset-requests"].rstrip("s")) <= 60
    stats = fake.stats()
    assert stats["errors_served"] == {"429": 2, "500": 1} and stats["rate_limited"] == 1
    assert stats["creates"] == {"responses": 2}


def test_a_held_create_is_counted_before_its_answer_leaves(fake: FakeProvider) -> None:
    """The create window: the provider has the call, the caller has no id yet (and a caller that dies never will)."""
    fake.set_knobs(hold_creates=2)
    client = sdk(fake)
    impatient = sdk(fake, timeout=0.3)
    with pytest.raises(openai.APITimeoutError):
        impatient.responses.create(model="gpt-test", input="x", background=True, metadata={"oncelery_intent": "lost"})
    got: list[Any] = []
    caller = threading.Thread(target=lambda: got.append(client.responses.create(model="gpt-test", input="y")))
    caller.start()
    fake.wait_for(lambda s: s["creates"].get("responses") == 2 and s["held"] == 2, timeout=TIMEOUT)
    assert got == []
    assert fake.release() == 2
    caller.join(TIMEOUT)
    assert got and got[0].status == "completed"
    assert fake.stats()["creates_by_intent"] == {"lost": 1}


def test_chat_completions_bill_exact_tokens_and_stop_at_max_tokens(fake: FakeProvider) -> None:
    client = sdk(fake)
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Tell me, now!"}]
    full = client.chat.completions.create(model="gpt-test", messages=messages, metadata={"oncelery_intent": "c"})
    assert full.choices[0].finish_reason == "stop"
    assert full.usage.prompt_tokens == count_tokens("Be brief.\nTell me, now!") == 8
    short = client.chat.completions.create(model="gpt-test", messages=messages, max_tokens=3)
    assert short.choices[0].finish_reason == "length" and short.usage.completion_tokens == 3
    with pytest.raises(openai.BadRequestError, match="Unrecognized request argument"):
        client.chat.completions.create(model="gpt-test", messages=messages, extra_body={"idempotency_key": "k"})
    assert fake.stats()["creates"] == {"chat": 2}


def test_anthropic_messages_speak_anthropic(fake: FakeProvider) -> None:
    body = {"model": "claude-test", "max_tokens": 50, "messages": [{"role": "user", "content": "Hello there."}]}
    headers = {"x-api-key": "k", "anthropic-version": "2023-06-01"}
    with httpx.Client(base_url=fake.url, timeout=TIMEOUT) as http:
        assert http.post("/v1/messages", json=body, headers={"x-api-key": "k"}).status_code == 400
        assert http.post("/v1/messages", json=body, headers={"anthropic-version": "2023-06-01"}).status_code == 401
        extra = http.post("/v1/messages", json={**body, "metadata": {"intent": "x"}}, headers=headers)
        assert extra.status_code == 400 and extra.json()["error"]["type"] == "invalid_request_error"
        tagged = {**body, "metadata": {"user_id": "oncelery-intent:m-1"}}
        message = http.post("/v1/messages", json=tagged, headers=headers).json()
        fake.set_knobs(fail_next=1, fail_status=429)
        limited = http.post("/v1/messages", json=body, headers=headers)
    assert message["type"] == "message" and message["stop_reason"] == "end_turn"
    assert message["content"][0]["text"] == generate_text("claude-test", "Hello there.")
    assert message["usage"]["input_tokens"] == 3
    assert limited.status_code == 429 and limited.json()["error"]["type"] == "rate_limit_error"
    assert "retry-after" in limited.headers
    assert fake.stats()["creates_by_intent"] == {"m-1": 1}


def test_it_runs_as_a_process_driven_over_http(tmp_path: Any) -> None:
    proc = subprocess.Popen(
        [sys.executable, "-m", "oncelery.fake_provider", "--port", "0", "--knobs", '{"generation_s": 0.05}'],
        stdout=subprocess.PIPE,
        text=True,
        env={**os.environ, "PYTHONUNBUFFERED": "1"},
    )
    try:
        assert proc.stdout is not None
        url = proc.stdout.readline().strip()
        assert url.startswith("http://127.0.0.1:")
        control = FakeProviderControl(url)
        with pytest.raises(ValueError, match="unknown knob"):
            control.set_knobs(generation_secs=1)
        client = openai.OpenAI(base_url=url + "/v1", api_key="sk", max_retries=0, timeout=TIMEOUT)
        assert client.responses.create(model="m", input="x").status == "completed"
        assert control.stats()["creates"] == {"responses": 1}
    finally:
        os.kill(proc.pid, signal.SIGTERM)
        assert proc.wait(TIMEOUT) == 0
        if proc.stdout is not None:
            proc.stdout.close()
