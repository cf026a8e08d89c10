"""What the fake provider remembers: its knobs, every call it accepted, its rate-limit windows and its counters.

Times are the provider's own monotonic clock: the fake is the other side of the wire, not our database.
"""

from __future__ import annotations

import hashlib
import itertools
import math
import threading
import time
import uuid
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field, fields
from typing import Any

from oncelery.fake_provider.batch_records import Batch, StoredFile
from oncelery.token_count import count_tokens, output_limit, truncate_tokens

#: The metadata key whose value the fake counts creates by (the opaque intent id a client sends).
INTENT_KEY = "oncelery_intent"
#: Anthropic's metadata allows `user_id` only: an intent id travels there, prefixed so it is recognised.
ANTHROPIC_INTENT_PREFIX = "oncelery-intent:"
WINDOW_S = 60.0  # rate limits are per minute, as every provider states them


class KnobError(ValueError):
    """Raised when a knob is unknown or has a value of the wrong type (the message names the knobs there are)."""


@dataclass
class Knobs:
    """How the fake behaves; every field can be changed while it runs (`FakeProviderControl.set_knobs`)."""

    generation_s: float = 0.0  # how long a response takes to complete after its create
    generation_max_s: float = 0.0  # above generation_s: each call takes between the two (fixed per call)
    poll_after_ms: int = 100  # the `openai-poll-after-ms` hint on background answers
    retention_s: float = 600.0  # a background response without store=true is gone this long after it ends
    stored_retention_s: float = 30 * 86400.0  # a stored response (store=true, the foreground default)
    stuck_queued: bool = False  # new background responses stay `queued` for ever
    complete_after_cancel: bool = False  # a cancelled response still ends `completed` (seen at OpenAI)
    cancel_status: int = 0  # non-zero: every cancel is answered with this HTTP status (500, 404) and cancels nothing
    hold_creates: int = 0  # accept the next N creates but hold their answers until `release`
    hold_timeout_s: float = 60.0
    fail_next: int = 0  # answer the next N model requests with `fail_status` (nothing is created)
    fail_status: int = 429
    retry_after_s: float = 1.0
    hang_next: int = 0  # accept the next N model requests, then answer only after `hang_s` (a client timeout)
    hang_s: float = 30.0
    rpm_limit: int = 0  # requests per minute per model (0: unlimited); over it: 429 with retry-after
    tpm_limit: int = 0  # tokens (input + max output) per minute per model (0: unlimited)
    rate_window_s: float = WINDOW_S  # the limits' fixed window: 60 s as providers state it; shorter compresses time
    # Batches (time compressed: each retrieve of a batch advances it). Read when a batch is created.
    batch_polls: int = 2  # retrieves a batch stays in progress; the next one finalizes (OpenAI) or ends it
    batch_fail_ids: list[str] = field(default_factory=list)  # custom_ids that fail (a 500 item) in every batch
    batch_fail_first: int = 0  # the first N submissions of each custom_id fail, later ones succeed (re-queues)
    batch_expire: bool = False  # batches expire: items at even positions done, the others expired (Gemini: none)
    batch_shuffle: bool = False  # result lines come out of input order (not Gemini's: its order is the mapping)
    batch_hold: int = 0  # the next N batches created stay in progress, none of their requests run, until `release`

    def update(self, changes: dict[str, Any]) -> None:
        """Apply `changes`, all or none, refusing unknown names and values of the wrong type."""
        types = {f.name: type(getattr(self, f.name)) for f in fields(self)}
        unknown = sorted(set(changes) - set(types))
        if unknown:
            raise KnobError(f"unknown knob(s) {unknown}; knobs are {sorted(types)}")
        checked: dict[str, Any] = {}
        for name, value in changes.items():
            want = types[name]
            if want is list:
                if not isinstance(value, list) or not all(isinstance(v, str) for v in value):
                    raise KnobError(f"knob {name} takes a list of strings, not {value!r}")
                checked[name] = list(value)
                continue
            ok = (
                isinstance(value, bool)
                if want is bool
                else isinstance(value, (int, float)) and not isinstance(value, bool)
            )
            if not ok or (want is int and not float(value).is_integer()):
                raise KnobError(f"knob {name} takes a {want.__name__}, not {value!r}")
            checked[name] = want(value)
        for name, value in checked.items():
            setattr(self, name, value)


