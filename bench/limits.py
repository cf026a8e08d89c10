"""Shared limits and budgets on a real fleet: the fake provider's 429 counters and bill are the oracle.

Three parts (`--part shared|budget|hot|all`), on a fresh PostgreSQL database (made, migrated and dropped here)
and a Redis broker (database 9 by default):

1. **shared**: 2 `celery worker` instances (prefork, 4 processes each) against the fake provider limited to
   `--rpm` (200) requests and a token limit per window, time compressed: the fake's fixed window
   (`rate_window_s`) and our limiter's `window_s` are both `--window` seconds (10: one "minute" lasts 10 s, so
   200 "rpm" is 20 calls/s, about a third of what this fleet makes unlimited on 2 cores). Our limits
   (`oncelery_limits`) are set `--margin` (3 %) under the fake's (docs/limits.md, "Margin"). Each scenario
   queues more jobs than it can run, then counts the fake's creates and 429s for `--windows` windows from its
   first create.
   Scenarios: `capacity` (no limit anywhere: what the fleet makes, so a limit below it binds), `rpm` (the
   request limit binds; the default burst, 2 % of the rate: 3 of 194), `rpm-smooth` (the same with `burst: 0`:
   a late admission loses its slot), `rpm-burst` (the same with `burst` = `--burst` units; the margin still
   covers a window: 194 + 4 + 1 <= 200), `tpm` (the token limit binds, answers shorter
   than `max_output_tokens`), `tpm-full` (the token limit binds, every answer fills its `max_output_tokens`),
   and the naive ways, with no `oncelery_limits`: `naive` (Celery's `rate_limit` on the task set to the
   provider's limit per worker instance, which is how Celery counts it: the provider's N per W-second window
   is N / W per second per instance, e.g. `300/m` at W = 60 is `5/s`; 200 per 10 s is `20/s`) and
   `naive-paced` (each instance paced at that rate by the task itself, spread over its processes: what
   `rate_limit` is documented to do, for when Celery's own falls short of it). Figures: the fake's 429s as % of
   the create requests it received (goal <= 0.5 %), and creates per window as % of the binding limit (goal
   >= 90 %).
2. **budget**: `--budget-calls` (1,000) jobs of one real `self.llm()` call each, tenant `acme`, against a
   `tenant:*` day budget of `--cap` ($10) (`oncelery_budgets`, `oncelery_prices`), on the same fleet
   (8 processes at once). Figures: the budget row's spent against the ledger's sum (`model_calls.cost_micros`)
   and the provider's bill (the fake's billed tokens at the price), overspend beyond the cap (goal $0), refused
   calls. Beside it the post-hoc check gateways make (read the spent sum, compare it to the cap, then call and
   record), by as many threads at once against the same fake, price and cap: its overspend in $.
3. **hot**: admissions per second through ONE limiter row of a huge rate (nothing refused), each in its own
   transaction committed durably (`commit_durably`, as `prepare_intent` does), by 1, 4, 8, 16 processes at
   once with their own connections. Variants: `bare` (one limiter), `rpm+tpm` (a call under both limits: two
   rows), `prepare` (both rows, then the intent row inserted before the commit, as the prepared transaction
   holds the rows' locks), `prepare/4` and `prepare/8` (the same with the limiter split into 4 or 8 shards).
   Compared with a fleet's need (10,000 rpm = 167 calls/s).

Other sessions' work on the same cores shows in every figure: each measurement first waits (up to
`--quiet-wait` s) for an idle machine, and reports the CPUs busy before it and during it.

    python bench/limits.py [--quick] [--part all] [--json FILE] [--quiet-wait 10]

The worker processes import this file as their app (`celery -A bench.limits worker`), configured by the JSON
in $BENCH_LIMITS_WORKER; without it (the driver) no app is made.
"""

from __future__ import annotations

import argparse
import json
import math
import multiprocessing
import os
import signal
import statistics
import subprocess
import sys
import threading
import time
import uuid
from collections.abc import Callable, Iterator
from contextlib import contextmanager, suppress
from dataclasses import dataclass, field
from datetime import UTC, datetime
from decimal import Decimal
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

from celery import Celery  # noqa: E402
from sqlalchemy import func, select, text  # noqa: E402
from sqlalchemy.engine import make_url  # noqa: E402

from oncelery import CELERY_DELIVERY_DEFAULTS, IdempotentTask  # noqa: E402
from oncelery.llm.adapters.openai_responses import OpenAIResponses  # noqa: E402
from oncelery.llm.tokens import count_tokens, estimate_tokens  # noqa: E402

ENV_CONFIG = "BENCH_LIMITS_WORKER"
TASK = "bench.limits.call"
TEXT = "The river rose two metres overnight and the old bridge was closed to traffic, the mayor said."
REALISTIC_RPM = 10_000  # a fleet's need to compare the hot row with: 10,000 calls a minute


def job_text(i: int) -> str:
    """The input of job `i` (each its own, so the fake's answers differ in length)."""
    return f"Summarise report {i}. {TEXT}"


# -- the worker app: `celery -A bench.limits worker` with $BENCH_LIMITS_WORKER ---------------------------------

_adapters: dict[int, OpenAIResponses] = {}


def _adapter(base_url: str) -> OpenAIResponses:
    """One adapter (one HTTP client) per pool process, made after the fork."""
    pid = os.getpid()
    if pid not in _adapters:
        _adapters[pid] = OpenAIResponses(base_url, "sk-bench")
    return _adapters[pid]


_next_start = [0.0]


