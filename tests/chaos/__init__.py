"""The chaos runner: N multi-step jobs through real workers, real Redis and a real PostgreSQL under faults.

    python -m tests.chaos --preset ci            # 170 jobs, 20 % duplicates, every fault kind, about a minute
    python -m tests.chaos --preset full          # 10,000 jobs, 30 % duplicates, >= 50 kills ...

Modelled on Jepsen's queue checker: the runner records every submitted job, and the jobs record every attempt
and effect, in a ledger the system under test cannot touch (tests/chaos/ledger.py), and the fake model provider,
a process of the runner's, counts every model call it was sent; the verdict counts lost, duplicated and
unexpected effects (tests/chaos/checker.py), and calls without a ledger row, unlabelled repeats, overspent
budgets and reservations left (tests/chaos/model_ledger.py). Modules: `model` (the job's model call: model,
price, prompt), `jobs` (the Celery app the workers load), `ledger`, `proxy` (the cut-off host's TCP proxy),
`procs` (Redis, the fake provider, workers, relay), `relay` (the relay's entry point), `faults` and
`model_faults`, `checker` and `model_ledger`, `runner` (the schedule and the verdict), `report`, `__main__`
(the command line and its presets).
"""
