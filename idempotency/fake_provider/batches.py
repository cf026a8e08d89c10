"""The batch APIs, time compressed: OpenAI's Files and Batch APIs, Anthropic's Message Batches and Gemini's batch
mode.

Wire shapes, as the providers' references give them (checked with the search tool, 2026-12):

- OpenAI Batch object (openai-python `types/batch.py`; API reference "Batch", developers.openai.com): `id`
  (`batch_...`), `object: "batch"`, `endpoint`, `input_file_id`, `completion_window: "24h"`, `status` validating,
  failed, in_progress, finalizing, completed, expired, cancelling or cancelled, `output_file_id`, `error_file_id`,
  `created_at`, `in_progress_at`, `expires_at`, `finalizing_at`, `completed_at`, `failed_at`, `expired_at`,
  `cancelling_at`, `cancelled_at` (Unix seconds or null), `request_counts {total, completed, failed}`, `metadata`
  (16 pairs: keys up to 64 characters, values up to 512), `errors`. Create: `{input_file_id, endpoint,
  completion_window, metadata, output_expires_after}`. List: `GET /v1/batches?after=&limit=` (default 20, 1 to
  100), newest first, `{object: "list", data, first_id, last_id, has_more}`. Cancel: `cancelling` (up to 10
  minutes), then `cancelled`; the requests done by then stay in the output file.
- Its JSONL lines: input `{custom_id, method: "POST", url, body}`; output and error files (OpenAPI
  `BatchRequestOutput`) `{id, custom_id, response: {status_code, request_id, body} | null, error: {code, message} |
  null}`. A request the endpoint answered with a 4xx/5xx is a `response` with that status and `error` null; a
  request that never ran has `response` null and `error.code` `batch_expired` or `batch_cancelled`
  (`BatchRequestOutputError`).
- Files: see `files` (the OpenAI Files API the input and output files travel by).
- Anthropic MessageBatch (platform.claude.com API reference "Message Batches"; anthropic-sdk-python
  `resources/messages/batches.py`): `id` (`msgbatch_...`), `type: "message_batch"`, `processing_status`
  in_progress, canceling or ended, `request_counts {processing, succeeded, errored, canceled, expired}`, `created_at`,
  `expires_at` (24 h after creation), `ended_at`, `cancel_initiated_at`, `archived_at` (RFC 3339 strings),
  `results_url` (null until ended). Create `{requests: [{custom_id, params}]}`, custom_ids unique, 1 to 64 of
  `[a-zA-Z0-9_-]`; no metadata. List `?limit=` (default 20, 1 to 1000) `&after_id=&before_id=`, newest first,
  `{data, has_more, first_id, last_id}`. Results: JSONL `{custom_id, result}` with `result` `{type: "succeeded",
  message}`, `{type: "errored", error: <the error envelope>}`, `{type: "canceled"}` or `{type: "expired"}`, in any
  order. A request's params are validated while the batch runs: a bad one ends `errored`.
- Gemini batch mode (ai.google.dev/api/batch-api, REST v1beta): `POST /v1beta/models/{model}:batchGenerateContent`
  with `{batch: {displayName (required), model, inputConfig: {requests: {requests: [{request, metadata}]}}}}`
  answers an Operation `{name: "batches/<id>", metadata: <GenerateContentBatch>, done}`; the GenerateContentBatch
  has `@type`, `name`, `model`, `displayName`, `createTime`, `updateTime`, `endTime`, `batchStats`
  (`requestCount`, `successfulRequestCount`, `failedRequestCount`, `pendingRequestCount`: int64 as JSON strings)
  and `state` BATCH_STATE_PENDING, RUNNING, SUCCEEDED, FAILED, CANCELLED or EXPIRED. `GET /v1beta/batches/<id>`
  (the Operation), `GET /v1beta/batches?pageSize=&pageToken=` (`{operations, nextPageToken}`),
  `POST /v1beta/batches/<id>:cancel` (answers `{}`). Once done, a succeeded batch's Operation has `response:
  {@type: GenerateContentBatchOutput, inlinedResponses: {inlinedResponses: [{response} | {error}]}}` in input
  order, without the requests' metadata (not echoed back, as ../shared/PROVIDERS.md notes); a cancelled or
  expired one has an `error` (google.rpc.Status) and no response. Auth: the `x-goog-api-key` header.

Time is compressed: a batch moves only when it is retrieved. After its create (OpenAI `validating`, Anthropic
`in_progress`), each retrieve advances it: `in_progress` for `Knobs.batch_polls` retrieves (its requests done in
input order, a share per retrieve), then OpenAI's `finalizing` for one retrieve, then it ends (`completed`, or
`expired` with `batch_expire`; Anthropic `ended`). A cancel makes it `cancelling`/`canceling`; the next retrieve
ends it `cancelled`/`ended`, the requests not yet done canceled. A batch created while `batch_hold` is armed
stays in progress (none of its requests runs, its retrieves not counted) until the next `release`, then moves as
any other. Knobs are read when a batch is created. A Gemini
batch goes PENDING, then RUNNING for `batch_polls` retrieves, then SUCCEEDED (or EXPIRED with `batch_expire`:
none of its requests runs, and it returns no response); a cancel ends it CANCELLED at the next retrieve.
`batch_shuffle` does not apply to Gemini: its output order is how responses are matched to requests.

Each request's answer is the one the synchronous endpoint gives (the same generator, token counts and response
JSON, ids aside), billed to `batch_billed_*_tokens` when it succeeds, not to the synchronous bill.

Simplifications: a malformed input line (or a duplicate custom_id) is refused with 400 at the create, where OpenAI
accepts the batch and ends it `failed`; the fake serves only the `/v1/responses` and `/v1/chat/completions`
endpoints; cancelling an ended batch answers the batch as it is; nothing is archived or expires on the clock;
Gemini batches take inline requests only (no `fileName`), and a Gemini request without a `metadata.key` counts
under the key "" in `items_by_custom_id`.

Where it is coded: `batch_records` (the records), `files` (OpenAI's Files API), `batch_checks` (a create
validated into a `Plan`), this module (a batch's life: create, retrieve, cancel, list, results), `batch_shapes`
(each provider's wire objects and result lines).
"""

