"""Benchmark: the main command, `oncelery process samples/articles.jsonl`, under fault mixes, on each store.

Runs the real console script as a subprocess (its own worker: prefork, 2 processes) on a fresh database
each time, and reads its --summary-json: articles/s, and LLM calls made / saved / wasted.

    embedded         no server: SQLite claims database, kombu filesystem broker (the default)
    redis+postgres   Redis broker and result backend, PostgreSQL claims database (--start-worker)

Fault mixes: none; --duplicates 0.3; --duplicates 0.3 --kill-worker-every 30 --lease 10. One more row per
store runs a larger file (each sample article in --scale versions, so --scale x 112 distinct keys): 112
articles take 3-7 s, too short to show a steady rate apart from the worker's start.

Run: python bench/articles.py [--repeat 3] [--scale 10] [--write docs/benchmarks.md]
Not a test: nothing here asserts a time.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
import uuid
from pathlib import Path
from typing import Any

import redis
from sqlalchemy import create_engine, text
from sqlalchemy.engine import make_url

REPO = Path(__file__).resolve().parent.parent
SAMPLES = REPO / "samples" / "articles.jsonl"
ONCELERY = str(Path(sys.executable).parent / "oncelery")
SECTION = "## Article pipeline"
MIXES = {
    "none": [],
    "duplicates 0.3": ["--duplicates", "0.3"],
    "duplicates 0.3 + kill every 30": ["--duplicates", "0.3", "--kill-worker-every", "30", "--lease", "10"],
}


def clean_env(**extra: str) -> dict[str, str]:
    """This environment without ONCELERY_*/CELERY_* settings (embedded defaults), plus `extra`."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(("ONCELERY_", "CELERY_"))}
    env.update(extra)
    return env


def scaled_samples(folder: Path, versions: int) -> Path:
    """Write every sample article in `versions` versions (distinct keys, the same text) to a JSONL file."""
    path = folder / f"articles-x{versions}.jsonl"
    lines = [json.loads(line) for line in SAMPLES.read_text(encoding="utf-8").splitlines() if line.strip()]
    with path.open("w", encoding="utf-8") as out:
        for version in range(1, versions + 1):
            for article in lines:
                out.write(json.dumps({**article, "version": version}) + "\n")
    return path


def run_once(source: Path, args: list[str], env: dict[str, str], timeout: float) -> dict[str, Any]:
    """Run the command in a fresh folder; return its summary plus the command's own elapsed time."""
    folder = Path(tempfile.mkdtemp(prefix="oncelery-bench-articles-"))
    try:
        summary_path = folder / "summary.json"
        argv = [ONCELERY, "process", str(source), *args, "--summary-json", str(summary_path)]
        started = time.monotonic()
        done = subprocess.run(argv, cwd=folder, env=env, capture_output=True, text=True, timeout=timeout)
        elapsed = time.monotonic() - started
        if done.returncode != 0:
            raise SystemExit(f"{' '.join(argv)} failed ({done.returncode}):\n{done.stdout}\n{done.stderr}")
        summary: dict[str, Any] = json.loads(summary_path.read_text())
        summary["command_seconds"] = elapsed
        return summary
    finally:
        shutil.rmtree(folder, ignore_errors=True)


