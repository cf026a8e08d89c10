"""Provider adapters against the fake provider: each protocol's create, poll, resume and cancel, every failure
mapped to one typed error that says whether the provider may have the call, and no retry ever hidden inside.
"""

from __future__ import annotations

import socket
import time
from collections.abc import Iterator
from typing import Any

import pytest

from oncelery.fake_provider import FakeProvider, Knobs, count_tokens, generate_text
from oncelery.llm.adapters.anthropic_messages import AnthropicMessages
from oncelery.llm.adapters.base import CallState
from oncelery.llm.adapters.http import duration_s, rate_hint, retry_after_s
from oncelery.llm.adapters.openai_chat import OpenAIChat
from oncelery.llm.adapters.openai_responses import OpenAIResponses
from oncelery.llm.errors import ProviderRateLimited, ProviderRejected, ProviderUnavailable, ResponseGone
from oncelery.llm.request import request_digest

TIMEOUT = 10.0


@pytest.fixture
def fake() -> Iterator[FakeProvider]:
    """A fake provider in a thread, stopped afterwards."""
    with FakeProvider(Knobs(poll_after_ms=10)) as provider:
        yield provider


@pytest.fixture
def opened() -> Iterator[list[Any]]:
    """Adapters a test opens, closed afterwards."""
    adapters: list[Any] = []
    yield adapters
    for adapter in adapters:
        adapter.close()


def responses(fake: FakeProvider, opened: list[Any], timeout_s: float = TIMEOUT) -> OpenAIResponses:
    adapter = OpenAIResponses(fake.openai_base_url, "sk-test", timeout_s=timeout_s)
    opened.append(adapter)
    return adapter


def test_a_background_call_is_created_once_then_polled_to_its_answer(fake: FakeProvider, opened: list[Any]) -> None:
    fake.set_knobs(generation_s=0.2)
    adapter = responses(fake, opened)
    first = adapter.create({"model": "m", "input": "Summarise this."}, "intent-1", background=True)
    assert first.state is CallState.PENDING and first.reference and first.poll_after_s == 0.01
    deadline = time.monotonic() + TIMEOUT
    look = first
    while not look.terminal:
        assert time.monotonic() < deadline
        time.sleep(look.poll_after_s or 0.01)
        look = adapter.poll(first.reference)
    assert look.state is CallState.DONE and look.reference == first.reference
    answer = look.response["output"][0]["content"][0]["text"]
    assert answer == generate_text("m", "Summarise this.")
    assert adapter.usage(look.response) == (adapter.usage(look.response).__class__(3, count_tokens(answer)))
    stats = fake.stats()
    assert stats["creates_by_intent"] == {"intent-1": 1} and stats["creates"] == {"responses": 1}


def test_a_streamed_call_returns_its_id_at_once_and_is_followed_after_the_cursor(
    fake: FakeProvider, opened: list[Any]
) -> None:
    fake.set_knobs(generation_s=0.3)
    adapter = responses(fake, opened)
    first = adapter.create({"model": "m", "input": "x", "stream": True}, "intent-s", background=True)
    assert first.state is CallState.PENDING and first.cursor == 0 and first.reference
    looks = list(adapter.follow(first.reference, first.cursor or 0))
    assert looks[-1].state is CallState.DONE and looks[-1].cursor and looks[-1].cursor > 1
    assert fake.stats()["creates"] == {"responses": 1} and fake.stats()["stream_resumes"] == 1


def test_cancel_and_a_forgotten_response(fake: FakeProvider, opened: list[Any]) -> None:
    fake.set_knobs(stuck_queued=True, retention_s=0.05)
    adapter = responses(fake, opened)
    call = adapter.create({"model": "m", "input": "x"}, "i", background=True)
    assert adapter.cancel(call.reference or "").state is CallState.CANCELLED
    deadline = time.monotonic() + TIMEOUT
    with pytest.raises(ResponseGone, match="no longer has response"):
        while time.monotonic() < deadline:
            adapter.poll(call.reference or "")
            time.sleep(0.02)
    assert adapter.capabilities({"store": True}).retention_s == 30 * 86400.0
    assert adapter.capabilities({}).retention_s == 600.0 and adapter.capabilities({}).lookup is None


