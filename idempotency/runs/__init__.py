"""How a run row is claimed, renewed, completed, failed and read (room 3): the protocol, without Celery.

Reading order: `encoding` (canonical JSON, keyed digests, a value's text in a key), `keys` (idempotency keys and
fingerprints), `secrets` (the keys a database generates for itself), `legacy` (runs stored in the forms before
keyed digests and injective keys), `decisions` (what a claim is and decides), `claims` (each transition as one
token-guarded statement), `claim_rounds` (how a claim is settled: a new key inserted, a run found decided on, an
expired or FAILED one taken over), `letters` (dead letters written with their state change; a DEAD run replayed
or purged), `outcomes` (exact outcome counts, and cached replays' counts), `waits` (a duplicate's wait for a live
holder, counted once), `views` (the read side), `browse` and `timeline` (the pages of Flower's Runs section: keyset
pages on an index, one run's history), `kept` (the arguments a completed run keeps, shown redacted), `debounce`
(a burst of edits makes one run: its row, dispatch and supersede), `forks` (a fork's row, written and read),
`sweeps` (the runs the relay re-sends, marked first: lost, due to wake), `retention` (a finished run deleted with
its rows, kept arguments cleared), `faults` (named fault points on a delivery's path, and a lease expired, for
tests).

A run's row is changed only by a function here (its SQL may be store/'s), never from another room: the one
exception is the ledger's cost sums (ledger/rows.py). docs/architecture.md ("Who changes a run") names them;
tests/test_only_the_runs_room_changes_a_run.py fails on a write built anywhere else. Imports no celery, kombu,
redis or click.
"""

__all__: list[str] = []  # a room: its modules are imported by their own paths