from __future__ import annotations

import time
import uuid
from collections.abc import Callable, Sequence
from typing import Any

from oncelery.fake_provider import protocol as wire
from oncelery.fake_provider.batch_records import (
    Batch,
    BatchError,
    Item,
    Plan,
    jsonl,
    list_page,
    output_order,
    paginate,
    query_arg,
    query_limit,
)
from oncelery.fake_provider.batch_shapes import anthropic_line, batch_json, openai_line
from oncelery.fake_provider.files import FakeFiles
from oncelery.fake_provider.generate import Generator
from oncelery.fake_provider.state import ProviderState, new_call


class FakeBatches:
    """Batches of every provider over the fake's `ProviderState`; the server turns `BatchError` into 4xx.

    Locks: a batch's own lock, then the state's lock (never the other way round), so that a retrieve generating
    answers does not hold up the rest of the fake.
    """

    def __init__(self, state: ProviderState, generator: Generator) -> None:
        self.state = state
        self.generator = generator
        self.files = FakeFiles(state)  # a batch's output and error files are stored with the uploads

    # -- create ----------------------------------------------------------------------------------------------------
    def create(self, plan: Plan) -> Batch:
        """Accept a validated create: count it (per custom_id too), decide its injected failures, and keep it."""
        with self.state.lock:
            knobs, stats = self.state.knobs, self.state.stats
            items = []
            for position, (custom_id, body) in enumerate(plan.lines):
                stats.items_by_custom_id[custom_id] += 1
                fail = (
                    custom_id in knobs.batch_fail_ids or stats.items_by_custom_id[custom_id] <= knobs.batch_fail_first
                )
                items.append(Item(position, custom_id, body, fail))
            hold = None
            if knobs.batch_hold > 0:  # held until the next `release` (of held creates and batches alike)
                knobs.batch_hold -= 1
                hold = self.state.released
            ids = {"openai": "batch_" + uuid.uuid4().hex, "gemini": uuid.uuid4().hex[:24]}
            batch = Batch(
                id=ids.get(plan.provider) or ("msgbatch_01" + uuid.uuid4().hex[:24]),
                provider=plan.provider,
                kind=plan.kind,
                items=items,
                created_at=time.time(),
                seq=next(self.state.sequence),
                polls=max(0, knobs.batch_polls),
                expire=knobs.batch_expire,
                shuffle=knobs.batch_shuffle,
                endpoint=plan.endpoint,
                input_file_id=plan.input_file_id,
                metadata=plan.metadata,
                model=plan.model,
                display_name=plan.display_name,
                status={"openai": "validating", "gemini": "BATCH_STATE_PENDING"}.get(plan.provider, "in_progress"),
                hold=hold,
            )
            self.state.batches[batch.id] = batch
            stats.batches_created[plan.provider] += 1
            stats.batches_submitted += 1
            return batch

    # -- retrieve, cancel, list ------------------------------------------------------------------------------------
    def batch(self, provider: str, batch_id: str) -> Batch:
        """Return a batch of `provider`, or refuse with 404."""
        with self.state.lock:
            batch = self.state.batches.get(batch_id)
        if batch is None or batch.provider != provider:
            raise BatchError(404, f"No batch found with id '{batch_id}'.")
        return batch

    def retrieve(self, provider: str, batch_id: str, base_url: str) -> dict[str, Any]:
        """Advance the batch by one retrieve (see the module's docstring) and return it."""
        batch = self.batch(provider, batch_id)
        with batch.lock:
            self._advance(batch)
            with self.state.lock:
                self.state.stats.batch_retrieves += 1
            return batch_json(batch, base_url)

    def cancel(self, provider: str, batch_id: str, base_url: str) -> dict[str, Any]:
        """Start cancelling the batch (the next retrieve ends it); an ended batch is answered as it is. Gemini has
        no cancelling state: its batch keeps its state until then, and the cancel answers `{}`."""
        batch = self.batch(provider, batch_id)
        with batch.lock:
            if not batch.ended and "cancelling" not in batch.times:
                batch.times["cancelling"] = time.time()
                if provider != "gemini":
                    batch.status = "cancelling" if provider == "openai" else "canceling"
            return {} if provider == "gemini" else batch_json(batch, base_url)

    def delete(self, batch_id: str) -> dict[str, Any]:
        """Delete an ended Anthropic batch (400 while it runs)."""
        batch = self.batch("anthropic", batch_id)
        with batch.lock:
            if not batch.ended:
                raise BatchError(400, f"Batch {batch_id} cannot be deleted while it is processing; cancel it first.")
            with self.state.lock:
                self.state.batches.pop(batch_id, None)
        return {"id": batch_id, "type": "message_batch_deleted"}

    def list_batches(self, provider: str, query: dict[str, list[str]], base_url: str) -> dict[str, Any]:
        """Return a page of the provider's batches, newest first (`after`/`after_id`, `before_id`, `limit`; Gemini:
        `pageSize`, and `pageToken`, the opaque `nextPageToken` of the page before)."""
        if provider == "gemini":
            return self._list_gemini(query, base_url)
        openai = provider == "openai"
        limit = query_limit(query, "limit", 20, 100 if openai else 1000)
        with self.state.lock:
            rows = sorted((b for b in self.state.batches.values() if b.provider == provider), key=lambda b: -b.seq)
        after = query_arg(query, "after" if openai else "after_id")
        before = None if openai else query_arg(query, "before_id")
        page, more = paginate(rows, lambda b: b.id, after, before, limit)
        data = []
        for batch in page:
            with batch.lock:
                data.append(batch_json(batch, base_url))
        return list_page(data, more, openai)

    def _list_gemini(self, query: dict[str, list[str]], base_url: str) -> dict[str, Any]:
        limit = query_limit(query, "pageSize", 50, 1000)
        with self.state.lock:
            rows = sorted((b for b in self.state.batches.values() if b.provider == "gemini"), key=lambda b: -b.seq)
        token = query_arg(query, "pageToken")
        if token is not None and token not in {b.id for b in rows}:
            raise BatchError(400, "Invalid page token.")
        page, more = paginate(rows, lambda b: b.id, token, None, limit)
        operations = []
        for batch in page:
            with batch.lock:
                operations.append(batch_json(batch, base_url))
        # The token is the last batch of the page (opaque to the client, as Google's are).
        return {"operations": operations, **({"nextPageToken": page[-1].id} if more and page else {})}

    def results(self, batch_id: str) -> bytes:
        """Return an ended Anthropic batch's results as JSONL (400 before it ends)."""
        batch = self.batch("anthropic", batch_id)
        with batch.lock:
            if not batch.ended:
                raise BatchError(400, f"Batch {batch_id} has not ended: its results are not available yet.")
            return jsonl(anthropic_line(batch.items[p]) for p in output_order(batch))

    # -- how a batch moves -----------------------------------------------------------------------------------------
    def _advance(self, batch: Batch) -> None:
        if batch.ended:
            return
        gemini = batch.provider == "gemini"
        if batch.hold is not None and "cancelling" not in batch.times:
            with self.state.lock:
                held = self.state.released == batch.hold
            if held:  # running, and not moving: a retrieve while held does not count towards `batch_polls`
                self._reach(batch, "BATCH_STATE_RUNNING" if gemini else "in_progress")
                return
            batch.hold = None
        batch.retrieves += 1
        if "cancelling" in batch.times:
            self._end(batch, "canceled")
            return
        # An expiring batch runs its even positions (Gemini's none: an expired Gemini batch returns no response).
        order = [i for i in batch.items if not batch.expire or (i.position % 2 == 0 and not gemini)]
        if batch.retrieves <= batch.polls:
            self._reach(batch, "BATCH_STATE_RUNNING" if gemini else "in_progress")
            self._run_all(batch, order[: len(order) * batch.retrieves // (batch.polls + 1)])
        elif batch.expire:
            self._end(batch, "expired")
        elif batch.provider == "openai" and batch.status != "finalizing":
            self._run_all(batch, order)
            self._reach(batch, "finalizing")
        else:
            self._end(batch, "completed")

    def _reach(self, batch: Batch, status: str) -> None:
        batch.status = status
        batch.times.setdefault(status, time.time())

    def _end(self, batch: Batch, how: str) -> None:
        """End the batch: `completed` runs what is left; `expired` runs the even positions (Gemini's: none);
        `canceled` runs none."""
        gemini = batch.provider == "gemini"
        if how == "completed" or (how == "expired" and not gemini):
            self._run_all(batch, [i for i in batch.items if how == "completed" or i.position % 2 == 0])
        for item in batch.items:
            if item.outcome is None:
                item.outcome = "expired" if how == "expired" else "canceled"
        if gemini:
            states = {"completed": "SUCCEEDED", "expired": "EXPIRED", "canceled": "CANCELLED"}
            self._reach(batch, f"BATCH_STATE_{states[how]}")
            batch.times.setdefault("ended", time.time())
            return
        openai = batch.provider == "openai"
        self._reach(batch, {"completed": "completed", "expired": "expired", "canceled": "cancelled"}[how])
        if not openai:
            batch.status = "ended"
            batch.times.setdefault("ended", time.time())
            return
        order = [batch.items[p] for p in output_order(batch)]
        done = [i for i in order if i.outcome == "succeeded"]
        failed = [i for i in order if i.outcome != "succeeded"]
        with self.state.lock:
            if done:
                batch.output_file_id = self.files.store(
                    f"{batch.id}_output.jsonl", "batch_output", jsonl(openai_line(i) for i in done)
                ).id
            if failed:
                batch.error_file_id = self.files.store(
                    f"{batch.id}_error.jsonl", "batch_output", jsonl(openai_line(i) for i in failed)
                ).id

    def _run_all(self, batch: Batch, items: Sequence[Item]) -> None:
        for item in items:
            if item.outcome is None:
                self._run(batch, item)

    def _run(self, batch: Batch, item: Item) -> None:
        """Answer one request as its synchronous endpoint would (or fail it, when injected or invalid)."""
        errors: dict[str, Callable[[int, str], dict[str, Any]]] = {
            "openai": wire.openai_error,
            "gemini": wire.gemini_error,
        }
        error = errors.get(batch.provider, wire.anthropic_error)
        # A Gemini request names no model: the batch's path does, and the answer is the synchronous one's.
        body = {**item.body, "model": batch.model} if batch.provider == "gemini" else item.body
        try:
            _, prompt = wire.check_request(batch.kind, body)
            if item.body.get("stream") or item.body.get("background"):
                raise wire.BadRequest("stream and background are not supported in a batch request")
        except wire.BadRequest as exc:
            item.outcome, item.status_code, item.response = "errored", 400, error(400, str(exc))
            return
        if item.fail:
            message = "The server had an error while processing your request (injected)."
            item.outcome, item.status_code, item.response = "errored", 500, error(500, message)
            return
        answer = self.generator(body)
        call = new_call(batch.kind, str(body["model"]), body, prompt, answer, time.monotonic(), _no_wait)
        if batch.kind == "responses":
            response = wire.response_object(call, "incomplete" if call.truncated else "completed")
        elif batch.kind == "chat":
            response = wire.chat_completion(call)
        elif batch.kind == "gemini":
            response = wire.gemini_response(call)
        else:
            response = wire.anthropic_message(call)
        item.outcome, item.status_code, item.response = "succeeded", 200, response
        with self.state.lock:
            self.state.stats.batch_billed_input_tokens += call.input_tokens
            self.state.stats.batch_billed_output_tokens += call.output_tokens


def _no_wait(answer: str) -> float:
    return 0.0
