"""The base task: `IdempotentTask` and the Celery glue around it, what a user declares and calls (room 1 of a
delivery's lifecycle). Named apart from the demo's jobs, `oncelery.tasks`, so the two are never confused.

Reading order: `idempotent` (the `IdempotentTask` base class: one delivery's entry), `options` (what a task
declares; `option_checks`, its checks at decoration time), `call_checks` (what a call is refused before it is
sent), `body` (the API a body calls on `self`: step, effects, seeds), `announce` and `caller` (telling Flower
and the caller what was decided), `metering` (the cost ledger's write side: `model_call`, and `price_of`, the
current app's `ledger.prices.price_for`; `unbudgeted`, its warning where budgets or limits apply), `pipeline`
(one key through a chain), `startup` (the worker's refusal to start without a ready claims database).
"""

__all__: list[str] = []  # a room: its modules are imported by their own paths
