"""Apply and check Alembic migrations programmatically (no alembic.ini needed)."""

from __future__ import annotations

from alembic import command
from alembic.config import Config
from sqlalchemy.engine import Engine


def alembic_config(engine: Engine) -> Config:
    """Return an Alembic config whose scripts are this package's migrations, bound to `engine`."""
    cfg = Config()
    cfg.set_main_option("script_location", "oncelery.models:migrations")
    # ConfigParser interpolates "%": an encoded password (p%40ss) must be escaped.
    cfg.set_main_option("sqlalchemy.url", engine.url.render_as_string(hide_password=False).replace("%", "%%"))
    return cfg


def upgrade(engine: Engine, revision: str = "head") -> None:
    """Create or migrate Oncelery's schema on `engine` to `revision`, in one transaction."""
    cfg = alembic_config(engine)
    with engine.begin() as conn:
        cfg.attributes["connection"] = conn
        command.upgrade(cfg, revision)


def downgrade(engine: Engine, revision: str) -> None:
    """Revert Oncelery's schema on `engine` to `revision` (use "base" to drop every table)."""
    cfg = alembic_config(engine)
    with engine.begin() as conn:
        cfg.attributes["connection"] = conn
        command.downgrade(cfg, revision)
