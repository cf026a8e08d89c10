"""The throughput benchmark's results: one phase run (`PhaseResult`), medians over rounds, the printed tables."""

from __future__ import annotations

import json
import statistics
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any


@dataclass
class PhaseResult:
    """The measurements of one phase run."""

    phase: str
    jobs: int
    boot_s: float
    wall_s: float
    rate_start: float
    rate_ready: float
    enqueue_rate: float = 0.0  # jobs/s of the producer's apply_async loop (celery-once takes its lock there)
    round: int = 0
    order: int = 0  # position of the phase in its round
    db: dict[str, float] = field(default_factory=dict)
    xact_commit: int = 0
    xact_rollback: int = 0
    verified: str = ""
    # CPU milliseconds per job: worker main process, pool children, this phase's PostgreSQL backends, redis-server,
    # the RabbitMQ node (a RabbitMQ broker), everything else on the machine (bench driver, py-spy, PostgreSQL
    # background processes, other users).
    cpu_ms: dict[str, float] = field(default_factory=dict)
    cpu_utilization: float = 0.0
    idle_load_before: float = 0.0

    def line(self, rounds: int) -> str:
        """One progress line for this run."""
        return (
            f"[{self.round + 1}/{rounds}] {self.phase:<5} {self.jobs} jobs: {self.rate_start:7.1f} jobs/s from start, "
            f"{self.rate_ready:7.1f} from ready (boot {self.boot_s:.2f}s, enqueue {self.enqueue_rate:.0f}/s) "
            f"db/job {json.dumps({k: round(v, 2) for k, v in self.db.items()})} "
            f"xact/job {(self.xact_commit + self.xact_rollback) / self.jobs:.2f} "
            f"cpu ms/job {json.dumps({k: round(v, 2) for k, v in self.cpu_ms.items()})} "
            f"util {self.cpu_utilization:.0%} (load before {self.idle_load_before:.2f} CPUs) {self.verified}"
        )


def _median(results: list[PhaseResult], attr: str) -> float:
    return statistics.median(getattr(r, attr) for r in results)


def _median_db(results: list[PhaseResult], key: str) -> float:
    return statistics.median(r.db.get(key, 0.0) for r in results)


def summarize(by_phase: dict[str, list[PhaseResult]]) -> dict[str, Any]:
    """Medians per phase over its runs, with ratios to plain when plain ran."""
    summary: dict[str, Any] = {}
    for phase, results in by_phase.items():
        summary[phase] = {
            "jobs": results[0].jobs,
            "runs": len(results),
            "rate_start": _median(results, "rate_start"),
            "rate_ready": _median(results, "rate_ready"),
            "enqueue_rate": _median(results, "enqueue_rate"),
            "boot_s": _median(results, "boot_s"),
            **{k: _median_db(results, k) for k in ("statements", "commits", "rollbacks", "checkouts", "pings")},
            "round_trips": _median_db(results, "round_trips"),
            "xact_commit": statistics.median(r.xact_commit / r.jobs for r in results),
            "xact_rollback": statistics.median(r.xact_rollback / r.jobs for r in results),
            "xact": statistics.median((r.xact_commit + r.xact_rollback) / r.jobs for r in results),
            "cpu_ms": {k: statistics.median(r.cpu_ms.get(k, 0.0) for r in results) for k in results[0].cpu_ms},
            "cpu_utilization": _median(results, "cpu_utilization"),
        }
    if "plain" in summary:
        for phase in summary:
            summary[phase]["ratio_start"] = summary[phase]["rate_start"] / summary["plain"]["rate_start"]
            summary[phase]["ratio_ready"] = summary[phase]["rate_ready"] / summary["plain"]["rate_ready"]
    return summary


def report(by_phase: dict[str, list[PhaseResult]]) -> dict[str, Any]:
    """Print the medians table, the ratios to plain, the CPU table and every run; return the summary."""
    summary = summarize(by_phase)
    phases = list(by_phase)
    print()
    header = (
        f"{'phase':<6} {'jobs':>6} {'jobs/s start':>13} {'jobs/s ready':>13} {'x plain':>8} {'enq/s':>7} "
        f"{'boot s':>7} {'stmts/job':>9} {'commits':>8} {'rollbk':>7} {'pings':>6} {'RT/job':>7} {'xact/job':>9}"
    )
    print(header)
    print("-" * len(header))
    for phase in phases:
        s = summary[phase]
        ratio = f"{s['ratio_ready']:.3f}" if "ratio_ready" in s else "-"
        print(
            f"{phase:<6} {s['jobs']:>6} {s['rate_start']:>13.1f} {s['rate_ready']:>13.1f} {ratio:>8} "
            f"{s['enqueue_rate']:>7.0f} {s['boot_s']:>7.2f} {s['statements']:>9.2f} {s['commits']:>8.2f} "
            f"{s['rollbacks']:>7.2f} {s['pings']:>6.2f} {s['round_trips']:>7.2f} {s['xact']:>9.2f}"
        )
    print()
    for phase in phases:
        if phase != "plain" and "plain" in summary:
            s = summary[phase]
            print(f"ratio {phase}/plain: {s['ratio_start']:.3f} (from worker start), {s['ratio_ready']:.3f} (ready)")
    print()
    print(
        f"{'CPU ms/job':<10} {'main':>7} {'children':>8} {'postgres':>9} {'redis':>6} {'rabbit':>6} {'other':>6} "
        f"{'total':>6} {'util':>5}"
    )
    for phase in phases:
        c = summary[phase]["cpu_ms"]
        print(
            f"{phase:<10} {c['main']:>7.2f} {c['children']:>8.2f} {c['postgres']:>9.2f} {c['redis']:>6.2f} "
            f"{c.get('rabbitmq', 0.0):>6.2f} {c['other']:>6.2f} {sum(c.values()):>6.2f} "
            f"{summary[phase]['cpu_utilization']:>5.0%}"
        )
    print()
    for phase, results in by_phase.items():
        runs = ", ".join(
            f"r{r.round + 1}#{r.order + 1} {r.rate_start:.0f}/{r.rate_ready:.0f}"
            + (f" [{r.verified}]" if r.verified else "")
            for r in results
        )
        print(f"  {phase} runs (round#position start/ready jobs/s): {runs}")
    return summary


def write_json(path: Path, by_phase: dict[str, list[PhaseResult]], summary: dict[str, Any], **extra: Any) -> None:
    """Write every run and the summary to `path`."""
    runs = {p: [asdict(r) for r in rs] for p, rs in by_phase.items()}
    path.write_text(json.dumps({**extra, "runs": runs, "summary": summary}, indent=2))
