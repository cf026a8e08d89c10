"""A batch as each provider draws it: OpenAI's Batch object and JSONL lines, Anthropic's MessageBatch and results
lines, Gemini's batch Operation (the shapes, with their sources, are in `batches`' docstring).

Pure functions of a `Batch` as it is now; the caller holds the batch's lock.
"""

from __future__ import annotations

from typing import Any

from oncelery.fake_provider.batch_records import DAY_S, Batch, Item, rfc3339

GEMINI_TYPE = "type.googleapis.com/google.ai.generativelanguage.v1main."
_NOT_RUN = {
    "expired": ("batch_expired", "This request could not be executed before the completion window expired."),
    "canceled": ("batch_cancelled", "This request was not executed because the batch was cancelled."),
}


def batch_json(batch: Batch, base_url: str) -> dict[str, Any]:
    """Return the provider's batch object (OpenAI Batch, Anthropic MessageBatch or Gemini's batch Operation) as it
    is now."""
    outcomes = [i.outcome for i in batch.items]
    if batch.provider == "gemini":
        return gemini_operation(batch, outcomes)
    if batch.provider == "anthropic":
        at = {name: rfc3339(t) for name, t in batch.times.items()}
        return {
            "id": batch.id,
            "type": "message_batch",
            "processing_status": batch.status,
            "request_counts": {
                "processing": outcomes.count(None),
                "succeeded": outcomes.count("succeeded"),
                "errored": outcomes.count("errored"),
                "canceled": outcomes.count("canceled"),
                "expired": outcomes.count("expired"),
            },
            "ended_at": at.get("ended"),
            "created_at": rfc3339(batch.created_at),
            "expires_at": rfc3339(batch.created_at + DAY_S),
            "archived_at": None,
            "cancel_initiated_at": at.get("cancelling"),
            "results_url": f"{base_url}/v1/messages/batches/{batch.id}/results" if batch.ended else None,
        }
    seconds = {name: int(t) for name, t in batch.times.items()}
    validating = batch.status == "validating" or (batch.status == "cancelling" and "in_progress" not in seconds)
    succeeded = outcomes.count("succeeded")
    failed = len(outcomes) - succeeded - outcomes.count(None)
    return {
        "id": batch.id,
        "object": "batch",
        "endpoint": batch.endpoint,
        "errors": None,
        "input_file_id": batch.input_file_id,
        "completion_window": "24h",
        "status": batch.status,
        "output_file_id": batch.output_file_id,
        "error_file_id": batch.error_file_id,
        "created_at": int(batch.created_at),
        "in_progress_at": seconds.get("in_progress"),
        "expires_at": int(batch.created_at) + DAY_S,
        "finalizing_at": seconds.get("finalizing"),
        "completed_at": seconds.get("completed"),
        "failed_at": None,
        "expired_at": seconds.get("expired"),
        "cancelling_at": seconds.get("cancelling"),
        "cancelled_at": seconds.get("cancelled"),
        "request_counts": {
            "total": 0 if validating else len(outcomes),
            "completed": succeeded,
            "failed": failed,
        },
        "metadata": batch.metadata,
    }


def gemini_operation(batch: Batch, outcomes: list[str | None]) -> dict[str, Any]:
    """The batch as a long-running Operation: its GenerateContentBatch as `metadata`; once done, `response`
    (inline responses in input order, no metadata echoed) or, cancelled or expired, `error`."""
    name = f"batches/{batch.id}"
    succeeded = outcomes.count("succeeded")
    failed = outcomes.count("errored")
    at = {state: rfc3339(t) for state, t in batch.times.items()}
    metadata: dict[str, Any] = {
        "@type": GEMINI_TYPE + "GenerateContentBatch",
        "model": f"models/{batch.model}",
        "name": name,
        "displayName": batch.display_name,
        "createTime": rfc3339(batch.created_at),
        "updateTime": rfc3339(max([batch.created_at, *batch.times.values()])),
        "batchStats": {
            "requestCount": str(len(outcomes)),
            "successfulRequestCount": str(succeeded),
            "failedRequestCount": str(failed),
            "pendingRequestCount": str(outcomes.count(None)),
        },
        "state": batch.status,
    }
    if "ended" in at:
        metadata["endTime"] = at["ended"]
    operation: dict[str, Any] = {"name": name, "metadata": metadata, "done": batch.ended}
    if batch.status == "BATCH_STATE_SUCCEEDED":
        entries = [_gemini_entry(item) for item in batch.items]  # input order: the order is the mapping
        operation["response"] = {
            "@type": GEMINI_TYPE + "GenerateContentBatchOutput",
            "inlinedResponses": {"inlinedResponses": entries},
        }
    elif batch.status == "BATCH_STATE_CANCELLED":
        operation["error"] = {"code": 1, "message": "The batch was cancelled."}
    elif batch.status == "BATCH_STATE_EXPIRED":
        operation["error"] = {"code": 4, "message": "The batch expired before its requests ran."}
    return operation


def _gemini_entry(item: Item) -> dict[str, Any]:
    if item.outcome == "succeeded":
        return {"response": item.response}
    return {"error": (item.response or {}).get("error") or {"code": 13, "message": str(item.outcome)}}


def openai_line(item: Item) -> dict[str, Any]:
    """Return the item's line of an OpenAI output or error file (`BatchRequestOutput`)."""
    line: dict[str, Any] = {"id": item.line_id, "custom_id": item.custom_id, "response": None, "error": None}
    if item.outcome in _NOT_RUN:
        code, message = _NOT_RUN[str(item.outcome)]
        line["error"] = {"code": code, "message": message}
    else:
        line["response"] = {"status_code": item.status_code, "request_id": item.request_id, "body": item.response}
    return line


def anthropic_line(item: Item) -> dict[str, Any]:
    """Return the item's line of an Anthropic batch's results (`{custom_id, result}`)."""
    result: dict[str, Any] = {"type": item.outcome}
    if item.outcome == "succeeded":
        result["message"] = item.response
    elif item.outcome == "errored":
        result["error"] = item.response
    return {"custom_id": item.custom_id, "result": result}