@dataclass
class Call:
    """One accepted create: a response (foreground or background), a chat completion or a message."""

    id: str
    kind: str  # "responses" | "chat" | "messages"
    model: str
    request: dict[str, Any]
    text: str
    input_tokens: int
    output_tokens: int
    truncated: bool
    created: float  # monotonic
    created_at: int  # epoch seconds, as the providers report it
    ends: float  # monotonic time the answer is complete
    background: bool = False
    store: bool = True
    stuck: bool = False
    cancelled: bool = False
    finished_by_cancel: bool = False

    def status(self, now: float) -> str:
        """Return the Responses API status at `now`: queued, in_progress, completed, incomplete or cancelled."""
        if self.cancelled and not self.finished_by_cancel:
            return "cancelled"
        if self.stuck:
            return "queued"
        if now < self.ends:
            return "queued" if now < self.created + (self.ends - self.created) / 10 else "in_progress"
        return "incomplete" if self.truncated else "completed"

    def gone(self, now: float, knobs: Knobs) -> bool:
        """Return whether the provider has dropped this response (retrieve answers 404)."""
        if not self.store and not self.background:
            return True  # a foreground response with store=false is never retrievable
        keep = (
            knobs.stored_retention_s if self.request.get("store") is True or not self.background else knobs.retention_s
        )
        return self.status(now) not in ("queued", "in_progress") and now > max(self.ends, self.created) + keep


SEEN_REQUESTS = 50  # requests the counters keep (`Stats.requests_seen`)


@dataclass
class Stats:
    """The fake's counters: the oracle of what a real provider would have billed and served."""

    creates: Counter[str] = field(default_factory=Counter)  # per endpoint kind
    creates_by_intent: Counter[str] = field(default_factory=Counter)
    creates_without_intent: int = 0
    polls: int = 0
    stream_resumes: int = 0
    cancels: int = 0
    cancels_refused: int = 0  # cancels answered with `cancel_status` (nothing cancelled)
    errors_served: Counter[str] = field(default_factory=Counter)  # per HTTP status, as strings (JSON keys)
    rate_limited: int = 0  # 429s served by the rate-limit windows (not by `fail_next`)
    held: int = 0  # answers held right now
    billed_input_tokens: int = 0
    billed_output_tokens: int = 0
    batches_submitted: int = 0  # batches created, every provider
    batches_created: Counter[str] = field(default_factory=Counter)  # per provider: "openai", "anthropic", "gemini"
    # How many times each custom_id was submitted in a created batch: the "processed exactly once" oracle.
    items_by_custom_id: Counter[str] = field(default_factory=Counter)
    files_uploaded: int = 0
    files_deleted: int = 0
    batch_retrieves: int = 0  # retrieves of a batch (each one advances it), every provider
    # Billed for batch items that succeeded, apart from the synchronous bill above.
    batch_billed_input_tokens: int = 0
    batch_billed_output_tokens: int = 0
    forgotten: int = 0  # calls dropped by `forget` (a test's "past retention, now")
    # The most calls generating at once, seen at each create: above the callers' worker slots, callers let go of
    # their slots while the provider worked (parked runs), instead of each blocking on its call.
    max_in_flight: int = 0
    # The last `SEEN_REQUESTS` model-API requests as they arrived: method, path, query string and headers (names
    # lower-cased), so a test can see what an adapter put on the wire (custom headers, Azure's `api-key`).
    requests_seen: list[dict[str, Any]] = field(default_factory=list)

    def saw(self, method: str, target: str, headers: dict[str, str]) -> None:
        """Record one request (the oldest is dropped past `SEEN_REQUESTS`)."""
        path, _, query = target.partition("?")
        self.requests_seen.append({"method": method, "path": path, "query": query, "headers": headers})
        del self.requests_seen[:-SEEN_REQUESTS]

    def as_json(self) -> dict[str, Any]:
        """Return the counters as a JSON-ready dict."""
        # Not dataclasses.asdict: it rebuilds a Counter from (key, value) pairs, counting the pairs.
        return {f.name: dict(v) if isinstance(v := getattr(self, f.name), Counter) else v for f in fields(self)}


