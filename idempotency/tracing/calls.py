"""The model-call step under tracing: real or replayed, re-attached or repeated, and who records its tokens.

    | what this delivery did for the step | spans                                  | token points                 |
    |-------------------------------------|----------------------------------------|------------------------------|
    | replayed it from its checkpoint     | step span, oncelery.step.replayed=true | oncelery.llm.token.saved     |
    | a real call, a provider span seen   | the provider's span, enriched          | the provider's (see below)   |
    | a real call, no provider span       | `chat {model}` CLIENT span of ours     | gen_ai.client.token.usage    |
    | a predecessor's outcome unknown     | counted on the step span               | oncelery.llm.token.estimated |

Points follow the ledger, not the provider's answer: a row counts once it committed (its call id makes it once), so
with in-process workers the `gen_ai.client.token.usage` sum (ours plus a provider instrumentation's) equals the sum
of the ledger rows that are not `unknown_outcome` estimates, and those estimates equal `oncelery.llm.token.estimated`.

A provider span is a recording span with `gen_ai.operation.name` set to an inference operation: either live when
`self.llm()` is called (the user wraps the step) or live as one of the step's requests leaves (an instrumentation
of the provider's client, oncelery.llm.observe). Ours is made after the call, spanning it, so two never coexist.
The provider's instrumentation is taken to have recorded the tokens when its span wraps the whole step, or when a
span of one of the call's requests carries `gen_ai.usage.*`; else Oncelery records them (CallWatch).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

from oncelery.errors import LeaseLost, RunParked, StoreError
from oncelery.llm.adapters.base import Adapter
from oncelery.llm.observe import watching
from oncelery.tracing.otel import Telemetry, key_digest, mark_error

__all__ = ["CallLog", "traced_llm_step"]

UNKNOWN = "unknown_outcome"
# Operations that name a workflow or an agent, not a call to a model (our own run span under the opt-in is one).
_NOT_A_CALL = frozenset({"invoke_workflow", "invoke_agent", "create_agent", "execute_tool"})
# The conventions' well-known provider names, where ours differ.
_PROVIDERS = {"gemini": "gcp.gemini"}
_OPERATIONS = {"generateContent": "generate_content"}


@dataclass
class CallLog:
    """The ledger rows one model-call step wrote in this delivery, and how many had committed when it was answered."""

    rows: list[dict[str, Any]] = field(default_factory=list)
    answered_at: int | None = None  # rows written before the answer: each committed in a transaction of its own
    called: bool = False  # False: the step was replayed from its checkpoint

    def committed(self, exc: BaseException | None) -> list[dict[str, Any]]:
        """The rows that are in the ledger now: all of them when the step's checkpoint committed (`exc` None)."""
        if exc is None:
            return self.rows
        if self.answered_at is not None:  # the checkpoint's transaction (and the rows in it) rolled back
            return self.rows[: self.answered_at]
        if isinstance(exc, LeaseLost | StoreError) and self.rows:  # the last row's own transaction failed
            return self.rows[:-1]
        return self.rows


def is_provider_span(span: Any) -> bool:
    """Whether `span` is a live `gen_ai` span of a call to a model (attributes readable: an SDK span)."""
    if span is None or not span.is_recording():
        return False
    attributes = getattr(span, "attributes", None) or {}
    operation = attributes.get("gen_ai.operation.name")
    return operation is not None and operation not in _NOT_A_CALL


class CallWatch:
    """Finds the provider spans of one step's requests and puts the run on them while they are live."""

    def __init__(self, tel: Telemetry, outside: Any, base: dict[str, Any]) -> None:
        self.tel = tel
        self.outside = outside is not None
        self.spans: list[Any] = [outside] if outside is not None else []
        self.base = base
        self.notes: dict[str, Any] = {}

    def provider_recorded(self) -> bool:
        """Whether a provider span accounts for the call's tokens: one around the whole step (its maker records
        them), or one around a request that carries `gen_ai.usage.*` (an instrumentation of the client's call that
        only wrapped a background create, which returns no usage, did not record them)."""
        if self.outside:
            return True
        return any(
            "gen_ai.usage.input_tokens" in attributes or "gen_ai.usage.output_tokens" in attributes
            for attributes in (getattr(span, "attributes", None) or {} for span in self.spans)
        )

    def call(self, mode: str, reattached: bool, repeated: str | None) -> None:
        """Remember what the protocol does next, for the provider span of its requests."""
        self.notes = {"oncelery.llm.mode": mode, "oncelery.llm.reattached": reattached}
        if repeated:
            self.notes["oncelery.llm.repeated_reason"] = repeated

    def request(self) -> None:
        """A request leaves: a provider span live now is the provider's record of this call."""
        span = self.tel.current()
        if not is_provider_span(span):
            return
        if all(span is not seen for seen in self.spans):
            self.spans.append(span)
        span.set_attributes({**self.base, **self.notes})


