"""What runs beside deliveries (room 5): publishing, sweeping, dead letters, retention and reporting.

Reading order: `outbox` (the outbox's write side and `send_keyed`, the one way a stored job goes back on the
broker), `relay` (publishes committed rows; `relay_rows`, what it writes on them), `debounce` (the dispatcher of
due bursts), `sweeper` (re-sends lost runs and wakes due ones; `unacked`, a dead holder's message back from Redis),
`dead_letters` (list, show, replay, purge), `retention` (purge in bounded batches), `metrics` (Prometheus, read at
scrape time; `histograms` and `ledger_metrics` its families, `exporter` serves them), `costs` (the ledger's read
side), `fork` (fork a past run from a step; `fork_preview`, its cost before and its diff after; `fork_cohort`, one
change over many runs under a cap), `reach` (up-front reachability of a command's services). The run-state
changes these make are functions of oncelery.runs (letters, sweeps, retention, debounce, forks).
"""

__all__: list[str] = []  # a room: its modules are imported by their own paths
