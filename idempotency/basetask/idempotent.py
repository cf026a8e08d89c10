"""`IdempotentTask`: the Celery Task base that turns at-least-once delivery into exactly-once effects.

The task decides *what happens* on each claim decision; `RunStore` decides *how* a claim is written.
This module is the Celery glue: sending a call and receiving a delivery. The class is built in layers, one
module each: `options` (what a task declares, resolved per call) <- `announce` (outcomes for the caller and
Flower) <- `body` (the API a body calls on `self`) <- `call_checks` (what a call is refused before it is sent)
<- `idempotent` (this one).
"""

from __future__ import annotations

import json
import logging
import math
import threading
from typing import Any

from celery._state import _task_stack
from celery.exceptions import Ignore, Retry
from celery.utils.quorum_queues import detect_quorum_queues
from celery.utils.serialization import raise_with_context
from kombu.utils import json as kombu_json

from oncelery.basetask.call_checks import CallChecks
from oncelery.basetask.debounce import send_debounced
from oncelery.basetask.heartbeat import watch_worker_heartbeat
from oncelery.basetask.options import CALL_OPTIONS, check_option_names
from oncelery.basetask.producer import answer_at_producer, producer_dedupe_on
from oncelery.basetask.revoke import cancel_run_calls, watch_revokes
from oncelery.basetask.startup import watch_worker_start
from oncelery.delivery.decision_table import Delivery
from oncelery.delivery.delivered import UNFIXABLE_ERRORS, Call
from oncelery.delivery.resend import after_store_fault, can_resend, wait_backoff
from oncelery.errors import ConfigurationError, ForkRefused, OnceleryError, StoreError
from oncelery.ledger.unknown import UNKNOWN_OUTCOME
from oncelery.runs.debounce import DebounceMark
from oncelery.runs.decisions import REASON_BAD_MESSAGE, EntityVersionOf
from oncelery.runs.faults import fault_point
from oncelery.runs.forks import ForkSpec, fork_id_of, fork_mismatch, load_fork
from oncelery.runs.keys import Identity, pipeline_link_key, validate_key
from oncelery.settings import (
    HEADER_ABANDONED,
    HEADER_DEBOUNCE_KEY,
    HEADER_DEBOUNCE_SEQ,
    HEADER_FORK,
    HEADER_KEY,
    HEADER_LEASE,
    HEADER_ON_IN_PROGRESS,
    HEADER_PIPELINE,
    HEADER_PIPELINE_LINK,
    HEADER_TENANT,
    HEADER_WAITING_SINCE,
    HEADER_WAITS,
    check_lease,
    check_policy,
    pass_through,
)
from oncelery.tracing.otel import key_digest, telemetry_of

__all__ = [
    "IdempotentTask",
]

logger = logging.getLogger("oncelery.task")  # a stable name (users filter on it)

# Headers a call's options travel in, kept with a run's message so a replay or a sweep sends them again.
_CALL_HEADERS = (
    HEADER_KEY,
    HEADER_TENANT,
    HEADER_ON_IN_PROGRESS,
    HEADER_LEASE,
    HEADER_DEBOUNCE_KEY,
    HEADER_DEBOUNCE_SEQ,
    HEADER_FORK,  # a fork is recognised by it alone: a kept message, a letter and a wake must carry it
    HEADER_PIPELINE,  # with the link's position: where a run stored under a pipeline-derived key is looked up
    HEADER_PIPELINE_LINK,
)


