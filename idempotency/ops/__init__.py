"""What an operator runs beside deliveries (room 5): dead letters, reporting, forks and reachability checks.

Reading order: `dead_letters` (list, show, replay, purge), `metrics` (Prometheus, read at scrape time;
`histograms` and `ledger_metrics` its families, `exporter` serves them), `costs` (the ledger's read side), `fork`
(fork a past run from a step; `fork_preview`, its cost before and its diff after; `fork_cohort`, one change over
many runs under a cap), `reach` (up-front reachability of a command's services). The background loop and its jobs
(outbox, sweeper, waker, debounce dispatch, batcher, retention) are the room below, oncelery.relay. The run-state
changes these make are functions of oncelery.runs (letters, forks).
"""

__all__: list[str] = []  # a room: its modules are imported by their own paths
