"""What happens on one delivery, in order (room 2): the decision table and what each row does.

Reading order: `delivered` (what a delivery is given: the call, the task protocol, the live run), `decision_table`
(the `Delivery`: one small method per row of what the claim found), `claimed` (its CLAIMED row: the body run
under a renewed lease, then completed, failed, parked or given up), `replay_cache` (a duplicate answered from
Redis before the database), `renewal` (the lease heartbeat while a body runs), `steps` (checkpoints), `effects`
(the fenced writes), `resend` (sending a delivery back after a store fault or a wait).
"""

__all__: list[str] = []  # a room: its modules are imported by their own paths