def test_failures_are_typed_and_never_retried_inside(fake: FakeProvider, opened: list[Any]) -> None:
    adapter = responses(fake, opened)
    fake.set_knobs(fail_next=1, fail_status=429, retry_after_s=3)
    with pytest.raises(ProviderRateLimited) as limited:
        adapter.create({"model": "m", "input": "x"}, "i-429", background=True)
    assert limited.value.retry_after_s == 3.0
    fake.set_knobs(fail_next=1, fail_status=500)
    with pytest.raises(ProviderUnavailable) as down:
        adapter.create({"model": "m", "input": "x"}, "i-500", background=True)
    assert down.value.maybe_sent is True
    with pytest.raises(ProviderRejected, match="Unrecognized request argument"):
        adapter.create({"model": "m", "input": "x", "timeout_s": 3}, "i-400", background=True)
    stats = fake.stats()
    assert stats["errors_served"] == {"429": 1, "500": 1}, "one request each: no retry behind the caller's back"
    assert stats["creates"] == {}


def test_a_timeout_after_sending_means_the_provider_may_have_the_call(fake: FakeProvider, opened: list[Any]) -> None:
    fake.set_knobs(hang_next=1, hang_s=5.0)
    with pytest.raises(ProviderUnavailable) as timed_out:
        responses(fake, opened, timeout_s=0.3).create({"model": "m", "input": "x"}, "i-hang", background=True)
    assert timed_out.value.maybe_sent is True
    assert fake.stats()["creates_by_intent"] == {"i-hang": 1}, "the provider has it: a re-send would pay twice"
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        closed = s.getsockname()[1]
    refused = OpenAIResponses(f"http://127.0.0.1:{closed}/v1", "sk", timeout_s=1.0)
    opened.append(refused)
    with pytest.raises(ProviderUnavailable) as never_sent:
        refused.create({"model": "m", "input": "x"}, "i-refused", background=True)
    assert never_sent.value.maybe_sent is False


def test_sync_adapters_carry_the_intent_and_read_usage(fake: FakeProvider, opened: list[Any]) -> None:
    chat = OpenAIChat(fake.openai_base_url, "sk")
    opened.append(chat)
    done = chat.create({"model": "g", "messages": [{"role": "user", "content": "Hi there"}]}, "c-1", background=True)
    assert done.state is CallState.DONE and chat.usage(done.response).input_tokens == 2
    claude = AnthropicMessages(fake.openai_base_url, "k")
    opened.append(claude)
    message = {"model": "c", "max_tokens": 5, "messages": [{"role": "user", "content": "Hello"}]}
    got = claude.create(message, "a-1", background=True)
    assert got.state is CallState.DONE and claude.usage(got.response).output_tokens == 5
    own = claude.create({**message, "metadata": {"user_id": "user-7"}}, "a-2", background=False)
    assert own.state is CallState.DONE
    stats = fake.stats()
    assert stats["creates_by_intent"] == {"c-1": 1, "a-1": 1} and stats["creates_without_intent"] == 1
    assert claude.capabilities(message).background is False and chat.capabilities({}).retention_s is None


def test_the_request_digest_covers_what_shapes_the_answer_only() -> None:
    base = {"model": "m", "input": "x", "temperature": 0.2}
    same = {**base, "metadata": {"a": "b"}, "background": True, "stream": True, "store": False, "user": "u"}
    assert request_digest(base) == request_digest(same)
    for changed in ({"input": "y"}, {"model": "n"}, {"temperature": 0.3}, {"tools": [{"type": "web_search"}]}):
        assert request_digest({**base, **changed}) != request_digest(base), changed


def test_rate_hints_read_both_providers_headers() -> None:
    assert duration_s("6m0s") == 360.0 and duration_s("20ms") == 0.02 and duration_s("1.5s") == 1.5
    assert duration_s("soon") is None and retry_after_s("7") == 7.0 and retry_after_s(None) is None
    hint = rate_hint(
        {"x-ratelimit-remaining-requests": "4", "x-ratelimit-remaining-tokens": "100", "x-ratelimit-reset-tokens": "2s"}
    )
    assert (hint.remaining_requests, hint.remaining_tokens, hint.reset_s) == (4, 100, 2.0)
    anthropic = rate_hint({"anthropic-ratelimit-input-tokens-remaining": "50", "retry-after": "3"})
    assert (anthropic.remaining_tokens, anthropic.retry_after_s) == (50, 3.0)
