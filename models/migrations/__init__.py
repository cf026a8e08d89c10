"""Alembic migrations for Oncelery's tables; applied by `oncelery db upgrade`."""
