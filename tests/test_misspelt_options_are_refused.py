"""A misspelt Oncelery option is refused where it is written, with "did you mean ...?": at decoration for a task
option (Celery would keep it as an attribute nothing reads), at the call for a per-call option (Celery would drop
it). Celery's own options and a user's own task attributes are left alone."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest
from celery import Celery

from oncelery import ConfigurationError, IdempotentTask
from oncelery.errors import UnknownOption
from tests.conftest import offline_job


@pytest.fixture
def app() -> Iterator[Celery]:
    """An app on an in-memory broker and no database: the checks run in the caller."""
    app = Celery("misspelt-options", broker="memory://", set_as_current=False)
    yield app
    app.close()


def created(app: Celery, name: str, **options: Any) -> Any:
    """The task `name` with `options`, created now (Celery defers a task of an unfinalized app to its first use)."""
    job = offline_job(app, name, **options)
    _ = job.name  # evaluates Celery's lazy proxy: the task class is made and checked here
    return job


@pytest.mark.parametrize(
    ("given", "meant"),
    [
        ({"idempotency_kye": "doc:{doc}"}, "idempotency_key"),
        ({"fingerprints": ["doc"]}, "fingerprint"),
        ({"on_inprogress": "skip"}, "on_in_progress"),
        ({"max_leas": 30}, "max_lease"),
        ({"tenat": "acme"}, "tenant"),
    ],
)
def test_a_misspelt_task_option_is_refused_at_decoration(app: Celery, given: dict[str, Any], meant: str) -> None:
    """The task is not created; the error names the option and the one it is close to."""
    (wrong,) = given
    with pytest.raises(UnknownOption, match=f"task option {wrong}= is not an Oncelery option; did you mean {meant}="):
        created(app, "oncelery.t_misspelt", **given)


def test_an_unknown_option_in_our_namespace_is_refused_and_a_users_own_attributes_are_kept(app: Celery) -> None:
    """`oncelery_*`/`idempotency_*` names are ours even when close to none; Celery's options, a name extending
    one of ours (`tenant_id`) and any other attribute of the user's stay accepted, as Celery keeps them."""
    own = {"tenant_id": "acme", "entity_id": 7, "my_client": None, "max_retries": 2, "autoretry_for": (ValueError,)}
    job = created(app, "oncelery.t_own", idempotency_key="doc:{doc}", **own)
    assert job.tenant_id == "acme" and job.max_retries == 2
    with pytest.raises(ConfigurationError, match="oncelery_retries= is not an Oncelery option; Oncelery's options"):
        created(app, "oncelery.t_ours", oncelery_retries=3)


def test_a_misspelt_option_on_a_task_class_is_refused_when_it_is_registered(app: Celery) -> None:
    """A class-based task: what the class adds is checked too; what its bases define is not."""

    class Charge(IdempotentTask):  # type: ignore[misc]
        name = "oncelery.t_class"
        idempotency_kye = "charge:{order_id}"

        def run(self, order_id: str) -> str:
            return order_id

    with pytest.raises(UnknownOption, match="did you mean idempotency_key="):
        app.register_task(Charge())


@pytest.mark.parametrize(
    ("given", "meant"),
    [
        ({"idempotecy_key": "doc-1"}, "idempotency_key"),
        ({"tenat": "acme"}, "tenant"),
        ({"on_in_progres": "raise"}, "on_in_progress"),
        ({"leese": 30}, "lease"),
        ({"idempotency_keys": "doc-1"}, "idempotency_key"),
    ],
)
def test_a_misspelt_call_option_is_refused_at_apply_async_and_nothing_is_published(
    app: Celery, published: list[str], given: dict[str, Any], meant: str
) -> None:
    """Celery would drop the option and publish the job unkeyed; the caller refuses it with the name meant, also
    through a signature. Celery's own call options still pass."""
    job = offline_job(app, "oncelery.t_call")
    (wrong,) = given
    with pytest.raises(
        UnknownOption, match=f"apply_async option {wrong}= is not an Oncelery option; did you mean {meant}="
    ):
        job.apply_async(("doc",), **given)
    with pytest.raises(UnknownOption, match=f"did you mean {meant}="):
        job.s("doc").apply_async(**given)
    assert published == []
    job.apply_async(("doc",), idempotency_key="doc-1", countdown=0, priority=3, queue="celery")
    assert published == [job.name]
