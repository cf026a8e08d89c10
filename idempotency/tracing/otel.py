"""OpenTelemetry traces and metrics that tell a real model call from a replay (the `oncelery[otel]` extra).

Off unless `app.conf.oncelery_otel` is true (else `$ONCELERY_OTEL=1`); off, a delivery pays one cached lookup.
On, spans and points go to the process's global OpenTelemetry providers (the user's SDK set-up, or nothing):

    | span                                   | when                          | parent                                 |
    |----------------------------------------|-------------------------------|----------------------------------------|
    | `oncelery.run {task}` (INTERNAL)       | each delivery of a run        | Celery's task span, where one is live  |
    | `oncelery.step` (INTERNAL)             | each self.step() / self.llm() | the run's span                         |
    | `chat {model}` (CLIENT)                | a real call, no provider span | the step's span                        |

Under OTEL_SEMCONV_STABILITY_OPT_IN=gen_ai_latest_experimental the run's span is the GenAI conventions'
`invoke_workflow {task}`, and the client span names its provider `gen_ai.provider.name` (else `gen_ai.system`).
The model-call part (which call is real, which replayed, and who records its tokens) is oncelery.tracing.calls.
No prompt, response or raw key is ever put on a span: a key is a digest, as in the ledger.
"""

from __future__ import annotations

import hashlib
import hmac
import logging
import os
from collections.abc import Iterator
from contextlib import contextmanager
from importlib.metadata import PackageNotFoundError, version
from typing import Any

from oncelery.errors import ConfigurationError, ExtraMissing
from oncelery.settings import CONF_OTEL, ENV_OTEL, digest_secret

__all__ = [
    "GEN_AI_SEMCONV_VERSION",
    "OPT_IN",
    "SCHEMA_URL",
    "Telemetry",
    "key_digest",
    "otel_enabled",
    "telemetry_of",
]

logger = logging.getLogger("oncelery.task")

# The GenAI semantic conventions this module follows: v1.41.0, the last release of open-telemetry/semantic-conventions
# with docs/gen-ai before the conventions moved to semantic-conventions-genai. `invoke_workflow` is experimental there,
# and its span is being merged into `invoke_agent` (semantic-conventions-genai v0.1.0): hence only under the opt-in.
GEN_AI_SEMCONV_VERSION = "1.41.0"
SCHEMA_URL = f"https://opentelemetry.io/schemas/{GEN_AI_SEMCONV_VERSION}"
OPT_IN = "gen_ai_latest_experimental"
INSTRUMENTATION = "oncelery"
_FALSE = ("", "0", "false", "no", "off")
_TRUE = ("1", "true", "yes", "on")


def otel_enabled(conf: Any) -> bool:
    """Whether tracing is switched on: `app.conf.oncelery_otel`, else $ONCELERY_OTEL (off when neither is set)."""
    value = conf.get(CONF_OTEL) if conf is not None else None
    if value is None:
        value = os.environ.get(ENV_OTEL, "")
    if isinstance(value, bool):
        return value
    raw = str(value).strip().lower()
    if raw in _FALSE:
        return False
    if raw in _TRUE:
        return True
    raise ConfigurationError(f"{CONF_OTEL} / {ENV_OTEL}={value!r}: give true (1) to trace with OpenTelemetry, or 0")


def telemetry_of(task: Any) -> Telemetry | None:
    """The task's Telemetry, or None when off: read once per app configuration (one dict lookup per call after)."""
    conf = task.app.conf
    seen = task.__dict__.get("_oncelery_otel_of")
    if seen is None or seen[0] is not conf:
        seen = (conf, Telemetry.of_process() if otel_enabled(conf) else None)
        task.__dict__["_oncelery_otel_of"] = seen
    return seen[1]  # type: ignore[no-any-return]


def key_digest(task_name: str, key: str, conf: Any = None) -> str:
    """A run's key as put on spans: 16 hex digits of HMAC-SHA256 under the digest secret (sha256 without one)."""
    data = f"{task_name}\x00{key}".encode()
    secret = digest_secret(conf)
    full = hmac.new(secret, data, hashlib.sha256).hexdigest() if secret else hashlib.sha256(data).hexdigest()
    return full[:16]


def _opentelemetry() -> tuple[Any, Any, Any]:
    """`opentelemetry.trace`, `.metrics` and `.context`, or ExtraMissing naming the extra (imported only when on)."""
    try:
        from opentelemetry import context, metrics, trace  # an optional extra: imported only when tracing is on
    except ImportError as exc:
        raise ExtraMissing.of(f"{CONF_OTEL} (OpenTelemetry tracing)", "opentelemetry-api", "otel") from exc
    return trace, metrics, context


def _oncelery_version() -> str:
    try:
        return version("oncelery")
    except PackageNotFoundError:  # a source tree that was never installed
        return "0"


_TELEMETRY: dict[str, Telemetry] = {}


