"""Alembic environment of the demo jobs' tables (see oncelery.models.migrate)."""

from alembic import context

import oncelery.models.jobs  # noqa: F401  (every table in the metadata; the branch filter picks its own)
from oncelery.models.migrate import run_env

run_env(context)
