"""The relay: the background loop (`oncelery relay`) and the jobs it runs each round.

A worker acks a delivery and moves on; whatever must happen later, or again, happens here, on the database clock:
publishing committed outbox rows, re-sending lost runs, waking due WAITING runs, sending due debounce bursts,
pooling parked batch items into provider batches, and purging what retention allows. Every job is safe to run
twice and from two relays at once: each takes its rows with a guarded statement (or the batcher's lease).

Reading order: `loop` (`Relay`: one round, in order, and `install_relay_task`), `outbox` (the outbox's write side
and `send_keyed`, the one way a stored job goes back on the broker; `rows`, what the relay writes on outbox rows),
`debounce` (the dispatcher of due bursts), `waker` (re-sends due WAITING runs), `sweeper` (re-sends lost runs;
`unacked`, a dead holder's message back from Redis), `batcher` (a package split by stage: stage, submit, poll,
suspects), `retention` (purge in bounded batches). The run-state changes these make are functions of
oncelery.runs (sweeps, retention, debounce).
"""

__all__: list[str] = []  # a room: its modules are imported by their own paths