class IdempotentTask(CallChecks):
    """A Celery task whose body's committed effects and stored result happen once per idempotency key."""

    # -- producer side ---------------------------------------------------------------------------

    def apply_async(self, args: Any = None, kwargs: Any = None, *a: Any, **options: Any) -> Any:
        """Send the task; refuse at once what a worker would refuse (bad key, non-JSON payload).

        `idempotency_key=` and `tenant=` travel as headers (Celery drops unknown options). Where the producer has a
        claims database configured, a duplicate of a finished run is answered without publishing (a
        `ProducerReplay` holding its result), and a run in progress that will be re-sent anyway returns its own
        AsyncResult (`producer_dedupe=False` turns the check off for one call; oncelery.basetask.producer).
        """
        check_option_names(options, CALL_OPTIONS, f"{self.name}: apply_async option")  # Celery drops typos
        key = options.pop("idempotency_key", None)
        tenant = options.pop("tenant", None)
        policy = options.pop("on_in_progress", None)
        lease = options.pop("lease", None)
        dedupe = options.pop("producer_dedupe", None)
        headers = dict(options.get("headers") or {})
        self.settings()  # a misspelt oncelery_* setting is refused here, at the first call
        tenant = self.entry_tenant(args, kwargs, tenant, headers)
        if key is not None:
            headers[HEADER_KEY] = validate_key(key)
        if tenant is not None:
            headers[HEADER_TENANT] = validate_key(tenant, "tenant") if tenant else tenant
        if policy is not None:
            headers[HEADER_ON_IN_PROGRESS] = check_policy(policy, f"{self.name} (this call)")
        if lease is not None:
            headers[HEADER_LEASE] = check_lease(lease, f"{self.name} (this call)")
        if headers:
            options["headers"] = headers
        seen = self._check_at_call_time(args, kwargs, key, tenant, options.get("serializer"))
        if seen is not None and not a and self.debounce is not None:
            # An edit of a debounced key: recorded, not published; the burst's handle (oncelery.basetask.debounce).
            handle = send_debounced(self, seen[0], seen[1], headers, options)
            if handle is not None:
                return handle
        if seen is not None and not a and producer_dedupe_on(self, dedupe):
            # A duplicate the claims database answers is never published (oncelery.basetask.producer).
            answered = answer_at_producer(self, seen[0], seen[1], headers, options)
            if answered is not None:
                return answered
        return super().apply_async(args, kwargs, *a, **options)

    # -- worker side -----------------------------------------------------------------------------

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        """Run the body at most once per key: claim, execute or answer from the stored result."""
        top = self.request_stack.top
        if top is not None and not top.called_directly:
            return self._guarded(args, kwargs, direct=False)
        # Called directly (not by a worker): give it a request of its own, as Task.__call__ does.
        _task_stack.push(self)
        self.push_request(args=args, kwargs=kwargs)
        try:
            return self._guarded(args, kwargs, direct=True)
        finally:
            self.pop_request()
            _task_stack.pop()

    def _guarded(self, args: tuple[Any, ...], kwargs: dict[str, Any], direct: bool) -> Any:
        headers = self.request.headers or {}
        if pass_through():
            return self._pass_through(args, kwargs)
        explicit = {name: headers[name] for name in _CALL_HEADERS if headers.get(name) is not None}
        # What a replay from the dead-letter queue (or a sweeper) sends again: the arguments and key headers.
        message: dict[str, Any] = {"args": list(args), "kwargs": kwargs, "headers": explicit}
        req = self.request
        queue = (req.delivery_info or {}).get("routing_key")
        if queue:
            message["queue"] = queue
        # A chain link's continuation: a replayed or swept link goes on down its pipeline.
        for option, value in (("chain", req.chain), ("link", req.callbacks), ("link_error", req.errbacks)):
            if value:
                message[option] = value
        try:
            ident, entity, version, fork = self._identify(args, kwargs, explicit, message)
        except StoreError as exc:  # e.g. the digest secret could not be read: a store fault, not a bad message
            return after_store_fault(exc, f"before claiming {self.name}", can_resend(req, direct), self._send_again)
        try:
            lease, policy = self.lease_for(explicit), self.policy_for(explicit)
        except ConfigurationError as exc:  # a bad setting: no delivery can run until it is fixed
            logger.error("%s: %s", self.name, exc)
            raise
        keeps_arguments = self._keeps_arguments()
        call = Call(
            ident,
            message,
            keep_message=keeps_arguments or self._keeps_messages(),
            keep_arguments=keeps_arguments,
            entity=entity,
            version=version,
            direct=direct,
            abandoned=headers.get(HEADER_ABANDONED),
            lease=lease,
            policy=policy,
            waiting_since=_epoch_header(headers.get(HEADER_WAITING_SINCE)),
            debounce=self._debounce_mark(explicit),
            fork=fork,
        )
        tel = telemetry_of(self)
        if tel is None:
            return Delivery(self, call, self._send_again).run(args, kwargs)
        with tel.run_attempt(self.name, key_digest(self.name, ident.key, self.app.conf), ident.tenant):
            return Delivery(self, call, self._send_again).run(args, kwargs)

    def _debounce_mark(self, headers: dict[str, Any]) -> DebounceMark | None:
        """The edit a debounced burst's message carries (its key and sequence), or None (any other message)."""
        key, seq = headers.get(HEADER_DEBOUNCE_KEY), headers.get(HEADER_DEBOUNCE_SEQ)
        if self.debounce is None or key is None or not isinstance(seq, int) or isinstance(seq, bool):
            return None
        return DebounceMark(str(key), seq, self.debounce.on_running == "supersede")

    def _identify(
        self, args: tuple[Any, ...], kwargs: dict[str, Any], explicit: dict[str, Any], message: Any
    ) -> tuple[Identity, str | None, EntityVersionOf | None, ForkSpec | None]:
        """The delivery's identity, entity, version and fork; a message without them is dead-lettered, with why.

        A run (or entity version) stored before keyed digests and injective keys is found in its old forms, and
        the delivery is then that run's (runs/legacy.py: a lookup only while such runs may remain).
        """
        try:
            ident = self.identity_of(args, kwargs, explicit.get(HEADER_KEY), explicit.get(HEADER_TENANT))
            entity = self._concurrency_keys.named(args, kwargs)[0] if self._concurrency_keys else None
            version = self.version_of(args, kwargs)
            ident = self.store.legacy.identity(self.name, ident)
            ident = self._as_link_stored(ident, explicit)
            version = self.store.legacy.entity(self.name, ident.tenant, version)
            fork = self._fork_of(ident, explicit.get(HEADER_FORK))
            if fork is not None:  # a fork re-runs the past: never production's entity slot
                entity, version = None, None
        except StoreError:
            raise
        except OnceleryError as exc:
            # No run can hold a delivery without an identity; it can never succeed: dead-letter it, say why.
            logger.error("%s: refused a delivery whose identity cannot be derived: %s", self.name, exc)
            fault_point("dead_letter", task=self.name, key=None)
            self.store.letter_without_run(
                self.name, explicit.get(HEADER_TENANT, ""), REASON_BAD_MESSAGE, str(exc), _storable(message)
            )
            raise
        return ident, entity, version, fork

    def _as_link_stored(self, ident: Identity, explicit: dict[str, Any]) -> Identity:
        """A pipeline link keyed by its own task: `ident`, or its pipeline-derived key if only that has a run (stored
        before links kept their own keys: runs/legacy.py). Any other delivery: `ident`, with no read."""
        pipeline_key, position = explicit.get(HEADER_PIPELINE), explicit.get(HEADER_PIPELINE_LINK)
        if not isinstance(pipeline_key, str) or not isinstance(position, int) or isinstance(position, bool):
            return ident
        return self.store.legacy.link(self.name, ident, pipeline_link_key(pipeline_key, position, self.name))

    def _fork_of(self, ident: Identity, header: Any) -> ForkSpec | None:
        """The fork this delivery runs, or None (production's): recognised by the fork command's header alone, and
        only if its fork row names this task, tenant and key. A fork-shaped key without it is refused, not run:
        it would share a fork's run (its checkpoints, its source's steps) without being that fork."""
        if header is None:
            if fork_id_of(ident.key) is not None:
                unsent = "its key names a fork, without the fork command's header"
                raise ForkRefused.not_sent_as_fork(self.name, ident.key, unsent)
            return None
        if isinstance(header, bool) or not isinstance(header, int):
            raise ForkRefused.not_sent_as_fork(self.name, ident.key, f"its fork header is {header!r}, not a fork id")
        fault_point("fork_load", task=self.name, key=ident.key)
        spec = load_fork(self.store.db, header)
        why = fork_mismatch(spec, header, self.name, ident.tenant, ident.key)
        if why is not None:
            raise ForkRefused.not_sent_as_fork(self.name, ident.key, why)
        return spec

    def _send_again(
        self, exc: BaseException | None, abandoned: str | None = None, waiting_since: float | None = None
    ) -> Any:
        """Re-send this message with backoff, without spending the task's max_retries, and ack this one.

        `abandoned`: the owner this delivery claimed as before a store fault; the re-send names it, so
        taking its run over is not counted as a lost delivery (a poison message). `waiting_since`: the message
        begins to wait for a live holder now (its re-checks carry it and count no more `in_progress`).
        """
        req = self.request
        headers = dict(req.headers or {})
        waits = int(headers.get(HEADER_WAITS, 0))
        headers[HEADER_WAITS] = waits + 1
        if abandoned is not None:
            headers[HEADER_ABANDONED] = abandoned
        if waiting_since is not None:
            headers[HEADER_WAITING_SINCE] = waiting_since
        delay = self._deliverable_countdown(wait_backoff(waits))
        # Same task id and the same `retries` count: waiting on a live holder is not a failure.
        sig = self.signature_from_request(req, countdown=delay, retries=req.retries, headers=headers)
        # Sent as it came, without apply_async's caller-side checks: they passed when it was first sent (so
        # each wait would only repeat them), and a message that fails them (no identity) must still go back.
        options = dict(self._get_exec_options(), **sig.options)
        self.app.send_task(self.name, sig.args, sig.kwargs, task_type=self, result_cls=self.AsyncResult, **options)
        if exc is None:
            # A wait (or a lost lease answered by the new holder) is not a failure: Ignore makes the worker ack
            # this delivery without a task-retried event (which Flower shows with a traceback); the caller's
            # result stays pending until the copy just sent decides it.
            raise Ignore()
        # A store fault: Retry makes the worker ack this delivery and mark the task RETRY, with the error.
        raise Retry(exc=exc, when=delay, sig=sig)

    def _deliverable_countdown(self, delay: float) -> float:
        """`delay`, or whole seconds where Celery routes a countdown through RabbitMQ's native delayed delivery.

        With quorum queues on a topic exchange, Celery (5.7) sends a countdown as a routing key of int(countdown)
        seconds, and kombu refuses 0: a wait of 0.25-0.99 s raised ValueError, and the delivery that should have
        been sent again was acked as a failure. That delivery's resolution is one second anyway.
        """
        if delay >= 1 or delay <= 0:
            return delay
        seen = self.__dict__.get("_native_delay")
        if seen is None or seen[0] is not self.app.conf:
            try:
                driver = self.app.producer_pool.connections.connection.transport.driver_type
                native = bool(detect_quorum_queues(self.app, driver)[0])
            except Exception:  # no broker connection object to ask: as on any broker but RabbitMQ's quorum queues
                native = False
            seen = (self.app.conf, native)
            self.__dict__["_native_delay"] = seen
        return float(math.ceil(delay)) if seen[1] else delay

    def retry(self, args: Any = None, kwargs: Any = None, exc: BaseException | None = None, *a: Any, **kw: Any) -> Any:
        """Celery's retry, except that an error which can never succeed is raised at once (the run goes DEAD).

        Covers autoretry_for=(Exception,) too: a dead_on error (or StepMismatch, ResultNotJSON, a
        ConfigurationError) is not retried max_retries times for nothing.
        """
        if exc is not None and isinstance(exc, UNFIXABLE_ERRORS + tuple(self.dead_on)):
            raise_with_context(exc)
        return super().retry(args, kwargs, exc, *a, **kw)

    def cancel_calls(self, run_id: int, why: str, label: str) -> int:
        """Ask the provider to stop the ended run's calls in flight, best effort (each is on the books, `label`)."""
        return cancel_run_calls(self, run_id, why, label)

    def stop_calls_later(self, run_id: int, why: str) -> None:
        """Ask the provider to stop the ended run's calls off this thread: a provider's cancel never delays a
        delivery, and its failure changes nothing (the calls are on the books already)."""

        def stop() -> None:
            try:
                self.cancel_calls(run_id, why, UNKNOWN_OUTCOME)
            except Exception as exc:  # best effort: the run has ended whatever its calls do
                logger.warning("%s: calls of ended run %d not cancelled: %s", self.name, run_id, exc)

        threading.Thread(target=stop, name="oncelery-cancel", daemon=True).start()

    def outcome_counts(self) -> dict[str, int]:
        """Return this task's exact delivery outcome counts across all processes."""
        return self.store.outcome_counts(self.name)


def _storable(message: dict[str, Any]) -> Any:
    """`message` as JSON a letter can store, even when a producer without Oncelery's checks sent a datetime, a
    UUID or a Decimal: in kombu's JSON form, which a replay sends again as the same value (else their repr)."""
    try:
        return json.loads(kombu_json.dumps(message))
    except (TypeError, ValueError):  # not even kombu's JSON (a pickled object): a letter that says what it was
        return json.loads(json.dumps(message, default=repr))


def _epoch_header(value: Any) -> float | None:
    # A header another producer mangled is no wait at all: the delivery then counts its own first wait.
    try:
        return float(value) if value is not None else None
    except (TypeError, ValueError):
        return None


# A worker whose app has idempotent tasks checks its claims database before it consumes anything.
watch_worker_start(IdempotentTask)
watch_worker_heartbeat()  # $ONCELERY_HEARTBEAT_FILE: the container's health check
watch_revokes(IdempotentTask)  # a revoked wake cancels its parked run and the run's calls in flight
