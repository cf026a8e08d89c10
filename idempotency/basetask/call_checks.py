"""What `apply_async` refuses in the caller that every delivery would refuse: the payload's size, key and JSON.

A layer of `IdempotentTask` (`body` <- `call_checks` <- `idempotent`): the checks its producer side runs on the
arguments as a worker will see them, before anything is published.
"""

from __future__ import annotations

import logging
from typing import Any

from kombu.serialization import dumps, loads, prepare_accept_content

from oncelery.basetask.body import RunBody
from oncelery.errors import ConfigurationError, ForkRefused, PayloadTooLarge
from oncelery.settings import FORK_KEY_PREFIX, payload_limits

__all__ = [
    "CallChecks",
]

# The task's logger: this class is a part of IdempotentTask.
logger = logging.getLogger("oncelery.task")


class CallChecks(RunBody):
    """The caller-side checks of an IdempotentTask: a call refused here is never published."""

    def _check_at_call_time(
        self, args: Any, kwargs: Any, key: str | None, tenant: str | None, serializer: str | None
    ) -> tuple[list[Any], dict[str, Any]] | None:
        # The worker sees the arguments after a round trip through the serializer (kombu's JSON turns a
        # UUID, datetime or Decimal back into that object): derive the identity from the same values here,
        # so what every delivery would refuse is refused in the caller, not acked in a worker at 3 a.m.
        content_type, encoding, body = dumps(
            (list(args or ()), dict(kwargs or {})), serializer=serializer or self.serializer
        )
        self._check_payload_size(body)
        accept = prepare_accept_content(self.app.conf.accept_content)
        seen_args, seen_kwargs = loads(body, content_type, encoding, accept=accept)
        try:
            self._keys.bind(seen_args, seen_kwargs)
        except ConfigurationError:
            # A chain link gets its first argument from the previous link, in the worker: checked there.
            return None
        # No database needed here (producers need none): a content-addressed key is keyed where a database is, so
        # the key and tenant are checked, and the payload's JSON; the arguments as a worker will see them are
        # returned for the producer's check, which runs only where a claims database is configured.
        call = self.key_of(seen_args, seen_kwargs, key, tenant)
        if call.key is not None and call.key.startswith(FORK_KEY_PREFIX):
            # A fork's run is sent by the fork command alone (its header names the fork): a producer's key there
            # would name another run's fork, and would have been run as it (its source's steps, another tenant's).
            raise ForkRefused.reserved(self.name, call.key)
        self.version_of(seen_args, seen_kwargs)
        return list(seen_args), dict(seen_kwargs)

    def _check_payload_size(self, body: str | bytes) -> None:
        # Measured on the encoding just made for the checks (no second one on the hot path): kombu's JSON escapes
        # every non-ASCII character, so its length in characters is the size in bytes the broker gets.
        warn, limit = self._payload_limits()
        size = len(body)
        if limit is not None and size > limit:
            raise PayloadTooLarge.of(self.name, size, limit)
        if warn is not None and size > warn:
            logger.warning(
                "%s: the arguments are %d bytes of JSON (oncelery_warn_payload_bytes=%d): pass a reference "
                "(an id, a URL) and let the task load the data",
                self.name,
                size,
                warn,
            )

    def _payload_limits(self) -> tuple[int | None, int | None]:
        # Read once per app configuration: a Celery setting that is not set costs ~4 us to look up, per call.
        conf = self.app.conf
        seen = self.__dict__.get("_payload_limits_of")
        if seen is None or seen[0] is not conf:
            seen = (conf, payload_limits(self.settings()))
            self.__dict__["_payload_limits_of"] = seen
        return seen[1]  # type: ignore[no-any-return]
