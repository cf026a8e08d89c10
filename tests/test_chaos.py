"""The chaos runner's reduced preset as a subprocess: 170 jobs under every fault kind, nothing lost or doubled,
and every model call the provider counted on the books.

`python -m tests.chaos --preset ci` starts its own redis-server, a throwaway PostgreSQL cluster, the fake model
provider, three `celery worker`s (one behind a blackholing proxy) and an outbox relay, and stops all of them by
PID however it ends; this test checks its exit code and the counts it prints (tests/chaos/report.py).
"""

from __future__ import annotations

import re
import sys
from pathlib import Path

import pytest

from tests import services
from tests.chaos.__main__ import PRESETS
from tests.pg_cluster import postgres_runnable

pytestmark = pytest.mark.crash

REPO = Path(__file__).resolve().parent.parent
# The preset takes 1.5-3 minutes on a 2-core machine and bounds itself at 230 s; this is the outer bound.
RUN_TIMEOUT = 420.0
VERDICT = re.compile(
    r"^jobs=(\d+) faults=(\d+) lost=(\d+) duplicated=(\d+) unexpected=(\d+) calls_without_a_row=(\d+) "
    r"unlabelled=(\d+) over_budget=(\d+) reservations_left=(\d+)$",
    re.MULTILINE,
)
MODEL_FAULTS = ("kill_create", "kill_poll", "kill_relay", "revoke", "forget")
FAULTS = re.compile(r"^faults: (.*) \(missed: .*\)$", re.MULTILINE)


@pytest.mark.timeout(RUN_TIMEOUT + 60)
def test_reduced_chaos_preset_loses_and_duplicates_nothing(tmp_path: Path) -> None:
    """170 jobs, 20 % duplicates, every fault kind at its minimum: exit 0, every count of the verdict 0."""
    services.need(
        "PostgreSQL binaries",
        postgres_runnable(),
        "install the PostgreSQL server package (initdb, pg_ctl, postgres) and a `postgres` user",
    )
    argv = [sys.executable, "-m", "tests.chaos", "--preset", "ci"]
    # On timeout: SIGTERM (the runner stops its processes), then SIGKILL of the runner's own session.
    code, out, err = services.run_to_completion(argv, REPO, services.clean_env(), RUN_TIMEOUT, lambda _out: None)
    shown = f"--- stdout\n{out[-6000:]}\n--- stderr\n{err[-3000:]}"
    assert code == 0, shown

    verdicts = VERDICT.findall(out)
    assert len(verdicts) == 1, shown  # exactly one verdict line
    jobs, faults, *verdict = (int(n) for n in verdicts[0])
    preset = PRESETS["ci"]
    assert jobs == preset["jobs"], shown
    # lost, duplicated, unexpected, calls_without_a_row, unlabelled, over_budget, reservations_left
    assert verdict == [0] * 7, shown

    counts = {k: int(n) for k, n in (item.split("=") for item in FAULTS.findall(out)[0].split())}
    kills = sum(counts.get(k, 0) for k in ("kill_child", "kill_main", "kill_host"))
    backend_kills = sum(n for k, n in counts.items() if k.startswith("backend_"))
    assert kills >= preset["kills"] >= 5, shown
    assert backend_kills >= preset["backend_kills"] >= 2, shown
    assert counts.get("flush", 0) >= preset["flushes"] >= 1, shown
    assert counts.get("cut", 0) >= preset["cuts"] >= 1, shown
    assert counts.get("restart", 0) >= preset["restarts"], shown
    assert counts.get("zombie", 0) >= preset["zombies"], shown
    options = {"kill_create": "create_kills", "kill_poll": "poll_kills", "kill_relay": "relay_kills"}
    for kind in MODEL_FAULTS:
        assert counts.get(kind, 0) >= preset[options.get(kind, kind + "s")] >= 1, shown
    errors = counts.get("provider_5xx", 0) + counts.get("provider_429", 0)
    assert errors >= preset["provider_errors"] >= 2, shown
    model = ("create_kills", "poll_kills", "relay_kills", "revokes", "provider_errors", "forgets")
    minimum = sum(preset[k] for k in ("kills", "backend_kills", "flushes", "cuts", "restarts", "zombies", *model))
    assert faults >= minimum, shown
    assert re.search(r"^visibility: .* redeliveries=[1-9]", out, re.MULTILINE), shown
