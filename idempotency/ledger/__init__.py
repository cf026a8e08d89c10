"""The cost ledger (below the call layer, beside the run protocol): prices, rows, settlement, unknown outcomes, the
spool, and the one interface the rooms above record a model call through.

Reading order: `prices` (a model's `Price`, exact, and `price_for`: the app's `oncelery_prices` first, else
LiteLLM's table shipped in `data/` or the file the app names, and `batch_micros`, a batch item's share; every room
below the base task prices through it), `rows` (one model call's row, written once per call id, with the running
totals), `settle` (a call's budget reservation released and its cost charged, once), `unknown` (an intent that may
have been created and will never be answered ends with a row at its estimate: provider creates never exceed
ledger rows), `recording` (`CallLedger`: those four behind one object the basetask room and the relay make for an
app, and the call layer, the batcher and the cancel path price and record their calls through), `spool` (a row
the database cannot take waits in this process's spool file and is written once it answers; `spool_files`, the
files and their replay, which the worker's start runs through oncelery.basetask.startup).
Imports no celery, kombu, redis or click.
"""

__all__: list[str] = []  # a room: its modules are imported by their own paths
