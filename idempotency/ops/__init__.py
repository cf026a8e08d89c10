"""What runs beside deliveries (room 5): publishing, sweeping, dead letters, retention and reporting.

Reading order: `outbox` (the outbox's write side and `send_keyed`, the one way a stored job goes back on the
broker), `relay` (publishes committed rows; `relay_rows`, what it writes on them), `sweeper` (re-sends lost
runs), `dead_letters` (list, show, replay), `retention` (purge in bounded batches), `metrics` (Prometheus, read at
scrape time), `costs` (the ledger's read side), `reach` (up-front reachability of a command's services).
"""

__all__: list[str] = []  # a room: its modules are imported by their own paths
