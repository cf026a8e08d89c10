"""Resumable chain pipelines: one pipeline key reaches every link, so re-enqueuing replays finished links."""

from __future__ import annotations

from typing import Any

from celery import chain
from celery.canvas import Signature, _chain

from oncelery.runs.keys import validate_key
from oncelery.settings import HEADER_KEY, HEADER_PIPELINE, HEADER_TENANT
from oncelery.task.idempotent import IdempotentTask

__all__ = [
    "Pipeline",
    "link_key",
    "pipeline",
]


def link_key(pipeline_key: str, position: int, task_name: str) -> str:
    """Return the idempotency key of link `position` of a pipeline: stable across re-enqueues."""
    return validate_key(f"{pipeline_key}/{position}:{task_name}")


class Pipeline(_chain):  # type: ignore[misc]
    """A chain that gets fresh task ids each time it is enqueued, so `.get()` follows this enqueue only.

    Celery's chain writes the task ids it assigns into its own links when it is applied, so a second
    `flow.delay()` would reuse them, and its `.get()` would return the first enqueue's stored FAILURE at once
    while the worker resumes the pipeline. Each enqueue applies a copy: the keys (not the ids) carry over.
    """

    def apply_async(self, args: Any = None, kwargs: Any = None, **options: Any) -> Any:
        """Enqueue a copy of the pipeline with new task ids; its links keep their idempotency keys, and every link
        carries the tenant resolved here, once (the later links are sent by a worker, with no caller to ask)."""
        fresh = self.clone()
        for link in fresh.tasks:
            link.options.pop("task_id", None)
        fresh.options.pop("task_id", None)
        tenant = options.pop("tenant", None)
        _carry_tenant(fresh.tasks, fresh.options.pop("tenant", None) if tenant is None else tenant, args, kwargs)
        return _chain.apply_async(fresh, args, kwargs, **options)


def _carry_tenant(links: list[Signature], tenant: str | None, args: Any, kwargs: Any) -> None:
    """Stamp the pipeline's tenant (the call's, else the first link's task resolves it) on every idempotent link
    that has no tenant of its own: a link's own option, or its task's own `tenant`, wins."""
    first = links[0]
    task = first.type
    if isinstance(task, IdempotentTask):
        first_args = (*(args or ()), *first.args)
        first_kwargs = {**(kwargs or {}), **first.kwargs}
        tenant = task.entry_tenant(first_args, first_kwargs, tenant, first.options.get("headers"))
    if tenant is None:
        return
    for link in links:
        headers = {**(link.options.get("headers") or {})}
        own = link.options.get("tenant") is not None or HEADER_TENANT in headers
        if isinstance(link.type, IdempotentTask) and not own and link.type.tenant is None:
            headers[HEADER_TENANT] = validate_key(tenant, "tenant") if tenant else tenant
            link.set(headers=headers)


def pipeline(key: str, *signatures: Signature, **options: Any) -> chain:
    """Build a chain of idempotent tasks in which every link is keyed by `key` and its position.

    Celery does not carry headers down a chain, but each link's own options travel with it in the
    message, so each link gets its key header here. Enqueuing the same pipeline again answers finished
    links from their stored results and executes only the failed link and those after it; each enqueue
    of the returned object gets fresh task ids (see `Pipeline`).
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
    return Pipeline(*links, **options)
