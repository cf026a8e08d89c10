"""The batch APIs of the fake provider, driven through the batch adapters: OpenAI's Files + Batch API, Anthropic's
Message Batches and Gemini's batch mode go through their statuses as they are polled, answer each request exactly
as its synchronous endpoint does, can be found again after their id is lost, and fail, expire, cancel and shuffle
on the knobs; the counters record every custom_id submitted and every batch token billed.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from typing import Any

import httpx
import pytest

from oncelery.fake_provider import FakeProvider, Knobs, count_tokens, generate_text
from oncelery.llm.adapters.anthropic_messages import AnthropicMessages
from oncelery.llm.adapters.base import output_text
from oncelery.llm.adapters.batch import AnthropicBatches, BatchLine, BatchState, GeminiBatches, OpenAIBatches
from oncelery.llm.adapters.gemini_generate import GeminiGenerateContent
from oncelery.llm.adapters.openai_responses import OpenAIResponses
from oncelery.llm.errors import ProviderRejected, ResponseGone

MODEL = "gpt-test"
CLAUDE = "claude-test"
GEMINI = "gemini-test"


@pytest.fixture
def fake() -> Iterator[FakeProvider]:
    """A fake provider in a thread, stopped afterwards."""
    with FakeProvider(Knobs(batch_polls=2)) as provider:
        yield provider


@pytest.fixture
def opened() -> Iterator[list[Any]]:
    """Adapters a test opens, closed afterwards."""
    adapters: list[Any] = []
    yield adapters
    for adapter in adapters:
        adapter.close()


def openai(fake: FakeProvider, opened: list[Any]) -> OpenAIBatches:
    adapter = OpenAIBatches(fake.openai_base_url, "sk-test", timeout_s=5)
    opened.append(adapter)
    return adapter


def anthropic(fake: FakeProvider, opened: list[Any]) -> AnthropicBatches:
    adapter = AnthropicBatches(fake.openai_base_url, "sk-ant-test", timeout_s=5)
    opened.append(adapter)
    return adapter


def requests(n: int, model: str = MODEL) -> list[tuple[str, dict[str, Any]]]:
    """n Responses requests, custom_ids c0..c{n-1}."""
    return [(f"c{i}", {"model": model, "input": f"Summarise article {i}."}) for i in range(n)]


def submit(
    adapter: OpenAIBatches, lines: list[tuple[str, dict[str, Any]]], tag: str, endpoint: str = "responses"
) -> BatchState:
    file_id = adapter.submit_file(lines, endpoint, f"oncelery-{tag}.jsonl")
    return adapter.create(file_id, endpoint, tag)


def poll(adapter: OpenAIBatches | AnthropicBatches | GeminiBatches, state: BatchState) -> tuple[BatchState, list[str]]:
    """Retrieve until the batch ends (each retrieve advances the fake's batch); return it and the statuses seen."""
    seen = [state.status]
    for _ in range(20):
        if state.ended:
            return state, seen
        state = adapter.retrieve(state.id)
        seen.append(state.status)
    raise AssertionError(f"batch {state.id} did not end: {seen}")


def by_id(lines: list[BatchLine]) -> dict[str, BatchLine]:
    return {line.custom_id: line for line in lines}


def text_of(response: dict[str, Any] | None) -> str:
    assert response is not None
    if response.get("object") == "response":
        return str(response["output"][0]["content"][0]["text"])
    if response.get("object") == "chat.completion":
        return str(response["choices"][0]["message"]["content"])
    return str(response["content"][0]["text"])


def test_an_openai_batch_goes_through_its_statuses_to_the_synchronous_answers(
    fake: FakeProvider, opened: list[Any]
) -> None:
    adapter = openai(fake, opened)
    lines = requests(5)
    created = submit(adapter, lines, "run-1")
    assert created.id.startswith("batch_") and created.metadata == {"oncelery_batch": "run-1"}
    ended, seen = poll(adapter, created)
    assert seen == ["validating", "in_progress", "in_progress", "finalizing", "completed"]
    assert ended.counts == {"total": 5, "completed": 5, "failed": 0}
    assert ended.output_ref and ended.error_ref is None
    results = by_id(list(adapter.results(ended)))
    assert sorted(results) == [c for c, _ in lines] and all(r.ok and r.error is None for r in results.values())

    sync = OpenAIResponses(fake.openai_base_url, "sk-test", timeout_s=5)
    opened.append(sync)
    billed = [0, 0]
    for custom_id, body in lines:
        expected = generate_text(MODEL, body["input"])
        answer = results[custom_id].response
        assert answer is not None and text_of(answer) == expected and answer["status"] == "completed"
        assert answer["usage"]["input_tokens"] == count_tokens(body["input"])
        assert answer["usage"]["output_tokens"] == count_tokens(expected)
        same = sync.create(body, f"intent-{custom_id}", background=False).response
        assert (text_of(same), same["usage"]) == (text_of(answer), answer["usage"])
        billed[0] += answer["usage"]["input_tokens"]
        billed[1] += answer["usage"]["output_tokens"]

    stats = fake.stats()
    assert stats["batches_created"] == {"openai": 1} and stats["files_uploaded"] == 1
    assert stats["items_by_custom_id"] == {c: 1 for c, _ in lines}
    assert stats["batch_retrieves"] == 4
    assert [stats["batch_billed_input_tokens"], stats["batch_billed_output_tokens"]] == billed
    # The synchronous bill counts the synchronous calls only: the batch is billed apart.
    assert [stats["billed_input_tokens"], stats["billed_output_tokens"]] == billed
    assert stats["creates"] == {"responses": 5}


def test_a_lost_batch_is_found_by_its_tag_and_leftover_files_are_listed_and_deleted(
    fake: FakeProvider, opened: list[Any]
) -> None:
    adapter = openai(fake, opened)
    before = time.time()
    wanted = submit(adapter, requests(2), "job-a")
    for tag in ("job-b", "job-c"):
        submit(adapter, requests(1), tag)
    found = adapter.find("job-a")
    assert found is not None and found.id == wanted.id and found.status == "validating"
    assert adapter.find("job-a", created_after=before) is not None
    assert adapter.find("job-a", created_after=time.time() + 3600) is None  # listing stops at older batches
    assert adapter.find("job-z") is None
    assert adapter.retrieve(wanted.id).status == "in_progress", "a find does not advance the batch"

    # The list pages newest first, with has_more, first_id and last_id.
    with httpx.Client(base_url=fake.openai_base_url, headers={"Authorization": "Bearer sk"}) as client:
        first = client.get("/batches", params={"limit": 2}).json()
        rest = client.get("/batches", params={"limit": 2, "after": first["last_id"]}).json()
    assert first["object"] == "list" and first["has_more"] and len(first["data"]) == 2
    assert [b["id"] for b in rest["data"]] == [wanted.id] and not rest["has_more"]
    assert rest["first_id"] == rest["last_id"] == wanted.id

    leftover = adapter.submit_file(requests(1), "responses", "oncelery-job-d.jsonl")  # crashed before its create
    listed = adapter.uploaded_files("oncelery-job-")
    assert [name for _, name in listed] == [f"oncelery-job-{x}.jsonl" for x in "dcba"]
    assert adapter.uploaded_files("oncelery-job-d") == [(leftover, "oncelery-job-d.jsonl")]
    assert adapter.uploaded_files("other-") == []
    adapter.delete_file(leftover)
    adapter.delete_file(leftover)  # already gone: still fine
    assert adapter.uploaded_files("oncelery-job-d") == []
    with pytest.raises(ResponseGone):
        next(adapter.results(BatchState(leftover, "completed", True, leftover, None, {}, 0.0, {})))
    stats = fake.stats()
    assert (stats["files_uploaded"], stats["files_deleted"]) == (4, 1)
    assert stats["batches_created"] == {"openai": 3}


def test_batch_fail_ids_put_those_items_in_the_error_file(fake: FakeProvider, opened: list[Any]) -> None:
    fake.set_knobs(batch_fail_ids=["c1", "c3"])
    adapter = openai(fake, opened)
    ended, _ = poll(adapter, submit(adapter, requests(5), "fails"))
    assert ended.status == "completed" and ended.counts == {"total": 5, "completed": 3, "failed": 2}
    assert ended.output_ref and ended.error_ref
    results = by_id(list(adapter.results(ended)))
    assert sorted(c for c, r in results.items() if r.ok) == ["c0", "c2", "c4"]
    for custom_id in ("c1", "c3"):
        line = results[custom_id]
        assert not line.ok and not line.expired and line.response is None
        assert line.error is not None and line.error.startswith("500:")
    stats = fake.stats()
    outputs = [count_tokens(generate_text(MODEL, f"Summarise article {i}.")) for i in (0, 2, 4)]
    assert stats["batch_billed_output_tokens"] == sum(outputs), "failed items are not billed"


def test_batch_fail_first_fails_the_first_submissions_then_a_requeue_succeeds(
    fake: FakeProvider, opened: list[Any]
) -> None:
    fake.set_knobs(batch_fail_first=1)
    adapter = openai(fake, opened)
    first, _ = poll(adapter, submit(adapter, requests(3), "try-1"))
    failed = [line.custom_id for line in adapter.results(first) if not line.ok]
    assert sorted(failed) == ["c0", "c1", "c2"] and first.output_ref is None
    again = [(c, b) for c, b in requests(3) if c in failed]
    second, _ = poll(adapter, submit(adapter, again, "try-2"))
    assert all(line.ok for line in adapter.results(second))
    assert fake.stats()["items_by_custom_id"] == {"c0": 2, "c1": 2, "c2": 2}


def test_an_expired_batch_applies_its_finished_half_and_expires_the_rest(fake: FakeProvider, opened: list[Any]) -> None:
    fake.set_knobs(batch_expire=True)
    adapter = openai(fake, opened)
    ended, seen = poll(adapter, submit(adapter, requests(5), "late"))
    assert seen[-1] == "expired" and "finalizing" not in seen
    assert ended.counts == {"total": 5, "completed": 3, "failed": 2}
    results = by_id(list(adapter.results(ended)))
    assert sorted(c for c, r in results.items() if r.ok) == ["c0", "c2", "c4"]
    assert all(results[c].expired and not results[c].ok for c in ("c1", "c3"))
    assert results["c1"].error is not None and results["c1"].error.startswith("batch_expired")


def test_a_cancelled_batch_keeps_its_partial_results(fake: FakeProvider, opened: list[Any]) -> None:
    adapter = openai(fake, opened)
    created = submit(adapter, requests(6), "stop")
    assert adapter.retrieve(created.id).counts == {"total": 6, "completed": 2, "failed": 0}
    cancelling = adapter.cancel(created.id)
    assert cancelling.status == "cancelling" and not cancelling.ended
    ended, seen = poll(adapter, cancelling)
    assert seen == ["cancelling", "cancelled"]
    results = by_id(list(adapter.results(ended)))
    assert sorted(c for c, r in results.items() if r.ok) == ["c0", "c1"]
    assert all(r.expired for c, r in results.items() if not r.ok), "not run: safe to re-queue"


def test_batch_shuffle_reorders_the_lines_of_a_chat_batch(fake: FakeProvider, opened: list[Any]) -> None:
    fake.set_knobs(batch_shuffle=True)
    adapter = openai(fake, opened)
    lines = [(f"q{i}", {"model": MODEL, "messages": [{"role": "user", "content": f"Q {i}"}]}) for i in range(6)]
    ended, _ = poll(adapter, submit(adapter, lines, "mixed", endpoint="chat"))
    order = [line.custom_id for line in adapter.results(ended)]
    assert sorted(order) == [c for c, _ in lines] and order != [c for c, _ in lines]
    for line in adapter.results(ended):
        assert line.response is not None and line.response["object"] == "chat.completion"
        assert text_of(line.response) == generate_text(MODEL, f"Q {line.custom_id[1:]}")


def test_an_invalid_openai_batch_is_refused_before_anything_is_counted(fake: FakeProvider, opened: list[Any]) -> None:
    adapter = openai(fake, opened)
    twice = adapter.submit_file(requests(2) + requests(1), "responses", "dup.jsonl")
    with pytest.raises(ProviderRejected, match="Duplicate custom_id"):
        adapter.create(twice, "responses", "dup")
    chat = adapter.submit_file(requests(1), "chat", "chat.jsonl")
    with pytest.raises(ProviderRejected, match="does not match"):
        adapter.create(chat, "responses", "mismatch")
    with pytest.raises(ProviderRejected, match="no such File"):
        adapter.create("file-nope", "responses", "missing")
    with pytest.raises(ResponseGone):
        adapter.retrieve("batch_nope")
    stats = fake.stats()
    assert stats["batches_created"] == {} and stats["items_by_custom_id"] == {}


def test_an_anthropic_batch_ends_with_its_results_and_is_found_by_listing(
    fake: FakeProvider, opened: list[Any]
) -> None:
    adapter = anthropic(fake, opened)
    since = time.time()
    params = [
        (f"m-{i}", {"model": CLAUDE, "max_tokens": 200, "messages": [{"role": "user", "content": f"Note {i}."}]})
        for i in range(3)
    ]
    created = adapter.create(params)
    assert created.id.startswith("msgbatch_") and created.status == "in_progress" and created.metadata == {}
    assert created.counts["processing"] == 3 and created.output_ref is None
    assert [b.id for b in adapter.list_since(since)] == [created.id]
    assert adapter.list_since(time.time() + 3600) == []
    ended, seen = poll(adapter, created)
    assert seen == ["in_progress", "in_progress", "in_progress", "ended"]
    assert ended.output_ref == created.id and ended.counts["succeeded"] == 3 and ended.counts["processing"] == 0

    sync = AnthropicMessages(fake.openai_base_url, "sk-ant-test", timeout_s=5)
    opened.append(sync)
    results = by_id(list(adapter.results(ended)))
    assert sorted(results) == ["m-0", "m-1", "m-2"]
    for custom_id, request in params:
        message = results[custom_id].response
        assert message is not None and message["type"] == "message"
        assert text_of(message) == generate_text(CLAUDE, request["messages"][0]["content"])
        same = sync.create(request, f"intent-{custom_id}", background=False).response
        assert (text_of(same), same["usage"]) == (text_of(message), message["usage"])
    assert fake.stats()["batches_created"] == {"anthropic": 1}


def test_anthropic_batches_error_expire_and_cancel_per_request(fake: FakeProvider, opened: list[Any]) -> None:
    adapter = anthropic(fake, opened)
    fake.set_knobs(batch_fail_ids=["a-2"], batch_expire=True)
    params = [
        (f"a-{i}", {"model": CLAUDE, "max_tokens": 50, "messages": [{"role": "user", "content": "x"}]})
        for i in range(4)
    ]
    params.append(("a-bad", {"model": CLAUDE, "messages": [{"role": "user", "content": "no max_tokens"}]}))
    ended, _ = poll(adapter, adapter.create(params))
    results = by_id(list(adapter.results(ended)))
    assert results["a-0"].ok and results["a-1"].expired and results["a-3"].expired, "odd positions expire"
    assert not results["a-2"].ok and not results["a-2"].expired  # failed by the knob
    assert results["a-2"].error is not None and results["a-2"].error.startswith("api_error")
    assert not results["a-bad"].ok and not results["a-bad"].expired  # position 4: run, and refused as invalid
    assert results["a-bad"].error is not None and results["a-bad"].error.startswith("invalid_request_error")
    assert ended.counts == {"processing": 0, "succeeded": 1, "errored": 2, "canceled": 0, "expired": 2}

    fake.set_knobs(batch_expire=False)
    second = adapter.create([("b-0", params[0][1]), ("b-1", params[0][1])])
    assert adapter.cancel(second.id).status == "canceling"
    ended, _ = poll(adapter, adapter.retrieve(second.id))
    assert ended.counts["canceled"] == 2 and all(line.expired for line in adapter.results(ended))
    with pytest.raises(ProviderRejected, match="Duplicate custom_id"):
        adapter.create([("x", params[0][1]), ("x", params[0][1])])


def test_batch_knobs_are_set_over_http_and_a_reset_forgets_batches(fake: FakeProvider, opened: list[Any]) -> None:
    knobs = fake.set_knobs(batch_fail_ids=["c0"], batch_polls=0, batch_shuffle=True)
    assert (knobs["batch_fail_ids"], knobs["batch_polls"], knobs["batch_shuffle"]) == (["c0"], 0, True)
    with pytest.raises(ValueError, match="list of strings"):
        fake.set_knobs(batch_fail_ids="c0")
    adapter = openai(fake, opened)
    created = submit(adapter, requests(2), "quick")
    assert poll(adapter, created)[1] == ["validating", "finalizing", "completed"]
    fake.reset()
    with pytest.raises(ResponseGone):
        adapter.retrieve(created.id)
    assert adapter.uploaded_files("") == [] and fake.stats()["items_by_custom_id"] == {}


# -- Gemini batch mode ---------------------------------------------------------------------------------------------


def gemini(fake: FakeProvider, opened: list[Any]) -> GeminiBatches:
    adapter = GeminiBatches(fake.gemini_base_url, "g-key", timeout_s=5)
    opened.append(adapter)
    return adapter


def contents(text: str) -> dict[str, Any]:
    """A GenerateContentRequest of one user turn (the model is the batch's, in its path)."""
    return {"contents": [{"role": "user", "parts": [{"text": text}]}], "generationConfig": {"maxOutputTokens": 200}}


def gemini_lines(n: int, prefix: str = "k") -> list[tuple[str, dict[str, Any]]]:
    return [(f"{prefix}{i}", {"model": GEMINI, **contents(f"Gemini note {i}.")}) for i in range(n)]


def raw(fake: FakeProvider, method: str, path: str, **kwargs: Any) -> httpx.Response:
    with httpx.Client(base_url=fake.gemini_base_url, headers={"x-goog-api-key": "g-key"}, timeout=5) as client:
        return client.request(method, path, **kwargs)


def test_a_gemini_batch_answers_inline_in_input_order_without_echoing_metadata(
    fake: FakeProvider, opened: list[Any]
) -> None:
    adapter = gemini(fake, opened)
    lines = gemini_lines(4)
    created = adapter.create(lines, GEMINI, "ob-tag-1")
    assert created.id.startswith("batches/") and created.status == "BATCH_STATE_PENDING" and not created.ended
    assert created.metadata == {"displayName": "ob-tag-1", "model": f"models/{GEMINI}"}
    assert created.counts["requestCount"] == 4 and created.counts["pendingRequestCount"] == 4
    ended, seen = poll(adapter, created)
    assert seen == ["BATCH_STATE_PENDING", "BATCH_STATE_RUNNING", "BATCH_STATE_RUNNING", "BATCH_STATE_SUCCEEDED"]

    operation = raw(fake, "GET", f"/{created.id}").json()  # an ended batch no longer moves
    assert operation["done"] is True and operation["name"] == created.id and "error" not in operation
    assert operation["metadata"]["@type"].endswith("v1main.GenerateContentBatch")
    assert operation["metadata"]["batchStats"]["successfulRequestCount"] == "4"  # int64: a JSON string
    output = operation["response"]
    assert output["@type"].endswith("v1main.GenerateContentBatchOutput")
    entries = output["inlinedResponses"]["inlinedResponses"]
    assert len(entries) == 4 and all(set(e) == {"response"} for e in entries), "no metadata echoed back"
    expected = [generate_text(GEMINI, body["contents"][0]["parts"][0]["text"]) for _, body in lines]
    assert [output_text(e["response"]) for e in entries] == expected, "input order"

    sync = GeminiGenerateContent(fake.gemini_base_url, "g-key", timeout_s=5)
    opened.append(sync)
    results = list(adapter.results(ended, [c for c, _ in lines]))
    assert [line.custom_id for line in results] == ["k0", "k1", "k2", "k3"] and all(line.ok for line in results)
    for line, (_, body) in zip(results, lines, strict=True):
        same = sync.create(body, "no-tag", background=False).response
        assert line.response is not None and line.response["usageMetadata"] == same["usageMetadata"]
        assert (
            output_text(line.response)
            == output_text(same)
            == generate_text(GEMINI, body["contents"][0]["parts"][0]["text"])
        )
    stats = fake.stats()
    assert stats["batches_created"] == {"gemini": 1} and stats["items_by_custom_id"] == {c: 1 for c, _ in lines}
    assert stats["creates"] == {"gemini": 4} and stats["creates_without_intent"] == 4, "generateContent: no tag"
    assert stats["batch_billed_output_tokens"] == sum(count_tokens(t) for t in expected)
    with pytest.raises(ProviderRejected, match="cannot be matched"):
        list(adapter.results(ended, ["k0", "k1", "k2"]))  # a count that differs is never mapped


def test_a_gemini_batch_is_found_by_display_name_listed_newest_first_and_cancelled(
    fake: FakeProvider, opened: list[Any]
) -> None:
    adapter = gemini(fake, opened)
    wanted = adapter.create(gemini_lines(2, "a"), GEMINI, "g-a")
    for tag in ("g-b", "g-c"):
        adapter.create(gemini_lines(1, tag), GEMINI, tag)
    found = adapter.find("g-a")
    assert found is not None and found.id == wanted.id and adapter.find("g-z") is None
    assert adapter.retrieve(wanted.id).status == "BATCH_STATE_RUNNING", "a find does not advance the batch"
    first = raw(fake, "GET", "/batches", params={"pageSize": 2}).json()
    rest = raw(fake, "GET", "/batches", params={"pageSize": 2, "pageToken": first["nextPageToken"]}).json()
    assert [o["metadata"]["displayName"] for o in first["operations"]] == ["g-c", "g-b"]
    assert [o["name"] for o in rest["operations"]] == [wanted.id] and "nextPageToken" not in rest

    assert raw(fake, "POST", f"/{wanted.id}:cancel").json() == {}
    assert adapter.cancel(wanted.id) is None  # again: still fine
    cancelled = adapter.retrieve(wanted.id)
    assert cancelled.status == "BATCH_STATE_CANCELLED" and cancelled.ended and cancelled.inline is None
    operation = raw(fake, "GET", f"/{wanted.id}").json()
    assert operation["done"] and operation["error"]["code"] == 1 and "response" not in operation
    assert list(adapter.results(cancelled, ["a0", "a1"])) == [], "no responses: its items are re-queued"
    with pytest.raises(ResponseGone):
        adapter.retrieve("batches/nope")


def test_gemini_items_fail_in_place_and_an_expired_batch_returns_no_responses(
    fake: FakeProvider, opened: list[Any]
) -> None:
    adapter = gemini(fake, opened)
    fake.set_knobs(batch_fail_ids=["k1"], batch_shuffle=True)  # shuffle does not apply: the order is the mapping
    lines = [*gemini_lines(3), ("k3", {"contents": [{"parts": [{"text": "x"}]}], "stream": True})]
    ended, _ = poll(adapter, adapter.create(lines, GEMINI, "g-fail"))
    results = list(adapter.results(ended, [c for c, _ in lines]))
    assert [(line.custom_id, line.ok) for line in results] == [("k0", True), ("k1", False), ("k2", True), ("k3", False)]
    assert results[1].error is not None and results[1].error.startswith("500:") and not results[1].expired
    assert results[3].error is not None and results[3].error.startswith("400:") and "stream" in results[3].error
    assert ended.counts["failedRequestCount"] == 2 and ended.counts["successfulRequestCount"] == 2

    fake.set_knobs(batch_fail_ids=[], batch_expire=True)
    before = fake.stats()["batch_billed_output_tokens"]
    expired, seen = poll(adapter, adapter.create(gemini_lines(2, "e"), GEMINI, "g-late"))
    assert seen[-1] == "BATCH_STATE_EXPIRED" and expired.inline is None
    assert list(adapter.results(expired, ["e0", "e1"])) == [], "no responses: the batcher re-queues every item"
    assert raw(fake, "GET", f"/{expired.id}").json()["error"]["code"] == 4
    assert fake.stats()["batch_billed_output_tokens"] == before, "nothing of an expired batch ran"

    refused = raw(fake, "POST", f"/models/{GEMINI}:batchGenerateContent", json={"batch": {"inputConfig": {}}})
    assert refused.status_code == 400 and refused.json()["error"]["status"] == "INVALID_ARGUMENT"
    sync = GeminiGenerateContent(fake.gemini_base_url, "", timeout_s=5)
    opened.append(sync)
    with pytest.raises(ProviderRejected, match="403"):
        sync.create({"model": GEMINI, **contents("hi")}, "i", background=False)
    assert fake.stats()["batches_created"] == {"gemini": 2}
