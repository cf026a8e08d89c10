"""The chaos runner: N multi-step jobs through real workers, real Redis and a real PostgreSQL under faults.

    python -m tests.chaos --preset ci            # 500 jobs, 20 % duplicates, every fault kind, < 4 min
    python -m tests.chaos --preset full          # 10,000 jobs, 30 % duplicates, >= 50 kills ...

Modelled on Jepsen's queue checker: the runner records every submitted job, and the jobs record every attempt
and effect, in a ledger the system under test cannot touch (tests/chaos/ledger.py); the verdict counts lost,
duplicated and unexpected effects (tests/chaos/checker.py). Modules: `jobs` (the Celery app the workers
load), `ledger`, `proxy` (the cut-off host's TCP proxy), `procs` (Redis, workers, relay), `faults`,
`checker`, `runner` (the schedule and the verdict), `__main__` (the command line and its presets).
"""
