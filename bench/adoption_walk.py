"""Benchmark: how long each of the user's own tests in docs/adopting.md's walk takes, the killed worker's above all.

Run: python bench/adoption_walk.py [--runs 3] [--json FILE]

Does what tests/test_adoption_walk.py does (the wheel, a fresh virtualenv, the project's files and commands read
from docs/adopting.md, a fresh `summaries` database on the local PostgreSQL, Redis on the tests' database), but
runs the user's `python -m pytest` itself `--runs` times with `--durations=0` and reports each test's
setup + call + teardown seconds (median and max over the runs) and the walk up to the tests. The goal for the
killed worker's test: under 30 s on the 2-core machine (docs/benchmarks.md). Not a test: nothing asserts a time.
"""

from __future__ import annotations

import argparse
import json
import re
import statistics
import sys
import tempfile
import time
from collections import defaultdict
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from tests import services
from tests.test_adoption_walk import Command, Walk, fresh_database, new_walker, stop_leftovers
from tests.wheel_venv import build_wheel, run

# "12.34s call     test_summaries.py::test_a_killed_worker_resumes_after_the_checkpoint"
_DURATION = re.compile(r"^([\d.]+)s (setup|call|teardown)\s+\S+::(test_\w+)", re.MULTILINE)
PYTEST_TIMEOUT = 300.0


def durations(out: str) -> dict[str, float]:
    """Seconds per test (setup + call + teardown) from pytest's `--durations=0 --durations-min=0` table."""
    seconds: dict[str, float] = defaultdict(float)
    for value, _phase, test in _DURATION.findall(out):
        seconds[test] += float(value)
    return dict(seconds)


def main() -> None:
    """Walk the doc once, run the user's tests `--runs` times, print the figures."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=3, help="Runs of the user's tests (default 3).")
    parser.add_argument("--json", type=Path, default=None, help="Also write the figures to this JSON file.")
    args = parser.parse_args()

    walk = Walk.read()
    queue = services.unique_queue()
    with tempfile.TemporaryDirectory(prefix="adoption-walk-") as tmp, fresh_database() as database:
        workdir = Path(tmp)
        started = time.monotonic()
        built = build_wheel(workdir / "wheel")
        walker = new_walker(built.wheel, database, workdir, queue)
        user_run = None
        try:
            for step in walk.steps:
                if isinstance(step, Command) and "pytest" in step.line and not step.line.startswith("pip"):
                    user_run = step.line
                    continue
                walker.step(step)
            setup_s = time.monotonic() - started
            assert user_run is not None, "the walk runs no pytest"
            per_test: dict[str, list[float]] = defaultdict(list)
            totals = []
            for i in range(args.runs):
                argv = ["bash", "-c", f"{user_run} --durations=0 --durations-min=0"]
                began = time.monotonic()
                done = run(argv, walker.project, walker.env, timeout=PYTEST_TIMEOUT)
                totals.append(time.monotonic() - began)
                if done.code != 0:
                    sys.exit(f"run {i + 1}: the user's tests failed:\n{done.out[-4000:]}\n{done.err[-2000:]}")
                for test, seconds in durations(done.out).items():
                    per_test[test].append(seconds)
        finally:
            stop_leftovers(walker.project)
            services.delete_queue_keys(services.REDIS_URL, queue)

    figures = {
        "walk_before_the_tests_s": round(setup_s, 1),
        "user_pytest_run_s": {"median": round(statistics.median(totals), 1), "max": round(max(totals), 1)},
        "tests_s": {
            test: {"median": round(statistics.median(v), 1), "max": round(max(v), 1), "runs": len(v)}
            for test, v in per_test.items()
        },
    }
    print(f"walk up to the user's tests (wheel, venv, installs, db upgrade): {setup_s:.1f} s")
    print(f"user's pytest run, {args.runs} runs: median {statistics.median(totals):.1f} s, max {max(totals):.1f} s")
    for test, v in per_test.items():
        print(f"  {test}: median {statistics.median(v):.1f} s, max {max(v):.1f} s")
    if args.json:
        args.json.write_text(json.dumps(figures, indent=2) + "\n")


if __name__ == "__main__":
    main()