class RateWindow:
    """Fixed one-minute windows of requests and tokens per model, as the `x-ratelimit-*` headers describe."""

    def __init__(self) -> None:
        self.start: dict[str, float] = {}
        self.requests: Counter[str] = Counter()
        self.tokens: Counter[str] = Counter()

    def admit(self, model: str, tokens: int, knobs: Knobs, now: float) -> float | None:
        """Count a request of `tokens` against `model`'s window; return seconds to wait when it is over a limit."""
        start = self.start.get(model)
        window = knobs.rate_window_s
        if start is None or now - start >= window:
            self.start[model], self.requests[model], self.tokens[model] = now, 0, 0
            start = now
        over_requests = knobs.rpm_limit and self.requests[model] + 1 > knobs.rpm_limit
        over_tokens = knobs.tpm_limit and self.tokens[model] + tokens > knobs.tpm_limit
        if over_requests or over_tokens:
            return max(0.0, start + window - now)
        self.requests[model] += 1
        self.tokens[model] += tokens
        return None

    def give_back(self, model: str, tokens: int, started: float | None) -> None:
        """Uncount `tokens` of a request admitted in the window that began at `started` (if it still runs)."""
        if started is not None and self.start.get(model) == started:
            self.tokens[model] = max(0, self.tokens[model] - tokens)

    def headers(self, model: str, knobs: Knobs, now: float) -> dict[str, int | float]:
        """Return limit, remaining and reset (seconds) of requests and tokens for `model`'s current window."""
        reset = max(0.0, self.start.get(model, now) + knobs.rate_window_s - now)
        return {
            "limit_requests": knobs.rpm_limit,
            "remaining_requests": max(0, knobs.rpm_limit - self.requests[model]),
            "limit_tokens": knobs.tpm_limit,
            "remaining_tokens": max(0, knobs.tpm_limit - self.tokens[model]),
            "reset_s": reset,
        }


