"""How a run row is claimed, renewed, completed, failed and read (room 3): the protocol, without Celery.

Reading order: `encoding` (canonical JSON, keyed digests, a value's text in a key), `keys` (idempotency keys and
fingerprints), `secrets` (the keys a database generates for itself), `legacy` (runs stored in the forms before
keyed digests and injective keys), `decisions` (what a claim is and decides), `claims` (each transition as one
token-guarded statement), `claim_rounds` (how a claim is settled: a new key inserted, a run found decided on, an
expired or FAILED one taken over), `letters` (dead letters written with their state change), `outcomes` (exact
outcome counts, and cached replays' counts), `views` (the read side), `browse` and `timeline` (the pages of
Flower's Runs section: keyset pages on an index, one run's history), `faults` (named fault points on a delivery's
path, for tests). Imports no celery, kombu, redis or click.
"""

__all__: list[str] = []  # a room: its modules are imported by their own paths
