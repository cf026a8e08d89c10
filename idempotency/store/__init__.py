"""SQL and nothing of Celery (room 4): the database handle, its dialects and the statements it runs.

Reading order: `database` (the `Database` handle and THE translation of driver errors), `dialects` (PostgreSQL
and SQLite differences as small overrides), `pgbouncer` (PostgreSQL through PgBouncer in transaction mode),
`clock` (THE lease-liveness rule on the database clock), `tables` (table handles), `statements` (the claim
protocol's SQL, built once per dialect), `letter_statements` (the dead letters' SQL), `one_trip` (PostgreSQL's
one-round-trip statements), `driver` (the hot statements straight through the driver), `schema` (revision check
and upgrade), `identity` (what names the database's contents: a restore or a failover changes it).
Imports no celery, kombu, redis or click.
"""

__all__: list[str] = []  # a room: its modules are imported by their own paths
