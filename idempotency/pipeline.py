"""Resumable chain pipelines: one pipeline key reaches every link, so re-enqueuing replays finished links."""

from __future__ import annotations

from typing import Any

from celery import chain
from celery.canvas import Signature

from oncelery.keys import validate_key
from oncelery.settings import HEADER_KEY, HEADER_PIPELINE


def link_key(pipeline_key: str, position: int, task_name: str) -> str:
    """Return the idempotency key of link `position` of a pipeline: stable across re-enqueues."""
    return validate_key(f"{pipeline_key}/{position}:{task_name}")


def pipeline(key: str, *signatures: Signature, **options: Any) -> chain:
    """Build a chain of idempotent tasks in which every link is keyed by `key` and its position.

    Celery does not carry headers down a chain, but each link's own options travel with it in the
    message, so each link gets its key header here. Enqueuing the same pipeline again answers finished
    links from their stored results and executes only the failed link and those after it.
    """
    validate_key(key)
    if not signatures:
        raise ValueError("pipeline() needs at least one signature")
    links = []
    for position, sig in enumerate(signatures):
        link = sig.clone()
        headers = {**(link.options.get("headers") or {})}
        headers[HEADER_KEY] = link_key(key, position, str(link.task))
        headers[HEADER_PIPELINE] = key
        link.set(headers=headers)
        links.append(link)
    return chain(*links, **options)