class ProviderState:
    """The fake's whole state behind one lock: knobs, calls by id, rate windows, counters, held answers."""

    def __init__(self, knobs: Knobs | None = None) -> None:
        self.lock = threading.Condition()
        self.knobs = knobs or Knobs()
        self.calls: dict[str, Call] = {}
        self.window = RateWindow()
        self.stats = Stats()
        self.released = 0  # held answers released so far (a generation counter the holders wait on)
        # Batch APIs (`files`, `batches`): uploaded and produced files, batches of every provider, one creation order.
        self.files: dict[str, StoredFile] = {}
        self.batches: dict[str, Batch] = {}
        self.sequence = itertools.count()

    def now(self) -> float:
        """Return the provider's clock (monotonic seconds)."""
        return time.monotonic()

    def injected_failure(self) -> tuple[int, float] | None:
        """Take one injected failure (`fail_next`) if any is left: (HTTP status, retry-after seconds)."""
        with self.lock:
            if self.knobs.fail_next <= 0:
                return None
            self.knobs.fail_next -= 1
            status = self.knobs.fail_status
            self.stats.errors_served[str(status)] += 1
            return status, self.knobs.retry_after_s

    def admit(self, model: str, tokens: int) -> float | None:
        """Count a request against the rate windows; return the wait in seconds (a 429) when over a limit."""
        with self.lock:
            wait = self.window.admit(model, tokens, self.knobs, self.now())
            if wait is not None:
                self.stats.rate_limited += 1
                self.stats.errors_served["429"] += 1
            return wait

    def window_of(self, model: str) -> float | None:
        """When `model`'s current rate window began (None: no request counted yet)."""
        with self.lock:
            return self.window.start.get(model)

    def give_back(self, model: str, tokens: int, started: float | None) -> None:
        """Uncount the output tokens a finished call did not produce (Anthropic's output-token limit does)."""
        with self.lock:
            self.window.give_back(model, tokens, started)

    def rate_headers(self, model: str) -> dict[str, int | float] | None:
        """Return the current window's figures for `model`, or None when no limit is set."""
        with self.lock:
            if not (self.knobs.rpm_limit or self.knobs.tpm_limit):
                return None
            return self.window.headers(model, self.knobs, self.now())

    def create(
        self, kind: str, model: str, request: dict[str, Any], prompt: str, answer: str, intent: str | None
    ) -> Call:
        """Accept a create: count it (per intent too), fix its answer and when it completes, and keep it."""
        with self.lock:
            now = self.now()
            call = new_call(kind, model, request, prompt, answer, now, self._generation_s)
            call.stuck = call.background and self.knobs.stuck_queued
            self.calls[call.id] = call
            generating = sum(1 for c in self.calls.values() if c.status(now) in ("queued", "in_progress"))
            self.stats.max_in_flight = max(self.stats.max_in_flight, generating)
            self.stats.creates[kind] += 1
            if intent:
                self.stats.creates_by_intent[intent] += 1
            else:
                self.stats.creates_without_intent += 1
            # Billed as accepted: a provider charges a create that completes even if no one reads the answer.
            self.stats.billed_input_tokens += call.input_tokens
            self.stats.billed_output_tokens += call.output_tokens
            return call

    def _generation_s(self, answer: str) -> float:
        """A call's generation time: generation_s, or spread up to generation_max_s by the answer's digest."""
        low, high = self.knobs.generation_s, self.knobs.generation_max_s
        if high <= low:
            return low
        fraction = int(hashlib.sha256(answer.encode()).hexdigest()[:8], 16) / 0xFFFFFFFF
        return low + (high - low) * fraction

    def hold(self) -> bool:
        """Hold this create's answer until `release` (or the hold timeout) if a hold is armed; say if it was."""
        with self.lock:
            if self.knobs.hold_creates <= 0:
                return False
            self.knobs.hold_creates -= 1
            self.stats.held += 1
            seen = self.released
            deadline = self.now() + self.knobs.hold_timeout_s
            while self.released == seen and self.now() < deadline:
                self.lock.wait(timeout=max(0.0, deadline - self.now()))
            self.stats.held -= 1
            return True

    def release(self) -> int:
        """Release every held answer (and every batch held by `batch_hold`); return how many answers were held."""
        with self.lock:
            held = self.stats.held
            self.released += 1
            self.lock.notify_all()
            return held

    def hang(self) -> float:
        """Take one injected hang (`hang_next`) if any is left: the seconds to wait before answering."""
        with self.lock:
            if self.knobs.hang_next <= 0:
                return 0.0
            self.knobs.hang_next -= 1
            return self.knobs.hang_s

    def find(self, call_id: str) -> Call | None:
        """Return a retrievable call by id (None once the provider has dropped it, as a 404)."""
        with self.lock:
            call = self.calls.get(call_id)
            if call is None or call.gone(self.now(), self.knobs):
                return None
            return call

    def cancel(self, call: Call) -> None:
        """Cancel a background response (idempotent; best effort when `complete_after_cancel` is on)."""
        with self.lock:
            self.stats.cancels += 1
            if call.status(self.now()) in ("queued", "in_progress") or call.stuck:
                call.cancelled = True
                call.stuck = False
                call.finished_by_cancel = self.knobs.complete_after_cancel

    def forget(self, call_id: str | None = None) -> int:
        """Drop one call (or every call) as a provider past its retention does; return how many were dropped."""
        with self.lock:
            gone = [call_id] if call_id is not None else list(self.calls)
            dropped = sum(1 for c in gone if self.calls.pop(c, None) is not None)
            self.stats.forgotten += dropped
            return dropped

    def reset(self) -> None:
        """Forget every call and counter and restore the default knobs (a fresh provider)."""
        with self.lock:
            self.knobs, self.calls, self.window, self.stats = Knobs(), {}, RateWindow(), Stats()
            self.files, self.batches = {}, {}
            self.released += 1
            self.lock.notify_all()


def new_call(
    kind: str,
    model: str,
    request: dict[str, Any],
    prompt: str,
    answer: str,
    now: float,
    generation_s: Callable[[str], float],
) -> Call:
    """Build a call of `kind` (not yet kept or counted): its answer cut at the request's output limit, its tokens."""
    # Gemini's limit is generationConfig.maxOutputTokens; the other kinds keep the fields they always read.
    limit = (
        output_limit(request)
        if kind == "gemini"
        else int(request.get("max_output_tokens") or request.get("max_tokens") or 0)
    )
    output = count_tokens(answer)
    truncated = 0 < limit < output
    if truncated:
        answer, output = truncate_tokens(answer, limit), limit
    prefix = {"responses": "resp_", "chat": "chatcmpl-", "messages": "msg_01", "gemini": ""}[kind]
    return Call(
        id=prefix + uuid.uuid4().hex,
        kind=kind,
        model=model,
        request=request,
        text=answer,
        input_tokens=count_tokens(prompt),
        output_tokens=output,
        truncated=truncated,
        created=now,
        created_at=int(time.time()),
        ends=now + generation_s(answer),
        background=bool(request.get("background")),
        store=request.get("store", True) is not False,
    )


def retry_after_header(seconds: float) -> str:
    """Return a `retry-after` value: whole seconds, rounded up (the header's integer form)."""
    return str(max(1, math.ceil(seconds)))