def traced_llm_step(
    tel: Telemetry, task: Any, ctx: Any, name: str, adapter: Adapter, request: Mapping[str, Any],
    run: Callable[[], Any], log: CallLog,
) -> Any:  # fmt: skip
    """Run the model-call step `run` inside its step span and record what it did (see the module's table)."""
    claim = ctx.claim
    base = {
        "oncelery.run_id": claim.run_id,
        "oncelery.key.digest": key_digest(claim.task_name, claim.key, task.app.conf),
        "oncelery.step.name": name,
    }
    outside = tel.current()
    watch = CallWatch(tel, outside if is_provider_span(outside) else None, base)
    started = time.time_ns()
    with tel.step(name, ctx.steps.position, claim.run_id, "llm") as span, watching(watch):
        try:
            result = run()
        except BaseException as exc:
            if isinstance(exc, RunParked):
                span.set_attribute("oncelery.step.parked", True)
            _called(tel, span, watch, adapter, request, log.committed(exc), started)
            raise
        span.set_attribute("oncelery.step.replayed", not log.called)
        if log.called:
            _called(tel, span, watch, adapter, request, log.committed(None), started)
        else:
            _saved(tel, span, adapter, request, result)
    return result


def _labels(tel: Telemetry, adapter: Adapter, request: Mapping[str, Any]) -> dict[str, Any]:
    """The conventions' attributes of a call and of its token points (low cardinality: no run, no key)."""
    provider = _PROVIDERS.get(adapter.provider, adapter.provider)
    return {
        "gen_ai.operation.name": _OPERATIONS.get(adapter.endpoint, "chat"),
        ("gen_ai.provider.name" if tel.opt_in else "gen_ai.system"): provider,
        "gen_ai.request.model": str(request.get("model", "")),
    }


def _row_attributes(row: Mapping[str, Any]) -> dict[str, Any]:
    """What the ledger row says about the call, as span attributes (no prompt, no response: as in the ledger)."""
    attributes: dict[str, Any] = {
        "oncelery.llm.call_id": str(row["call_id"]),
        "oncelery.llm.reattached": bool(row["reattached"]),
        "oncelery.llm.mode": str((row.get("meta") or {}).get("mode", "")),
    }
    if row.get("reason"):
        attributes["oncelery.llm.repeated_reason"] = str(row["reason"])
    if row.get("cost_micros") is not None:
        attributes["oncelery.llm.cost_usd"] = int(row["cost_micros"]) / 1_000_000
    return attributes


def _called(
    tel: Telemetry, step: Any, watch: CallWatch, adapter: Adapter, request: Mapping[str, Any],
    rows: list[dict[str, Any]], started: int,
) -> None:  # fmt: skip
    """Record the committed rows: the real calls' tokens and client spans, the unknown outcomes' estimates."""
    labels = _labels(tel, adapter, request)
    real = [r for r in rows if r.get("reason") != UNKNOWN]
    unknown = [r for r in rows if r.get("reason") == UNKNOWN]
    for row in unknown:
        for kind, tokens in (("input", row["input_tokens"]), ("output", row["output_tokens"])):
            tel.tokens_estimated.add(int(tokens or 0), {**labels, "gen_ai.token.type": kind})
    if unknown:
        step.set_attribute("oncelery.llm.unknown_outcome_calls", len(unknown))
    if not real:
        return
    step.set_attributes({**_row_attributes(real[-1]), "oncelery.llm.calls": len(real)})
    recorded = watch.provider_recorded()
    for row in real:
        usage = {"input": int(row["input_tokens"] or 0), "output": int(row["output_tokens"] or 0)}
        if not recorded:
            for kind, tokens in usage.items():
                tel.token_usage.record(tokens, {**labels, "gen_ai.token.type": kind})
        if not watch.spans:
            _client_span(tel, labels, watch.base, row, usage, started)
    for span in watch.spans:  # the provider's spans of the call: enriched, never doubled by one of ours
        if span.is_recording():
            span.set_attributes({**watch.base, **_row_attributes(real[-1])})


def _client_span(
    tel: Telemetry, labels: dict[str, Any], base: dict[str, Any], row: Mapping[str, Any], usage: dict[str, int],
    started: int,
) -> None:  # fmt: skip
    """The standard client span of a call no instrumentation saw, made after it ended and spanning it."""
    span = tel.tracer.start_span(
        f"{labels['gen_ai.operation.name']} {labels['gen_ai.request.model']}",
        kind=tel.trace.SpanKind.CLIENT,
        start_time=started,
        attributes={
            **labels,
            **base,
            **_row_attributes(row),
            "gen_ai.usage.input_tokens": usage["input"],
            "gen_ai.usage.output_tokens": usage["output"],
        },
    )
    if not row.get("ok", True):
        span.set_attribute("error.type", "provider_call_failed")
        span.set_status(tel.trace.Status(tel.trace.StatusCode.ERROR, str(row.get("error") or "failed")[:64]))
    span.end()


def _saved(tel: Telemetry, step: Any, adapter: Adapter, request: Mapping[str, Any], result: Any) -> None:
    """A replayed step: the tokens its checkpointed answer would have cost again, under Oncelery's own name."""
    if not isinstance(result, Mapping):
        return
    try:
        usage = adapter.usage(result)
    except Exception as exc:  # an answer the adapter cannot read costs the step nothing more than its tokens unsaid
        mark_error(tel.trace, step, exc)
        return
    labels = _labels(tel, adapter, request)
    step.set_attributes(
        {"oncelery.llm.saved_input_tokens": usage.input_tokens, "oncelery.llm.saved_output_tokens": usage.output_tokens}
    )
    for kind, tokens in (("input", usage.input_tokens), ("output", usage.output_tokens)):
        tel.tokens_saved.add(tokens, {**labels, "gen_ai.token.type": kind})