class Telemetry:
    """The tracer and instruments of one process: spans for run attempts and steps; token points (otel_calls)."""

    def __init__(self) -> None:
        trace, metrics, context = _opentelemetry()
        self.trace = trace
        self.context = context
        release = _oncelery_version()
        self.tracer = trace.get_tracer(INSTRUMENTATION, release, schema_url=SCHEMA_URL)
        meter = metrics.get_meter(INSTRUMENTATION, release, schema_url=SCHEMA_URL)
        self.opt_in = OPT_IN in {p.strip() for p in os.environ.get("OTEL_SEMCONV_STABILITY_OPT_IN", "").split(",")}
        # The conventions' own histogram: only real, billable calls no provider instrumentation recorded.
        self.token_usage = meter.create_histogram(
            "gen_ai.client.token.usage",
            unit="{token}",
            description="Number of input and output tokens used",
            explicit_bucket_boundaries_advisory=[1, 4, 16, 64, 256, 1024, 4096, 16384, 65536, 262144, 1048576],
        )
        # Oncelery's own names: what a replayed step saved, and the estimate of a call whose outcome is unknown.
        self.tokens_saved = meter.create_counter(
            "oncelery.llm.token.saved", unit="{token}", description="Tokens a replayed model-call step did not pay"
        )
        self.tokens_estimated = meter.create_counter(
            "oncelery.llm.token.estimated",
            unit="{token}",
            description="Estimated tokens of calls whose outcome is unknown (ledger rows labelled unknown_outcome)",
        )

    @classmethod
    def of_process(cls) -> Telemetry:
        """The process's one Telemetry (the providers are global, so one set of instruments serves every app)."""
        made = _TELEMETRY.get("process")
        if made is None:
            made = _TELEMETRY.setdefault("process", cls())
            logger.info("OpenTelemetry tracing on (GenAI semantic conventions %s)", GEN_AI_SEMCONV_VERSION)
        return made

    def current(self) -> Any:
        """The span live in this context (a non-recording one when none is)."""
        return self.trace.get_current_span()

    @contextmanager
    def run_attempt(self, task_name: str, key_hash: str, tenant: str | None) -> Iterator[Any]:
        """A span around one delivery of a run: a child of whatever span is live (Celery's task span)."""
        name = f"invoke_workflow {task_name}" if self.opt_in else f"oncelery.run {task_name}"
        attributes: dict[str, Any] = {"oncelery.task.name": task_name, "oncelery.key.digest": key_hash}
        if tenant:
            attributes["oncelery.tenant"] = tenant
        if self.opt_in:
            attributes.update({"gen_ai.operation.name": "invoke_workflow", "gen_ai.workflow.name": task_name})
        with self._span(name, attributes) as span:
            yield span

    def attached(self, run_id: int, attempt: int, token: int, takeover: bool) -> None:
        """Put the claimed run on the live run span: its id, attempt, fencing token and whether it was taken over."""
        span = self.current()
        if span.is_recording():
            span.set_attributes(
                {"oncelery.run_id": run_id, "oncelery.run.attempt": attempt, "oncelery.run.fencing_token": token,
                 "oncelery.run.takeover": takeover}
            )  # fmt: skip

    @contextmanager
    def step(self, name: str, position: int, run_id: int, kind: str) -> Iterator[Any]:
        """A span around one step (`kind` "step" or "llm"): not replayed, until its caller finds it was.

        A plain step's span carries only its name, position and whether it was replayed (its run is its parent's);
        each attribute costs about as much as a tenth of the span.
        """
        attributes: dict[str, Any] = {
            "oncelery.step.replayed": False,
            "oncelery.step.name": name,
            "oncelery.step.position": position,
        }
        if kind == "llm":
            attributes.update({"oncelery.step.kind": kind, "oncelery.run_id": run_id})
        with self._span("oncelery.step", attributes) as span:
            yield span

    @contextmanager
    def _span(self, name: str, attributes: dict[str, Any]) -> Iterator[Any]:
        """A current span whose status is ERROR with the exception's type only (a message may hold content).

        A parked run (RunParked, a BaseException) or a retry is not an error of the span. Made and made current
        by hand, not with start_as_current_span: its two nested context managers cost as much as the span.
        """
        span = self.tracer.start_span(name, attributes=attributes)
        token = self.context.attach(self.trace.set_span_in_context(span))
        try:
            yield span
        except Exception as exc:
            mark_error(self.trace, span, exc)
            raise
        finally:
            self.context.detach(token)
            span.end()


# Celery's Retry, Ignore (a delivery that re-sent its job) and Reject, and a key held elsewhere.
_CONTROL = frozenset({"Retry", "Ignore", "Reject", "InProgress"})


def mark_error(trace: Any, span: Any, exc: BaseException) -> None:
    """Set the span's status to ERROR and `error.type` to the exception's class (never its message)."""
    kind = type(exc).__name__
    if kind in _CONTROL:  # how a delivery hands its run on (a retry, a re-send, a held key), not a failure
        span.set_attribute("oncelery.delivery.handed_off", kind)
        return
    span.set_attribute("error.type", f"{type(exc).__module__}.{type(exc).__qualname__}")
    span.set_status(trace.Status(trace.StatusCode.ERROR, kind))
