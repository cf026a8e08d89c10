"""The cost ledger's writes (below the call layer, beside the run protocol): rows, settlement, unknown outcomes,
and the one interface the rooms above record a model call through.

Reading order: `prices` (a model's `Price`, exact, and `price_for`: the app's `oncelery_prices` first, else LiteLLM's
table shipped in `data/` or the file the app names, and `batch_micros`, a batch item's share; every room below
the task prices through it),
`rows` (one model call's row, written once per call id, with the running totals), `settle` (a call's budget
reservation released and its cost charged, once), `unknown` (an intent that may have been created and will never
be answered ends with a row at its estimate: provider creates never exceed ledger rows), `recording` (`CallLedger`:
those four behind one object the basetask room and the relay make for an app, and the call layer, the batcher and the
cancel path price and record their calls through).
Imports no celery, kombu, redis or click.
"""

__all__: list[str] = []  # a room: its modules are imported by their own paths