def _pace(per_s: float) -> None:
    """naive-paced: this pool process starts at most `per_s` calls a second (what Celery's rate_limit is meant to
    do per worker instance, divided among its processes); no coordination with any other process or instance."""
    now = time.monotonic()
    start = max(_next_start[0], now)
    _next_start[0] = start + 1.0 / per_s
    time.sleep(start - now)


def worker_app(cfg: dict[str, Any]) -> Celery:
    """The fleet's app: one task making one `self.llm()` call; limits, budgets and rate_limit from `cfg`."""
    made = Celery("bench-limits")
    made.conf.update(
        **CELERY_DELIVERY_DEFAULTS,
        broker_url=cfg["broker"],
        broker_transport_options=transport_options(cfg["queue"]),
        result_backend=None,
        task_ignore_result=True,
        task_store_errors_even_if_ignored=False,
        worker_send_task_events=False,
        task_default_queue=cfg["queue"],
        broker_connection_retry_on_startup=True,
        oncelery_database_url=cfg["db"],
        timezone="UTC",
        enable_utc=True,
    )
    if cfg.get("limits"):
        made.conf.oncelery_limits = cfg["limits"]
    if cfg.get("budgets"):
        made.conf.oncelery_budgets = cfg["budgets"]
    if cfg.get("prices"):
        made.conf.oncelery_prices = cfg["prices"]
    options: dict[str, Any] = {}
    if cfg.get("rate_limit"):
        options["rate_limit"] = cfg["rate_limit"]
    if cfg.get("tenant"):
        options["tenant"] = "{tenant}"

    @made.task(base=IdempotentTask, bind=True, name=TASK, idempotency_key="lim:{key}", **options)
    def call(self: IdempotentTask, key: str, text: str, model: str, max_output: int, tenant: str = "") -> int:
        if cfg.get("pace"):
            _pace(float(cfg["pace"]))
        answer = self.llm("call", adapter=_adapter(cfg["fake"]), model=model, input=text, max_output_tokens=max_output)
        return int((answer.get("usage") or {}).get("output_tokens") or 0)

    return made


def transport_options(queue: str) -> dict[str, Any]:
    """Redis bookkeeping keys of this run's own, so nothing else in the Redis database is touched."""
    return {
        "unacked_key": f"{queue}.unacked",
        "unacked_index_key": f"{queue}.unacked_index",
        "unacked_mutex_key": f"{queue}.unacked_mutex",
    }


app = worker_app(json.loads(os.environ[ENV_CONFIG])) if os.environ.get(ENV_CONFIG) else None


# -- the driver's plumbing --------------------------------------------------------------------------------------


def wait_until(predicate: Callable[[], bool], timeout: float, what: str, interval: float = 0.1) -> None:
    """Poll `predicate` until it holds, or raise TimeoutError naming `what`."""
    deadline = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() > deadline:
            raise TimeoutError(f"{what}: not within {timeout:.0f} s")
        time.sleep(interval)


@dataclass
class Bench:
    """What every part shares: the database, the broker, the fake provider, the logs."""

    url: str
    broker: str
    fake: Any  # oncelery.fake_provider.FakeProvider
    logs: Path
    tag: str = field(default_factory=lambda: uuid.uuid4().hex[:8])
    runs: int = 0

    def queue(self) -> str:
        self.runs += 1
        return f"bench-limits-{self.tag}-{self.runs}"


@contextmanager
def fleet(bench: Bench, cfg: dict[str, Any], instances: int, procs: int) -> Iterator[Celery]:
    """Start `instances` `celery -A bench.limits worker` subprocesses (prefork, `procs` each) on a queue of their
    own, wait until each answers a ping, yield a sender app on that queue; stop them by PID afterwards."""
    queue = bench.queue()
    cfg = {**cfg, "broker": bench.broker, "db": bench.url, "queue": queue, "fake": bench.fake.openai_base_url}
    env = {**os.environ, ENV_CONFIG: json.dumps(cfg)}
    sender = Celery(f"bench-limits-sender-{queue}")
    sender.conf.update(
        **CELERY_DELIVERY_DEFAULTS,
        broker_url=bench.broker,
        broker_transport_options=transport_options(queue),
        task_default_queue=queue,
        broker_connection_retry_on_startup=True,
        oncelery_database_url=bench.url,
    )
    procs_: list[subprocess.Popen[bytes]] = []
    hostnames = [f"{queue}-{n}@bench" for n in range(instances)]
    try:
        for hostname in hostnames:
            log = bench.logs / f"{hostname.split('@')[0]}.log"
            cmd = [
                sys.executable, "-m", "celery", "-A", "bench.limits", "worker", "--pool=prefork",
                f"--concurrency={procs}", "-Q", queue, "-n", hostname, "--loglevel=WARNING",
                "--without-gossip", "--without-mingle", "--without-heartbeat",
            ]  # fmt: skip
            with log.open("wb") as out:
                procs_.append(
                    subprocess.Popen(
                        cmd, cwd=REPO, env=env, stdout=out, stderr=subprocess.STDOUT, start_new_session=True
                    )
                )
        answered: set[str] = set()

        def ready() -> bool:
            for p in procs_:
                if p.poll() is not None:
                    raise RuntimeError(f"a worker exited with {p.returncode}; see {bench.logs}")
            for reply in sender.control.ping(destination=hostnames, timeout=0.5) or []:
                answered.update(reply)
            return answered >= set(hostnames)

        wait_until(ready, 120, "the workers to answer a ping", interval=0.0)
        yield sender
    finally:
        stop_processes(procs_)
        with suppress(Exception):
            delete_keys(bench.broker, queue)
        sender.close()


