"""`oncelery cache flush`: empty the replay cache's entries of the claims database (after a restore, or a purge
whose command could not reach the cache)."""

from __future__ import annotations

import click

from oncelery.cli.context import celery_app_of, resolve_database_url
from oncelery.delivery.replay_cache import ReplayCache, configured_cache
from oncelery.errors import ConfigurationError
from oncelery.settings import CONF_REPLAY_CACHE, ENV_REPLAY_CACHE
from oncelery.store.database import safe_url

__all__ = ["cache"]


@click.group()
def cache() -> None:
    """The replay cache: duplicates of finished runs answered from Redis (oncelery_replay_cache)."""


@cache.command("flush")
@click.option(
    "--cache-url",
    metavar="URL",
    default=None,
    help=f"The cache's Redis. Default: the Celery app's {CONF_REPLAY_CACHE}, else ${ENV_REPLAY_CACHE}.",
)
@click.pass_context
def cache_flush(ctx: click.Context, cache_url: str | None) -> None:
    """Delete every cache entry of the claims database: its duplicates are then answered by the database."""
    url = resolve_database_url(ctx)
    replay = _cache_of(ctx, url, cache_url)
    n = replay.flush()
    click.echo(f"flushed {n} replay cache entr{'y' if n == 1 else 'ies'} of {safe_url(url)}")


def _cache_of(ctx: click.Context, database_url: str, cache_url: str | None) -> ReplayCache:
    conf = {CONF_REPLAY_CACHE: cache_url} if cache_url else getattr(celery_app_of(ctx), "conf", None)
    replay = configured_cache(conf, database_url)
    if replay is None:
        raise ConfigurationError(
            f"No replay cache configured: pass --cache-url, set {ENV_REPLAY_CACHE}, or set "
            f"app.conf.{CONF_REPLAY_CACHE} in the app given with `celery -A`"
        )
    return replay
