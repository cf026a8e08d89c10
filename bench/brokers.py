"""Throughput on Redis and on RabbitMQ (classic and quorum queues), side by side: bench/throughput.py per broker.

    python bench/brokers.py [--jobs 5000] [--repeat 3] [--phases plain,idem,dup,floor]
                            [--brokers redis,classic,quorum] [--concurrency 2] [--settle 30]
                            [--database-url URL] [--fresh-db] [--json FILE]

It starts a private, non-persistent redis-server (the Redis broker, and the bench's counters for every run)
and a private RabbitMQ node (tests/chaos/procs.py's RabbitServer: its own node name, ports, cookie and data,
no plugins, so a purge or a queue type hurts nobody), then runs the rounds interleaved across brokers: round r
of every broker before round r + 1 of any, the brokers' order rotated by r. Each (round, broker) is one
`bench/throughput.py --repeat 1 --first-round r` subprocess (bench.support.bench_app reads its broker at
import), so its phases rotate as in a plain throughput run. Every phase has a fresh worker and a queue of its
own, deleted after the phase.

Printed: each run's progress line, then per phase and broker the median jobs/s ready over the rounds (and each
round's), x plain on the same broker, x Redis for the same phase, and CPU ms per job: the worker's main process,
its children, PostgreSQL, the broker (the private redis-server, or the node's beam.smp; on RabbitMQ the bench's
counters still cost that Redis a little, counted in `own`), and the rest of the machine (`other`: other users).
On a shared machine `own` CPU per job is the steadier figure; jobs/s moves with what else runs.
Benchmarks are not tests: nothing here asserts a figure.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.support.harness import DEFAULT_DATABASE_URL, REPO, pids_named
from bench.support.report import PhaseResult, summarize
from tests.chaos.procs import RabbitServer, RedisServer, Sessions

BROKERS = ("redis", "classic", "quorum")  # classic and quorum: the RabbitMQ queue types


def beam_pids(node: RabbitServer) -> list[int]:
    """The RabbitMQ node's Erlang VM: the beam.smp processes in its session (not the machine's own node)."""
    return [pid for pid in pids_named("beam.smp") if os.getpgid(pid) == node.proc.pid]


def throughput_argv(
    args: argparse.Namespace, broker: str, r: int, json_path: Path, services: dict[str, Any]
) -> list[str]:
    """The bench/throughput.py command of round `r` on `broker`."""
    argv = [sys.executable, str(REPO / "bench" / "throughput.py"), "--repeat", "1", "--first-round", str(r)]
    argv += ["--jobs", str(args.jobs), "--phases", args.phases, "--concurrency", str(args.concurrency)]
    argv += ["--settle", str(args.settle), "--database-url", args.database_url, "--json", str(json_path)]
    argv += ["--stats-url", services["stats"], "--redis-pids", str(services["redis_pid"])]
    if broker == "redis":
        return [*argv, "--broker-url", services["stats"]]
    pids = ",".join(str(p) for p in services["beam"])
    return [*argv, "--broker-url", services["amqp"], "--queue-type", broker, "--rabbitmq-pids", pids]


def run_one(argv: list[str], log: Path) -> None:
    """Run one throughput subprocess; echo its progress lines, keep its whole output in `log`."""
    with log.open("w") as out:
        proc = subprocess.Popen(argv, cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        try:
            for line in proc.stdout or []:
                out.write(line)
                if line.startswith("["):
                    print("  " + line.rstrip(), flush=True)
            code = proc.wait()
        finally:
            if proc.poll() is None:
                proc.terminate()
                proc.wait()
    if code != 0:
        raise RuntimeError(f"{' '.join(argv)} exited {code}: see {log}")


def table(summaries: dict[str, dict[str, Any]], runs: dict[str, dict[str, list[PhaseResult]]]) -> list[str]:
    """One line per phase and broker: jobs/s ready, x plain, x Redis, and where the CPU went per job."""
    head = (
        f"{'phase':<6} {'broker':<8} {'jobs/s':>7} {'x plain':>7} {'x redis':>7}   "
        f"{'main':>5} {'kids':>5} {'pg':>5} {'broker':>6} {'own':>5} {'other':>5}   each round (jobs/s)"
    )
    lines = [head, "-" * len(head)]
    for phase in next(iter(runs.values())):
        for broker, summary in summaries.items():
            s = summary[phase]
            redis = summaries.get("redis", {}).get(phase)
            cpu = s["cpu_ms"]
            own = sum(v for k, v in cpu.items() if k != "other")
            mine = cpu.get("redis", 0.0) if broker == "redis" else cpu.get("rabbitmq", 0.0)
            each = ", ".join(f"{res.rate_ready:.0f}" for res in runs[broker][phase])
            lines.append(
                f"{phase:<6} {broker:<8} {s['rate_ready']:>7.0f} {s.get('ratio_ready', float('nan')):>7.2f} "
                + (f"{s['rate_ready'] / redis['rate_ready']:>7.2f}" if redis else f"{'-':>7}")
                + f"   {cpu['main']:>5.2f} {cpu['children']:>5.2f} {cpu['postgres']:>5.2f} {mine:>6.2f} {own:>5.2f} "
                + f"{cpu['other']:>5.2f}   {each}"
            )
    return lines


def main(argv: list[str] | None = None) -> int:
    """Start the brokers, run the interleaved rounds, print the side-by-side table."""
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--jobs", type=int, default=5000, help="jobs per phase")
    parser.add_argument("--repeat", type=int, default=3, help="rounds per broker; medians reported")
    parser.add_argument("--phases", default="plain,idem,dup,floor", help="bench/throughput.py's phases")
    parser.add_argument("--brokers", default=",".join(BROKERS), help=f"comma-separated, of {', '.join(BROKERS)}")
    parser.add_argument("--concurrency", type=int, default=2, help="worker processes (prefork -c)")
    parser.add_argument("--settle", type=float, default=30.0, help="bench/throughput.py's --settle")
    parser.add_argument("--database-url", default=DEFAULT_DATABASE_URL, help="PostgreSQL URL of the bench database")
    parser.add_argument("--fresh-db", action="store_true", help="drop and re-create the bench database first")
    parser.add_argument("--json", type=Path, help="write every run and the summaries to this file")
    args = parser.parse_args(argv)
    brokers = args.brokers.split(",")
    if unknown := [b for b in brokers if b not in BROKERS]:
        parser.error(f"unknown broker(s) {unknown}; choose from {BROKERS}")
    phases = args.phases.split(",")

    workdir = Path(tempfile.mkdtemp(prefix="oncelery-brokers-"))
    sessions = Sessions()
    rabbit: RabbitServer | None = None
    try:
        redis_server = RedisServer(sessions, workdir)
        services: dict[str, Any] = {"stats": f"{redis_server.url}/0", "redis_pid": redis_server.proc.pid}
        if set(brokers) & {"classic", "quorum"}:
            rabbit = RabbitServer(sessions, workdir)
            if not rabbit.wait_ready():
                raise RuntimeError(f"the RabbitMQ node did not start: see {workdir / 'rabbitmq.log'}")
            services.update(amqp=rabbit.url, beam=beam_pids(rabbit))
        if not redis_server.wait_ready():
            raise RuntimeError(f"redis-server did not start: see {workdir / 'redis.log'}")
        print(
            f"{args.jobs} jobs per phase, {args.repeat} rounds, brokers {brokers}, phases {phases}; logs in {workdir}"
        )
        runs: dict[str, dict[str, list[PhaseResult]]] = {b: {p: [] for p in phases} for b in brokers}
        fresh = args.fresh_db
        for r in range(args.repeat):
            for broker in brokers[r % len(brokers) :] + brokers[: r % len(brokers)]:
                print(f"round {r + 1}, {broker}", flush=True)
                out = workdir / f"{broker}-r{r}.json"
                cmd = throughput_argv(args, broker, r, out, services) + (["--fresh-db"] if fresh else [])
                fresh = False
                run_one(cmd, workdir / f"{broker}-r{r}.log")
                for phase, results in json.loads(out.read_text())["runs"].items():
                    runs[broker][phase] += [PhaseResult(**res) for res in results]
    finally:
        if rabbit is not None:
            rabbit.close()
        sessions.stop_all(grace=10.0)

    summaries = {b: summarize(runs[b]) for b in brokers}
    print()
    for line in table(summaries, runs):
        print(line)
    print(
        "\nCPU ms/job, medians: the worker's main process, its pool children, PostgreSQL's backends, the broker"
        " (redis-server, or the RabbitMQ node), own = all of these and the counters' Redis, other = the rest of"
        " the machine (other users)"
    )
    if args.json:
        dump = {b: {p: [vars(res) for res in runs[b][p]] for p in phases} for b in brokers}
        args.json.write_text(json.dumps({"runs": dump, "summaries": summaries}, indent=2, default=str))
    shutil.rmtree(workdir, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
