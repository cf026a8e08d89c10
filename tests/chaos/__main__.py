"""`python -m tests.chaos [--preset ci|full|producer|rabbitmq] [--jobs N --kills K ...]`: run the chaos checker.

Prints `jobs=N faults=F lost=0 duplicated=0 unexpected=0 calls_without_a_row=0 unlabelled=0 over_budget=0
reservations_left=0` on one line (plus per-fault counts, the fence and the model-call summaries) and exits 0 only
for a clean verdict (every count 0, no job inconsistent with its stored result either), every fault kind at its
minimum count, and a system that settled (no copy still delivered at the end); 1 otherwise; 2 if the run could not
start (no PostgreSQL binaries, no `postgres` user, a service that would not start); 130 if interrupted
(SIGINT/SIGTERM: every process is stopped first, the logs are kept).

The job's model call is `self.llm()` in background mode against the fake provider (a process of the run's);
every preset runs the model-call faults given by `--create-kills`, `--poll-kills`, `--relay-kills`, `--revokes`,
`--provider-errors` (bursts of 503s and 429s in turn) and `--forgets` (tests/chaos/model_faults.py).

Presets (an option given on the command line overrides the preset's value):

- ci   (the default): 170 jobs, 20 % duplicates, 6 kills (2 pool children, 2 main processes, 2 whole workers),
       1 Redis flush, 3 backend kills (claim, step, commit), 2 PostgreSQL restarts (a fast stop, then an
       immediate one: a crash), 1 proxy cut (of a holder about to commit), 2 zombies (one mid-steps, one
       about to commit), 2 % long jobs past a 4 s visibility timeout; and one of each model-call fault: a kill
       in the create window, a kill mid-poll, a relay kill between a wake's mark and its send, a revoke of a
       parked run, a 503 burst and a 429 burst, a response forgotten; about 1.5 minutes on a 2-core machine.
- full (for the docs): 10,000 jobs, 30 % duplicates, 51 kills, 3 flushes, 12 backend kills, 2 restarts,
       3 cuts, 3 zombies, 10 create-window kills, 10 mid-poll kills, 5 relay kills, 10 revokes, 10 provider
       error bursts, 5 forgotten responses; jobs spread over 30 minutes.
- producer (outside CI; figures in docs/chaos.md): producers resend with producer dedupe on (the product's
       default, and the other presets' too: `--no-producer-dedupe` sends every copy to the broker): 300 jobs
       over 30 s, 60 % sent a second time (half straight through `.delay()`), 6 kills, 2 Redis flushes,
       2 backend kills, 1 PostgreSQL restart, 1 cut, 1 zombie; prints how many copies the producer answered.
- rabbitmq (outside CI; figures in docs/chaos.md): the broker is a private RabbitMQ node (classic queue;
       `--queue-type quorum` for a quorum queue), Redis keeps results and the replay cache. 400 jobs over
       60 s, 20 % duplicates, 9 kills, 2 flushes (queue.purge), 2 broker restarts (the node stopped and
       started: every unacked message redelivered at once), 3 backend kills, 1 PostgreSQL restart, 1 cut,
       2 zombies; no long jobs (RabbitMQ has no visibility timeout). About 1.5 minutes on a 2-core machine.
"""

from __future__ import annotations

import argparse
import signal
import sys
from typing import Any

PRESETS: dict[str, dict[str, Any]] = {
    "ci": {
        "jobs": 170,
        "duplicates": 20.0,
        "kills": 6,
        "flushes": 1,
        "backend_kills": 3,
        "restarts": 2,
        "cuts": 1,
        "zombies": 2,
        "timeout": 230.0,
        "workers": 2,
        "seed": 1,
        "window": 19.0,  # 170 jobs at ~9/s on 2 workers: the suite pays for the window, not for the faults
        "lease": 3.0,
        "visibility_timeout": 4.0,
        "long_share": 2.0,
        "republish_after": 10.0,
        "create_kills": 1,
        "poll_kills": 1,
        "relay_kills": 1,
        "revokes": 1,
        "provider_errors": 2,
        "forgets": 1,
    },
    "full": {
        "jobs": 10_000,
        "duplicates": 30.0,
        "kills": 51,
        "flushes": 3,
        "backend_kills": 12,
        "restarts": 2,
        "cuts": 3,
        "zombies": 3,
        "timeout": 4000.0,
        "workers": 2,
        "seed": 1,
        "window": 1800.0,  # ~5.6 jobs/s: what 5 worker slots keep up with on 2 cores (docs/chaos.md, Rates)
        "lease": 3.0,
        "visibility_timeout": 4.0,
        "long_share": 1.0,
        "republish_after": 10.0,
        "create_kills": 10,
        "poll_kills": 10,
        "relay_kills": 5,
        "revokes": 10,
        "provider_errors": 10,
        "forgets": 5,
    },
    # Producers resend (60 % of the jobs get a copy, half straight through .delay()) with producer dedupe on,
    # while the broker is flushed and workers are killed: a copy answered at the producer must never be a job
    # that nothing else would run.
    "producer": {
        "producer_dedupe": True,
        "jobs": 300,
        "duplicates": 60.0,
        "kills": 6,
        "flushes": 2,
        "backend_kills": 2,
        "restarts": 1,
        "cuts": 1,
        "zombies": 1,
        "timeout": 300.0,
        "workers": 2,
        "seed": 2,
        "window": 30.0,
        "lease": 3.0,
        "visibility_timeout": 4.0,
        "long_share": 2.0,
        "republish_after": 10.0,
    },
    "rabbitmq": {
        "broker": "rabbitmq",
        "queue_type": "classic",
        "jobs": 400,
        "duplicates": 20.0,
        "kills": 9,
        "flushes": 2,
        "broker_restarts": 2,
        "backend_kills": 3,
        "restarts": 1,
        "cuts": 1,
        "zombies": 2,
        "timeout": 420.0,
        "workers": 2,
        "seed": 1,
        "window": 60.0,
        "lease": 3.0,
        "visibility_timeout": 4.0,  # unused by RabbitMQ (kombu's amqp transport has none)
        "long_share": 0.0,
        "republish_after": 10.0,
    },
}