def stop_processes(procs: list[subprocess.Popen[bytes]], grace: float = 20.0) -> None:
    """SIGTERM each worker (a warm shutdown) by its PID, then SIGKILL the process group it leads, by its id."""
    for p in procs:
        if p.poll() is None:
            p.send_signal(signal.SIGTERM)
    deadline = time.monotonic() + grace
    for p in procs:
        with suppress(subprocess.TimeoutExpired):
            p.wait(timeout=max(0.1, deadline - time.monotonic()))
    for p in procs:
        with suppress(ProcessLookupError, PermissionError):
            os.killpg(p.pid, signal.SIGKILL)  # the pool children of a session this bench started
        with suppress(subprocess.TimeoutExpired):
            p.wait(timeout=30)


def delete_keys(broker: str, queue: str) -> None:
    """Delete the Redis keys naming this run's queue."""
    import redis

    client = redis.Redis.from_url(broker)
    try:
        keys = list(client.scan_iter(match=f"*{queue}*"))
        if keys:
            client.delete(*keys)
    finally:
        client.close()


def quiet(args: argparse.Namespace) -> float:
    """Wait (up to --quiet-wait s) until the machine is idle; return the CPUs busy over the last second then.

    Other sessions' test suites share these 2 cores: what they use is in the figures; this keeps it out at the
    start of each measurement, at least.
    """
    from bench.support.harness import wait_quiet

    return round(wait_quiet(args.quiet_wait, threshold=0.3), 2) if args.quiet_wait > 0 else -1.0


def run_counts(url: str, prefix: str) -> dict[str, int]:
    """Runs of `TASK` whose key starts with `prefix`, by status."""
    from oncelery.store.database import get_engine
    from oncelery.store.tables import RUNS

    r = RUNS.c
    with get_engine(url).connect() as conn:
        rows = conn.execute(
            select(r.status, func.count())
            .where(r.task_name == TASK, r.idempotency_key.like(f"lim:{prefix}%"))
            .group_by(r.status)
        ).all()
    return {getattr(s, "value", str(s)): int(n) for s, n in rows}


def retire_waiting(url: str) -> int:
    """End the runs a scenario left parked (WAITING), so the relay of a later scenario never wakes them into its
    fleet (their calls would count in its figures); return how many there were."""
    from oncelery.models import RunStatus
    from oncelery.store.database import get_engine
    from oncelery.store.tables import RUNS

    r = RUNS.c
    with get_engine(url).begin() as conn:
        done = conn.execute(
            RUNS.update().where(r.task_name == TASK, r.status == RunStatus.WAITING).values(status=RunStatus.DEAD)
        )
    return int(done.rowcount)


def foreign_creates(url: str, model: str, stats: dict[str, Any]) -> int:
    """Creates the fake counted for intents that are not of `model` (0: the scenario's figures are its own)."""
    from oncelery.store.database import get_engine
    from oncelery.store.tables import INTENTS

    with get_engine(url).connect() as conn:
        own = set(conn.execute(select(INTENTS.c.public_id).where(INTENTS.c.model == model)).scalars())
    return sum(n for intent, n in stats["creates_by_intent"].items() if intent not in own)


def busy_cpu_seconds() -> float:
    """CPU seconds the whole machine spent busy so far (all CPUs; not idle, not iowait)."""
    values = [int(v) for v in Path("/proc/stat").read_text().splitlines()[0].split()[1:]]
    return (sum(values[:8]) - values[3] - values[4]) / os.sysconf("SC_CLK_TCK")


class Sampler:
    """Samples the fake's counters every 0.05 s in a thread: (time, creates, 429s); and the machine's CPU."""

    def __init__(self, fake: Any) -> None:
        self.fake = fake
        self.samples: list[tuple[float, int, int]] = []
        self.stop = threading.Event()
        self.thread = threading.Thread(target=self._run, daemon=True)
        self.cpu = (0.0, 0.0)

    def busy(self) -> float:
        """CPUs busy on average while sampling (of os.cpu_count())."""
        busy, seconds = self.cpu
        return busy / seconds if seconds else 0.0

    def _run(self) -> None:
        while not self.stop.is_set():
            s = self.fake.stats()
            self.samples.append((time.monotonic(), sum(s["creates_by_intent"].values()), s["rate_limited"]))
            self.stop.wait(0.05)

    def __enter__(self) -> Sampler:
        self.cpu = (busy_cpu_seconds(), time.monotonic())
        self.thread.start()
        return self

    def __exit__(self, *_: Any) -> None:
        self.stop.set()
        self.thread.join(timeout=10)
        self.cpu = (busy_cpu_seconds() - self.cpu[0], time.monotonic() - self.cpu[1])

    def first(self) -> float | None:
        """When the first create was seen (None: not yet)."""
        return next((t for t, c, _ in list(self.samples) if c > 0), None)

    def at(self, t: float) -> tuple[int, int]:
        """(creates, 429s) counted by the last sample at or before `t`."""
        seen = (0, 0)
        for when, creates, refused in list(self.samples):
            if when > t:
                break
            seen = (creates, refused)
        return seen


# -- part 1: one limit for the fleet ----------------------------------------------------------------------------

SCENARIOS = ("capacity", "rpm", "rpm-smooth", "rpm-burst", "tpm", "tpm-full", "naive", "naive-paced")


@dataclass
class Scenario:
    """One scenario of the shared part: the fake's limits, ours, Celery's rate_limit or a pace, what binds."""

    name: str
    model: str
    max_output: int
    fake_rpm: int  # the fake's limits per window (0: none)
    fake_tpm: int
    limits: dict[str, Any] | None  # oncelery_limits (None: none)
    rate_limit: str | None  # Celery's rate_limit on the task (per worker instance)
    binding: float  # calls per window the fake's limits allow (0: unlimited)
    binds: str
    pace: float | None = None  # naive-paced: calls per second each pool process starts at most


