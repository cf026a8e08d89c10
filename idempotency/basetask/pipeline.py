"""Resumable chain pipelines: one pipeline key reaches every link, so re-enqueuing replays finished links.

A link whose task names its own key (a template or callable, or a per-call key) is that key's run, whatever the door:
the same call through `pipeline()` and through `.delay()` is one run. Only a link with no key of its own is keyed by
the pipeline key and its position: its arguments are all that would tell it apart otherwise (docs/pipelines.md).
"""

from __future__ import annotations

from typing import Any

from celery import chain
from celery.canvas import Signature, _chain

from oncelery.basetask.idempotent import IdempotentTask
from oncelery.runs.keys import pipeline_link_key, validate_key
from oncelery.settings import HEADER_KEY, HEADER_PIPELINE, HEADER_PIPELINE_LINK, HEADER_TENANT

__all__ = [
    "Pipeline",
    "link_key",
    "pipeline",
]


def link_key(pipeline_key: str, position: int, task_name: str) -> str:
    """Return the idempotency key of link `position` of a pipeline (a link with no key of its own): stable across
    re-enqueues."""
    return pipeline_link_key(pipeline_key, position, task_name)


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
    """Build a chain of idempotent tasks that resumes under `key`: each link keeps its task's own key, and a link
    with none is keyed by `key` and its position.

    Celery does not carry headers down a chain, but each link's own options travel with it in the
    message, so each link gets its headers here. Enqueuing the same pipeline again answers finished
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
        headers[HEADER_PIPELINE] = key
        if link.options.get("idempotency_key") is not None:
            pass  # a per-call key: the link's key before this change too (apply_async's option won over the header)
        elif HEADER_KEY in headers or _names_its_key(link):
            # The task's own key: a `.delay()` of the same call is this run. The position lets a worker find the run
            # stored before under the pipeline-derived key every link had then (runs/legacy.py).
            headers[HEADER_PIPELINE_LINK] = position
        else:
            headers[HEADER_KEY] = link_key(key, position, str(link.task))
        link.set(headers=headers)
        links.append(link)
    return Pipeline(*links, **options)


def _names_its_key(link: Signature) -> bool:
    """Whether the link's task derives a key of its own; a task this process does not know counts as keyless (keyed
    by the pipeline, as before): its options cannot be read here."""
    try:
        task = link.type
    except KeyError:  # NotRegistered: a signature by name, for a worker elsewhere
        return False
    return isinstance(task, IdempotentTask) and task.names_its_key()