class Postgres:
    """A fresh PostgreSQL database per run, created and dropped through the admin URL."""

    def __init__(self, admin_url: str) -> None:
        self.admin_url = admin_url
        self.admin = create_engine(admin_url, isolation_level="AUTOCOMMIT")

    def fresh(self) -> str:
        name = f"oncelery_bench_articles_{uuid.uuid4().hex[:8]}"
        with self.admin.connect() as conn:
            conn.execute(text(f'CREATE DATABASE "{name}"'))
        return make_url(self.admin_url).set(database=name).render_as_string(hide_password=False)

    def drop(self, url: str) -> None:
        name = make_url(url).database
        with self.admin.connect() as conn:
            conn.execute(text(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)'))

    def version(self) -> str:
        with self.admin.connect() as conn:
            return str(conn.execute(text("SHOW server_version")).scalar_one())


def run_store(store: str, source: Path, mix: list[str], ns: argparse.Namespace, pg: Postgres | None) -> dict[str, Any]:
    if store == "embedded":
        return run_once(source, mix, clean_env(), ns.timeout)
    if pg is None:
        raise SystemExit("redis+postgres needs --pg-admin-url")
    url = pg.fresh()
    queue = f"bench-articles-{uuid.uuid4().hex[:8]}"
    env = clean_env(
        ONCELERY_BROKER_URL=ns.redis_url,
        ONCELERY_RESULT_BACKEND=ns.redis_results_url,
        ONCELERY_DATABASE_URL=url,
    )
    try:
        return run_once(source, [*mix, "--start-worker", "--queue", queue], env, ns.timeout)
    finally:
        pg.drop(url)
        client = redis.Redis.from_url(ns.redis_url)
        try:
            keys = list(client.scan_iter(match=f"*{queue}*"))
            if keys:
                client.delete(*keys)
        finally:
            client.close()


def median(values: list[float]) -> float:
    return float(statistics.median(values))


def span(values: list[float], fmt: str = "{:.1f}") -> str:
    """Median, with the range when runs differ."""
    low, mid, high = min(values), median(values), max(values)
    return fmt.format(mid) if low == high else f"{fmt.format(mid)} ({fmt.format(low)}-{fmt.format(high)})"


def counts(values: list[int]) -> str:
    return "/".join(str(v) for v in values) if len(set(values)) > 1 else str(values[0])


def render(results: dict[tuple[str, str], list[dict[str, Any]]], ns: argparse.Namespace, env_line: str) -> str:
    lines = [
        SECTION,
        "",
        "`oncelery process samples/articles.jsonl` (112 articles, 3 ledgered steps each, offline LocalModel at",
        "temperature 0), as a subprocess that starts its own worker (prefork, concurrency 2), on a fresh database",
        f"every run; {ns.repeat} runs per row, median (range). The `x{ns.scale}` rows process each article in "
        f"{ns.scale} versions",
        f"({ns.scale * 112} articles) for a steady rate. Measured with `python bench/articles.py --repeat "
        f"{ns.repeat} --scale {ns.scale}`.",
        f"Machine: {env_line}.",
        "",
        "| store | faults | articles/s | after 1st result | LLM calls made | saved | wasted | kills "
        "| interrupted | deliveries | in-progress waits | wall s |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for (store, mix), runs in results.items():
        lines.append(
            f"| {store} | {mix} | {span([r['articles_per_second'] for r in runs])} "
            f"| {span([r['articles'] / r['steady_seconds'] for r in runs if r['steady_seconds']])} "
            f"| {counts([r['llm_calls'] for r in runs])} | {counts([r['llm_calls_saved'] for r in runs])} "
            f"| {counts([r['wasted_calls'] for r in runs])} | {counts([r['worker_kills'] for r in runs])} "
            f"| {counts([r['jobs_interrupted'] for r in runs])} | {counts([r['deliveries_sent'] for r in runs])} "
            f"| {counts([r['in_progress_waits'] for r in runs])} | {span([r['wall_seconds'] for r in runs])} |"
        )
    lines += [
        "",
        "- **articles/s**: articles over the wall time from the first message sent to the last article scored",
        "  (includes the worker's start, ~1-2 s); **after 1st result** excludes that start.",
        "- **LLM calls made** = rows in the `llm_calls` ledger (one per real model call); 3 per article (336",
        "  for the 112 samples) is the minimum. **Saved** = calls a worker without the claim would have made on",
        "  top: 3 per delivery answered from a stored result (replayed) + 1 per step a resumed run replayed from",
        "  its checkpoint. **Wasted** = ledger rows beyond 3 per article: a call that returned but whose step",
        "  never checkpointed.",
        "- Duplicates: 30 % of the articles are sent twice, half right behind the first copy (a second worker",
        "  process takes it while the first still runs: an in-progress wait), half later (a replay). No call is",
        "  wasted: every copy is answered by the claim, never by the model.",
        "- Kills: every 30 scored articles the command SIGKILLs its worker's process group (main process and pool)",
        "  at a moment one article is mid-pipeline, and restarts it. At most the call in flight at each kill is",
        "  repeated (wasted ≤ kills). `--lease 10` makes a killed holder's article be taken over after 10 s",
        "  instead of the task's 60 s; the wall time of that mix is mostly that wait, not work.",
        "  On the embedded broker a killed worker's fetched messages are gone. The command never re-sends as",
        "  the producer: deliveries go through the outbox, and its in-process relay re-sends a lost run from",
        "  its stored message (the sweeper) or re-publishes an outbox row lost before its claim; *deliveries*",
        "  counts those too. Saved calls vary between runs of that mix: some duplicate copies die with the",
        "  killed worker and are not delivered before the command ends (Redis: after the visibility timeout).",
        "",
    ]
    return "\n".join(lines)


def write_section(path: Path, section: str) -> None:
    """Replace this benchmark's section of `path` (up to the next `## ` heading), or append it; keep the rest."""
    old = path.read_text(encoding="utf-8") if path.exists() else "# Benchmarks\n"
    start = old.find(SECTION + "\n")
    if start < 0:
        new = old.rstrip("\n") + "\n\n" + section
    else:
        end = old.find("\n## ", start + len(SECTION))
        new = old[:start] + section + (old[end + 1 :] if end >= 0 else "")
    path.write_text(new, encoding="utf-8")


def environment(pg: Postgres | None, redis_url: str) -> str:
    parts = [f"{os.cpu_count()} CPUs", f"Python {platform.python_version()}", platform.system()]
    if pg is not None:
        parts.append(f"PostgreSQL {pg.version()}")
        client = redis.Redis.from_url(redis_url)
        try:
            parts.append(f"Redis {client.info('server')['redis_version']}")
        finally:
            client.close()
    return ", ".join(parts)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--repeat", type=int, default=3, help="runs per row (default 3)")
    parser.add_argument("--scale", type=int, default=10, help="versions per article in the steady-rate row")
    parser.add_argument("--stores", default="embedded,redis+postgres", help="comma-separated: embedded,redis+postgres")
    parser.add_argument("--redis-url", default="redis://127.0.0.1:6379/13")
    parser.add_argument("--redis-results-url", default="redis://127.0.0.1:6379/14")
    parser.add_argument("--pg-admin-url", default="postgresql+psycopg://postgres@127.0.0.1:5432/postgres")
    parser.add_argument("--timeout", type=float, default=600.0, help="seconds per run")
    parser.add_argument("--write", type=Path, default=None, help="replace or append the section in this file")
    ns = parser.parse_args(argv)
    stores = [s.strip() for s in ns.stores.split(",") if s.strip()]
    pg = Postgres(ns.pg_admin_url) if "redis+postgres" in stores else None
    results: dict[tuple[str, str], list[dict[str, Any]]] = {}
    scratch = Path(tempfile.mkdtemp(prefix="oncelery-bench-input-"))
    scenarios = [(name, SAMPLES, mix) for name, mix in MIXES.items()]
    if ns.scale > 1:
        scenarios.append((f"none, x{ns.scale}", scaled_samples(scratch, ns.scale), []))
    for store in stores:
        for mix_name, source, mix in scenarios:
            runs = []
            for i in range(ns.repeat):
                summary = run_store(store, source, mix, ns, pg)
                print(
                    f"{store:15} {mix_name:31} run {i + 1}: {summary['articles_per_second']:6.1f} articles/s, "
                    f"calls {summary['llm_calls']} saved {summary['llm_calls_saved']} "
                    f"wasted {summary['wasted_calls']} kills {summary['worker_kills']}",
                    flush=True,
                )
                runs.append(summary)
            results[(store, mix_name)] = runs
    shutil.rmtree(scratch, ignore_errors=True)
    section = render(results, ns, environment(pg, ns.redis_url))
    print()
    print(section)
    if ns.write is not None:
        write_section(ns.write, section)
        print(f"wrote the {SECTION!r} section of {ns.write}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