def plan_scenario(name: str, args: argparse.Namespace, jobs: int) -> Scenario:
    """The fake's limits, our limits and Celery's rate_limit of scenario `name` (see the module's docstring)."""
    w, rpm, margin = args.window, args.rpm, args.margin
    max_output = 8 if name == "tpm-full" else args.max_output
    # The fake counts a request's input tokens and its max_output_tokens in the window (as OpenAI does).
    tokens = statistics.fmean(count_tokens(job_text(i)) + max_output for i in range(jobs))
    if name == "capacity":
        return Scenario(name, "gpt-capacity", max_output, 0, 0, None, None, 0.0, "none")
    if name in ("tpm", "tpm-full"):
        tpm = int(rpm * tokens * args.tpm_share)  # binds at tpm_share of the request limit
        binds = "tokens"
    else:
        tpm = int(rpm * tokens * 1.5)  # not binding: the request limit binds
        binds = "requests"
    binding = min(rpm, tpm / tokens)
    limits = None
    rate_limit = None
    if name in ("rpm", "rpm-smooth", "rpm-burst", "tpm", "tpm-full"):
        entry = {"rpm": math.floor(rpm * (1 - margin)), "tpm": math.floor(tpm * (1 - margin)), "window_s": w}
        if name == "rpm-smooth":
            entry["burst"] = 0  # no burst: every admission that comes after its slot loses it
        if name == "rpm-burst":
            # A few calls' slack, so an admission that comes late does not lose its slot; the margin covers it:
            # a fixed window sees at most rpm x (1 - margin) + burst + 1 calls.
            entry["burst"] = args.burst
        limits = {f"openai:gpt-{name}": entry}
    elif name == "naive":
        rate_limit = f"{rpm / w:g}/s"  # the provider's limit, per worker instance (Celery counts per instance)
    pace = rpm / w / args.procs if name == "naive-paced" else None  # per process: the provider's limit per instance
    return Scenario(name, f"gpt-{name}", max_output, rpm, tpm, limits, rate_limit, binding, binds, pace)