def _span(text: str) -> tuple[float, float]:
    low, _, high = text.partition(",")
    return float(low), float(high or low)


def parse(argv: list[str]) -> dict[str, Any]:
    """Return the run's values: the preset's, overridden by the options given."""
    p = argparse.ArgumentParser(prog="python -m tests.chaos", description=__doc__.split("\n\n", 1)[0])
    p.add_argument("--preset", choices=sorted(PRESETS), default="ci")
    p.add_argument("--jobs", type=int, help="jobs to submit (each a distinct idempotency key)")
    p.add_argument("--duplicates", type=float, help="percent of jobs sent a second time with the same key")
    p.add_argument("--kills", type=int, help="SIGKILLs of pool children, worker main processes, whole workers")
    p.add_argument(
        "--broker", choices=("redis", "rabbitmq"), help="the broker: a private redis-server or RabbitMQ node"
    )
    p.add_argument("--queue-type", choices=("classic", "quorum"), help="RabbitMQ's task queue type")
    p.add_argument("--flushes", type=int, help="Redis FLUSHALLs (RabbitMQ: purges of the task queue)")
    p.add_argument("--broker-restarts", type=int, help="stops and starts of the RabbitMQ node, mid-job")
    p.add_argument("--backend-kills", type=int, help="pg_terminate_backend in claims, steps, commits")
    p.add_argument("--restarts", type=int, help="restarts of the throwaway PostgreSQL cluster")
    p.add_argument("--cuts", type=int, help="blackholes of the cut-off worker's database proxy")
    p.add_argument("--zombies", type=int, help="SIGSTOPs of a holder past its lease (then SIGCONT)")
    p.add_argument("--timeout", type=float, help="overall bound in seconds (startup to verdict)")
    p.add_argument("--workers", type=int, help="ordinary workers (>= 2), besides the cut-off one")
    p.add_argument("--seed", type=int, help="seed of the plan: duplicates, long jobs, fault order")
    p.add_argument("--window", type=float, help="seconds over which the jobs are submitted")
    p.add_argument("--lease", type=float, help="the job's lease in seconds")
    p.add_argument("--visibility-timeout", type=float, help="Redis visibility timeout (shorter than long jobs)")
    p.add_argument("--long-share", type=float, help="percent of jobs that outlast the visibility timeout")
    p.add_argument("--republish-after", type=float, help="the relay's --republish-after in seconds")
    p.add_argument("--create-kills", type=int, help="SIGKILLs in the create window (sent, intent prepared)")
    p.add_argument("--poll-kills", type=int, help="SIGKILLs of a holder polling its sent call")
    p.add_argument("--relay-kills", type=int, help="SIGKILLs of the relay between a wake's mark and its send")
    p.add_argument("--revokes", type=int, help="revokes of a parked (WAITING) run's message")
    p.add_argument("--provider-errors", type=int, help="bursts of refused creates, 503 and 429 in turn")
    p.add_argument("--forgets", type=int, help="responses of parked runs forgotten by the provider (404)")
    p.add_argument("--generation", type=_span, help="FROM,TO: seconds a call takes at the provider")
    p.add_argument("--inline-wait", type=float, help="seconds a delivery polls its call before parking the run")
    p.add_argument("--rewake-after", type=float, help="seconds before the relay sends again a wake no one took")
    p.add_argument("--release-after", type=float, help="oncelery_budget_release_s (a dead holder's prepared call)")
    p.add_argument(
        "--producer-dedupe",
        action=argparse.BooleanOptionalAction,
        help="the runner's .delay() copies asked of the claims database first (on by default, as in the product)",
    )
    p.add_argument("--keep", action="store_true", help="keep the logs and the ledger (kept anyway on failure)")
    given = vars(p.parse_args(argv))
    values = dict(PRESETS[given.pop("preset")])
    values.update({k: v for k, v in given.items() if v is not None})
    if values["workers"] < 2:
        p.error("--workers: give at least 2")
    if values.get("broker_restarts") and values.get("broker", "redis") != "rabbitmq":
        p.error("--broker-restarts: only with --broker rabbitmq")
    return values


def main(argv: list[str] | None = None) -> int:
    """Run the chaos checker; return its exit code."""
    values = parse(sys.argv[1:] if argv is None else argv)
    from tests.pg_cluster import postgres_runnable

    if not postgres_runnable():
        print("needs the PostgreSQL server binaries (initdb, pg_ctl, postgres) and a `postgres` user", file=sys.stderr)
        return 2
    from tests.chaos.procs import rabbitmq_bindir
    from tests.chaos.runner import Run, options_from

    if values.get("broker") == "rabbitmq" and rabbitmq_bindir() is None:
        print(
            "needs the RabbitMQ server (rabbitmq-server, rabbitmqctl): apt-get install rabbitmq-server", file=sys.stderr
        )
        return 2

    def interrupt(signum: int, frame: object) -> None:
        # `timeout`, a CI runner or a test's kill: the cleanup in Run.execute must still stop every process.
        raise KeyboardInterrupt(f"signal {signum}")

    signal.signal(signal.SIGTERM, interrupt)
    run = Run(options_from(values))
    print("chaos: " + " ".join(f"{k}={v}" for k, v in values.items()), flush=True)
    try:
        return run.execute()
    except KeyboardInterrupt as exc:
        print(f"interrupted ({exc}): every process was stopped", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