def run_scenario(bench: Bench, args: argparse.Namespace, name: str) -> dict[str, Any]:
    """Send more jobs than `--windows` windows can take to a fresh fleet; from the first create on, count the
    fake's creates and 429s for exactly `--windows` windows (the fake's counters, sampled), then stop the fleet."""
    from oncelery.store.database import get_engine
    from oncelery.store.tables import LIMITERS
    from oncelery.testing import relay_running

    windows = args.windows if name != "capacity" else max(2, args.windows // 2)
    base = plan_scenario(name, args, 1000)
    # A backlog the measured windows cannot drain: at the binding limit (or the fleet's ~50 calls/s) plus 2 windows.
    jobs = int((windows + 2) * max(base.binding, args.rpm, 0 if base.binding else 60 * args.window))
    sc = plan_scenario(name, args, jobs)
    bench.fake.reset()
    bench.fake.set_knobs(
        rpm_limit=sc.fake_rpm, tpm_limit=sc.fake_tpm, rate_window_s=args.window, generation_s=0.0, poll_after_ms=100
    )
    cfg = {"limits": sc.limits, "rate_limit": sc.rate_limit, "pace": sc.pace}
    prefix = f"{name}-{uuid.uuid4().hex[:6]}-"
    print(
        f"[shared/{name}] {jobs} jobs queued, {windows} windows measured; fake: {sc.fake_rpm or '-'} requests, "
        f"{sc.fake_tpm or '-'} tokens per {args.window:g} s; ours: {sc.limits and sc.limits[f'openai:{sc.model}']}; "
        f"rate_limit: {sc.rate_limit}; paced: {sc.pace and f'{sc.pace:g}/s per process'}",
        flush=True,
    )
    span = windows * args.window
    load = quiet(args)
    with (
        fleet(bench, cfg, args.instances, args.procs) as sender,
        relay_running(sender, bench.url, interval=0.05),
        Sampler(bench.fake) as sampler,
    ):
        for i in range(jobs):
            sender.send_task(TASK, args=[f"{prefix}{i}", job_text(i), sc.model, sc.max_output])
        wait_until(lambda: sampler.first() is not None, 120, f"{name}: a first create")
        first = sampler.first() or 0.0
        # The measurement itself: `windows` windows of the fake's clock from its first create.
        wait_until(lambda: time.monotonic() >= first + span + 0.1, span + 60, f"{name}: the measured windows")
    parked_left = retire_waiting(bench.url)
    stats = bench.fake.stats()
    foreign = foreign_creates(bench.url, sc.model, stats)
    c0, r0 = sampler.at(first - 1e-9)
    c1, r1 = sampler.at(first + span)
    creates, refused = c1 - c0, r1 - r0
    bins = [
        sampler.at(first + (k + 1) * args.window)[0] - sampler.at(first + k * args.window)[0] for k in range(windows)
    ]
    per_window = creates / windows
    made = sum(stats["creates_by_intent"].values())
    tokens_per_call = stats["billed_input_tokens"] / max(1, made) + sc.max_output
    binding = 0.0  # calls per window the fake's limits allow, at the tokens it counted per call
    if sc.fake_rpm:
        binding = min(sc.fake_rpm, sc.fake_tpm / tokens_per_call) if sc.fake_tpm else float(sc.fake_rpm)
    with get_engine(bench.url).connect() as conn:
        rows = conn.execute(select(LIMITERS).where(LIMITERS.c.name.like(f"openai:{sc.model}/%"))).all()
    limiters = {
        r.name: {
            "admitted": r.admitted,
            "throttled_local": r.throttled_local,
            "throttled_provider": r.throttled_provider,
            "factor": round(float(r.factor), 3),
        }
        for r in rows
    }
    counts = run_counts(bench.url, prefix)
    result = {
        "scenario": name,
        "jobs_queued": jobs,
        "completed": counts.get("COMPLETED", 0),
        "windows": windows,
        "binds": sc.binds,
        "fake_rpm": sc.fake_rpm,
        "fake_tpm": sc.fake_tpm,
        "ours": sc.limits and sc.limits[f"openai:{sc.model}"],
        "rate_limit": sc.rate_limit,
        "paced_per_process_s": sc.pace,
        "max_output_tokens": sc.max_output,
        "creates": creates,
        "creates_per_intent_max": max(stats["creates_by_intent"].values(), default=0),
        "429": refused,
        "429_all": int(stats["rate_limited"]),
        "429_pct": round(100.0 * refused / max(1, creates + refused), 3),
        "calls_per_window": round(per_window, 1),
        "binding_per_window": round(binding, 1),
        "pct_of_binding": round(100.0 * per_window / binding, 1) if binding else None,
        "window_counts": bins,
        "cpus_busy": round(sampler.busy(), 2),
        "load_before": load,
        "parked_left": parked_left,
        "foreign_creates": foreign,
        "limiters": limiters,
    }
    print(f"[shared/{name}] {json.dumps(result)}", flush=True)
    return result


def shared_table(results: list[dict[str, Any]], args: argparse.Namespace) -> None:
    print()
    print(
        f"Shared limit: {args.instances} workers x prefork {args.procs}; window {args.window:g} s (fake and ours); "
        f"our limits {args.margin:.0%} under the fake's"
    )
    head = (
        f"{'scenario':<12} {'binds':<9} {'windows':>7} {'creates':>7} {'429s':>5} {'429 %':>7} "
        f"{'calls/window':>12} {'binding':>8} {'% binding':>9} {'CPUs':>5}  per full window"
    )
    print(head)
    print("-" * len(head))
    for r in results:
        pct = "-" if r["pct_of_binding"] is None else f"{r['pct_of_binding']:.1f}"
        print(
            f"{r['scenario']:<12} {r['binds']:<9} {r['windows']:>7} {r['creates']:>7} {r['429']:>5} "
            f"{r['429_pct']:>7.2f} "
            f"{r['calls_per_window']:>12.1f} {r['binding_per_window'] or '-':>8} {pct:>9} {r['cpus_busy']:>5.2f}  "
            f"{r['window_counts']}"
        )
    print("goals: 429 % <= 0.5 and % binding >= 90 (our limiter's scenarios: rpm, rpm-burst, tpm, tpm-full)")


# -- part 2: a budget under racing calls ----------------------------------------------------------------------


def budget_part(bench: Bench, args: argparse.Namespace) -> dict[str, Any]:
    """1,000 real self.llm() calls against a tenant's day budget, then the post-hoc check with as many threads."""
    from oncelery.store.database import get_engine
    from oncelery.store.tables import BUDGETS, CALLS
    from oncelery.testing import relay_running

    model = "gpt-budget"
    price = {"input": args.price_in, "output": args.price_out}  # USD per 1M tokens = micro-USD per token
    cap_micros = int(Decimal(str(args.cap)) * 1_000_000)
    n = args.budget_calls
    fake = bench.fake
    fake.reset()
    fake.set_knobs(generation_s=args.call_s, poll_after_ms=100)
    est = statistics.fmean(
        (estimate_tokens(job_text(i)) * args.price_in + args.max_output * args.price_out) for i in range(n)
    )
    print(
        f"[budget] {n} calls, tenant acme, cap ${args.cap}; price ${args.price_in}/${args.price_out} per 1M tokens; "
        f"about ${est / 1e6:.4f} reserved per call; each call {args.call_s:g} s at the provider",
        flush=True,
    )
    cfg = {
        "budgets": {"tenant:*": {"day": args.cap}},
        "prices": {model: price},
        "tenant": True,
    }
    prefix = f"budget-{uuid.uuid4().hex[:6]}-"
    load = quiet(args)
    with fleet(bench, cfg, args.instances, args.procs) as sender, relay_running(sender, bench.url, interval=0.05):
        began = time.monotonic()
        for i in range(n):
            sender.send_task(
                TASK, args=[f"{prefix}{i}", job_text(i), model, args.max_output], kwargs={"tenant": "acme"}
            )

        def finished() -> bool:
            counts = run_counts(bench.url, prefix)
            return counts.get("COMPLETED", 0) + counts.get("DEAD", 0) >= n

        wait_until(finished, 600, "budget: every job")
        wall = time.monotonic() - began
    stats = fake.stats()
    counts = run_counts(bench.url, prefix)
    engine = get_engine(bench.url)
    with engine.connect() as conn:
        [row] = conn.execute(select(BUDGETS).where(BUDGETS.c.name.like("tenant:acme/day/%"))).all()
        ledger = conn.execute(
            select(func.coalesce(func.sum(CALLS.c.cost_micros), 0), func.count()).where(
                CALLS.c.task_name == TASK, CALLS.c.tenant == "acme"
            )
        ).one()
    billed = stats["billed_input_tokens"] * args.price_in + stats["billed_output_tokens"] * args.price_out
    ours = {
        "calls": n,
        "wall_s": round(wall, 1),
        "completed": counts.get("COMPLETED", 0),
        "dead": counts.get("DEAD", 0),
        "creates": sum(stats["creates_by_intent"].values()),
        "cap_usd": args.cap,
        "spent_usd": int(row.spent_micros) / 1e6,
        "reserved_usd": int(row.reserved_micros) / 1e6,
        "overrun_usd": int(row.overrun_micros) / 1e6,
        "refused": int(row.refused),
        "ledger_usd": int(ledger[0]) / 1e6,
        "ledger_rows": int(ledger[1]),
        "provider_bill_usd": billed / 1e6,
        "overspend_usd": max(0, max(billed, int(ledger[0])) - cap_micros) / 1e6,
        "load_before": load,
    }
    print(f"[budget] ours: {json.dumps(ours)}", flush=True)
    post = post_hoc(bench, args, model, cap_micros)
    print(f"[budget] post-hoc: {json.dumps(post)}", flush=True)
    return {"ours": ours, "post_hoc": post}


def post_hoc(bench: Bench, args: argparse.Namespace, model: str, cap_micros: int) -> dict[str, Any]:
    """Each of `concurrency` threads: read the ledger's sum, refuse if it has reached the cap, else call the
    fake (the same request, background and polled, as self.llm() makes it) and record the call's cost."""
    from oncelery.store.database import get_engine

    fake = bench.fake
    fake.reset()
    fake.set_knobs(generation_s=args.call_s, poll_after_ms=100)
    engine = get_engine(bench.url)
    with engine.begin() as conn:
        conn.execute(text("CREATE TABLE IF NOT EXISTS bench_posthoc (id bigserial PRIMARY KEY, cost_micros bigint)"))
        conn.execute(text("TRUNCATE bench_posthoc"))
    n, threads = args.budget_calls, args.instances * args.procs
    lock = threading.Lock()
    state = {"next": 0, "refused": 0, "calls": 0}
    errors: list[BaseException] = []

    def caller() -> None:
        try:
            with OpenAIResponses(fake.openai_base_url, "sk-posthoc") as adapter:
                while True:
                    with lock:
                        i = state["next"]
                        state["next"] += 1
                    if i >= n:
                        return
                    with engine.connect() as conn:
                        spent = int(
                            conn.execute(text("SELECT coalesce(sum(cost_micros), 0) FROM bench_posthoc")).scalar_one()
                        )
                    if spent >= cap_micros:
                        with lock:
                            state["refused"] += 1
                        continue
                    request = {"model": model, "input": job_text(i), "max_output_tokens": args.max_output}
                    look = adapter.create(request, uuid.uuid4().hex, background=True)
                    while not look.terminal:
                        time.sleep(look.poll_after_s or 0.1)
                        look = adapter.poll(look.reference or "")
                    usage = adapter.usage(look.response)
                    cost = usage.input_tokens * args.price_in + usage.output_tokens * args.price_out
                    with engine.begin() as conn:
                        conn.execute(text("INSERT INTO bench_posthoc (cost_micros) VALUES (:c)"), {"c": cost})
                    with lock:
                        state["calls"] += 1
        except BaseException as exc:  # reported by the driver
            errors.append(exc)

    began = time.monotonic()
    pool = [threading.Thread(target=caller) for _ in range(threads)]
    for t in pool:
        t.start()
    for t in pool:
        t.join()
    if errors:
        raise errors[0]
    with engine.connect() as conn:
        spent = int(conn.execute(text("SELECT coalesce(sum(cost_micros), 0) FROM bench_posthoc")).scalar_one())
        conn.execute(text("DROP TABLE bench_posthoc"))
        conn.commit()
    stats = fake.stats()
    billed = stats["billed_input_tokens"] * args.price_in + stats["billed_output_tokens"] * args.price_out
    return {
        "calls": n,
        "threads": threads,
        "wall_s": round(time.monotonic() - began, 1),
        "made": state["calls"],
        "refused": state["refused"],
        "cap_usd": cap_micros / 1e6,
        "ledger_usd": spent / 1e6,
        "provider_bill_usd": billed / 1e6,
        "overspend_usd": max(0, max(spent, billed) - cap_micros) / 1e6,
    }


def budget_table(result: dict[str, Any]) -> None:
    ours, post = result["ours"], result["post_hoc"]
    print()
    print(f"Budget race: {ours['calls']} calls, {post['threads']} at once, cap ${ours['cap_usd']}")
    head = f"{'way':<28} {'made':>5} {'refused':>7} {'spent':>10} {'ledger':>10} {'provider':>10} {'overspend':>9}"
    print(head)
    print("-" * len(head))
    print(
        f"{'reservation (self.llm)':<28} {ours['creates']:>5} {ours['refused']:>7} {ours['spent_usd']:>10.6f} "
        f"{ours['ledger_usd']:>10.6f} {ours['provider_bill_usd']:>10.6f} {ours['overspend_usd']:>9.6f}"
    )
    print(
        f"{'post-hoc (read, call, record)':<28} {post['made']:>5} {post['refused']:>7} {'-':>10} "
        f"{post['ledger_usd']:>10.6f} {post['provider_bill_usd']:>10.6f} {post['overspend_usd']:>9.6f}"
    )
    print(
        f"goal: overspend $0 and spent == ledger (reserved left: ${ours['reserved_usd']}, overrun "
        f"${ours['overrun_usd']})"
    )


# -- part 3: admissions per second on one hot row ---------------------------------------------------------------

HOT_VARIANTS = ("bare", "rpm+tpm", "prepare", "prepare/4", "prepare/8")  # "/N": the limiter split into N shards


def _admitter(url: str, variant: str, name: str, seconds: float, ready: Any, start: Any, out: Any) -> None:
    """One process: admit through the hot limiter(s) in durable transactions for `seconds`; report the count."""
    from oncelery.llm.limits import LimitRule, Throttled, admit_txn, limiters_for
    from oncelery.store.database import Database, dispose_engines
    from oncelery.store.tables import INTENTS

    dispose_engines()  # forked: nothing of the driver's pool is used here (it had none open)
    kinds = ("rpm",) if variant == "bare" else ("rpm", "tpm")
    shards = int(variant.split("/")[1]) if "/" in variant else 1
    # A million a second: nothing is refused, each admission waits only for the row's lock.
    rules = tuple(LimitRule(f"openai:{name}", kind, 60_000_000, shards=shards) for kind in kinds)
    admissions = limiters_for(rules, "openai", name, "", "t", (10, 10))
    db = Database(url)
    with db.begin() as conn:  # connected before the start: the measured time holds no connection set-up
        conn.execute(select(1))
    run_id = uuid.uuid4().int % 2**62  # intent rows of a run of their own (no task_runs row: no foreign key)
    done = refused = 0
    ready.put(os.getpid())
    start.wait()
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        try:
            with db.begin() as conn:
                db.dialect.commit_durably(conn)
                admitted = admit_txn(conn, db.dialect, admissions)
                if variant.startswith("prepare"):
                    conn.execute(
                        INTENTS.insert().values(
                            public_id=uuid.uuid4().hex, run_id=run_id, position=done, step_name="s", attempt=1,
                            token=1, provider="openai", endpoint="responses", model=name, mode="background",
                            request_digest="d", state="prepared", admitted=admitted,
                        )
                    )  # fmt: skip
            done += 1
        except Throttled:
            refused += 1
        except Exception as exc:  # told to the driver at once, not after its timeout
            out.put(("error", repr(exc)))
            raise
    out.put((done, refused))


def hot_part(url: str, args: argparse.Namespace) -> list[dict[str, Any]]:
    """Admissions per second by 1, 4, 8, 16 processes at once through one hot limiter, per variant; rounds
    interleave the levels and variants, so a burst of load from elsewhere on the machine hits one run of each."""
    from oncelery.store.database import dispose_engines, get_engine

    with get_engine(url).connect() as conn:
        sync = conn.execute(text("SHOW synchronous_commit")).scalar_one()
        fsync = conn.execute(text("SHOW fsync")).scalar_one()
    dispose_engines()
    load = quiet(args)
    print(
        f"[hot] synchronous_commit={sync}, fsync={fsync}; {args.hot_seconds:g} s per run, {args.hot_rounds} rounds; "
        f"CPUs busy before {load}",
        flush=True,
    )
    ctx = multiprocessing.get_context("fork")
    results = []
    for round_ in range(args.hot_rounds):
        for level in args.hot_levels:
            for variant in args.hot_variants:
                name = f"hot-{variant.replace('+', '-').replace('/', 's')}-{level}-{uuid.uuid4().hex[:4]}"
                ready, start, out = ctx.Queue(), ctx.Event(), ctx.Queue()
                dispose_engines()  # no pooled connection crosses the fork
                procs = [
                    ctx.Process(target=_admitter, args=(url, variant, name, args.hot_seconds, ready, start, out))
                    for _ in range(level)
                ]
                try:
                    for p in procs:
                        p.start()
                    for _ in procs:  # each is connected and waits on `start`
                        ready.get(timeout=120)
                    start.set()
                    counts = [out.get(timeout=args.hot_seconds + 120) for _ in procs]
                    failed = [c[1] for c in counts if c[0] == "error"]
                    if failed:
                        raise RuntimeError(f"an admitter failed: {failed[0]}")
                finally:
                    for p in procs:
                        p.join(timeout=30)
                        if p.is_alive():
                            p.kill()
                            p.join()
                admitted = sum(c[0] for c in counts)
                row = {
                    "round": round_ + 1,
                    "variant": variant,
                    "admitters": level,
                    "admitted": admitted,
                    "refused": sum(c[1] for c in counts),
                    "per_s": round(admitted / args.hot_seconds, 1),
                    "load": round(os.getloadavg()[0], 1),
                }
                results.append(row)
                print(f"[hot] {json.dumps(row)}", flush=True)
    return results


def hot_table(results: list[dict[str, Any]], args: argparse.Namespace) -> None:
    need = REALISTIC_RPM / 60
    print()
    print(
        f"Admissions per second through one limiter row (durable commits; median of {args.hot_rounds} rounds of "
        f"{args.hot_seconds:g} s); a fleet of {REALISTIC_RPM:,} rpm needs {need:.0f}/s"
    )
    levels = list(args.hot_levels)
    head = f"{'variant':<10} " + " ".join(f"{f'{n} at once':>11}" for n in levels) + "   refused  each round"
    print(head)
    print("-" * len(head))
    for variant in args.hot_variants:
        cells, rounds, refused = [], [], 0
        for n in levels:
            runs = [r for r in results if r["variant"] == variant and r["admitters"] == n]
            if not runs:
                continue
            cells.append(f"{statistics.median(r['per_s'] for r in runs):>11.0f}")
            rounds.append("/".join(f"{r['per_s']:.0f}" for r in runs))
            refused += sum(r["refused"] for r in runs)
        print(f"{variant:<10} {' '.join(cells)}   {refused:>7}  {', '.join(rounds)}")


# -- main -----------------------------------------------------------------------------------------------------


def parse(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        description="Shared limits and budgets on a real fleet (see the module's docstring).",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    parser.add_argument("--part", choices=("shared", "budget", "hot", "all"), default="all")
    parser.add_argument("--quick", action="store_true", help="a short preset (about 2 minutes): fewer of everything")
    parser.add_argument("--admin-url", default="postgresql+psycopg://postgres@127.0.0.1:5432/postgres")
    parser.add_argument("--redis-url", default="redis://127.0.0.1:6379/9", help="the broker (a database of 9..12)")
    parser.add_argument("--json", type=Path, help="write every figure to this file")
    parser.add_argument("--instances", type=int, default=2, help="worker instances (celery worker subprocesses)")
    parser.add_argument("--procs", type=int, default=4, help="prefork pool processes per instance")
    parser.add_argument(
        "--quiet-wait",
        type=float,
        default=10.0,
        help="before each measurement, wait up to this long for an idle machine",
    )
    g = parser.add_argument_group("shared limit")
    g.add_argument("--scenarios", default=",".join(SCENARIOS), help=", ".join(SCENARIOS))
    g.add_argument("--window", type=float, default=10.0, help="seconds one 'minute' lasts (fake's window and ours)")
    g.add_argument("--rpm", type=int, default=200, help="the fake's request limit per window")
    g.add_argument("--tpm-share", type=float, default=0.6, help="tpm scenarios: the token limit, in requests' worth")
    g.add_argument("--margin", type=float, default=0.03, help="our limits this fraction under the fake's")
    g.add_argument("--windows", type=int, default=3, help="windows measured per scenario")
    g.add_argument("--max-output", type=int, default=64, help="max_output_tokens of each call")
    g.add_argument("--burst", type=int, default=4, help="rpm-burst: our limiters' burst (units)")
    g = parser.add_argument_group("budget race")
    g.add_argument("--budget-calls", type=int, default=1000)
    g.add_argument("--cap", type=float, default=10.0, help="the tenant's day budget, USD")
    g.add_argument("--price-in", type=int, default=200, help="USD per 1M input tokens")
    g.add_argument("--price-out", type=int, default=600, help="USD per 1M output tokens")
    g.add_argument("--call-s", type=float, default=0.3, help="seconds each call takes at the provider")
    g = parser.add_argument_group("hot row")
    g.add_argument("--hot-levels", default="1,4,8,16")
    g.add_argument("--hot-variants", default="bare,prepare,prepare/4", help=", ".join(HOT_VARIANTS))
    g.add_argument("--hot-seconds", type=float, default=4.0)
    g.add_argument("--hot-rounds", type=int, default=2)
    args = parser.parse_args(argv)
    if args.quick:
        defaults = {
            "scenarios": "rpm,naive",
            "windows": 2,
            "budget_calls": 400,
            "cap": 4.0,
            "hot_levels": "1,8",
            "hot_variants": "bare,prepare,prepare/4",
            "hot_seconds": 2.0,
            "hot_rounds": 1,
            "quiet_wait": 0.0,
        }
        for name, value in defaults.items():
            if getattr(args, name) == parser.get_default(name):
                setattr(args, name, value)
    args.scenarios = [s.strip() for s in str(args.scenarios).split(",") if s.strip()]
    args.hot_levels = [int(n) for n in str(args.hot_levels).split(",") if n.strip()]
    args.hot_variants = [v.strip() for v in str(args.hot_variants).split(",") if v.strip()]
    for s in args.scenarios:
        if s not in SCENARIOS:
            parser.error(f"unknown scenario {s!r}; use {', '.join(SCENARIOS)}")
    for v in args.hot_variants:
        if v not in HOT_VARIANTS:
            parser.error(f"unknown hot variant {v!r}; use {', '.join(HOT_VARIANTS)}")
    return args


def main(argv: list[str] | None = None) -> None:
    """Make the database, start the fake provider, run the parts asked for, print their tables, drop it all."""
    from oncelery.fake_provider import FakeProvider, Knobs
    from oncelery.store.database import dispose_engines, get_engine
    from oncelery.store.schema import upgrade_schema

    args = parse(argv)
    # SIGTERM (a timeout, an operator) unwinds like Ctrl-C: every `finally` stops what this bench started.
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    name = f"bench_limits_{uuid.uuid4().hex[:10]}"
    admin = get_engine(args.admin_url)
    with admin.connect().execution_options(isolation_level="AUTOCOMMIT") as conn:
        conn.execute(text(f'CREATE DATABASE "{name}"'))
    url = make_url(args.admin_url).set(database=name).render_as_string(hide_password=False)
    logs = Path(os.environ.get("BENCH_LOG_DIR", "/tmp/oncelery_bench")) / name
    logs.mkdir(parents=True, exist_ok=True)
    report: dict[str, Any] = {
        "when": datetime.now(UTC).isoformat(timespec="seconds"),
        "cpus": os.cpu_count(),
        "args": {k: v for k, v in vars(args).items() if k != "json"},
    }
    began = time.monotonic()
    try:
        upgrade_schema(url)
        with FakeProvider(Knobs()) as fake:
            bench = Bench(url, args.redis_url, fake, logs)
            if args.part in ("shared", "all"):
                report["shared"] = [run_scenario(bench, args, s) for s in args.scenarios]
            if args.part in ("budget", "all"):
                report["budget"] = budget_part(bench, args)
        if args.part in ("hot", "all"):
            report["hot"] = hot_part(url, args)
    finally:
        dispose_engines()
        with admin.connect().execution_options(isolation_level="AUTOCOMMIT") as conn:
            conn.execute(text(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)'))
    report["wall_s"] = round(time.monotonic() - began, 1)
    if "shared" in report:
        shared_table(report["shared"], args)
    if "budget" in report:
        budget_table(report["budget"])
    if "hot" in report:
        hot_table(report["hot"], args)
    print(f"\nwall time {report['wall_s']:.0f} s; worker logs in {logs}")
    if args.json:
        args.json.write_text(json.dumps(report, indent=2, default=str))


if __name__ == "__main__":
    main()
