"""The Runs section's pages in Flower: Tornado handlers on Flower's own base handler, and where templates come from.

    GET  /runs                          runs, newest first, filtered by task, status, tenant, outcome; keyset pages
    GET  /runs/<id>                     one run: its attempts (steps, model call intents, ledger rows), letter, forks
    GET  /runs/<id>?fork_from=STEP      ... with the cost preview of a fork from STEP (`oncelery fork --dry-run`)
    POST /runs/<id>/replay/<letter>     replay the run's dead letter (`oncelery dlq replay`'s guard and code)

Every handler is Flower's `BaseHandler`: Flower's login (basic auth, OAuth), its XSRF rule for a POST, its error
pages, its `--read_only` (no replay). Reads and the replay run on Flower's thread pool, never on the event loop that
receives task events. A payload is shown only through the CLI's redaction (`runs show`'s `run_detail`, `dlq show`'s
`letter_detail`): the pages have no way to show one in clear.
"""

from __future__ import annotations

import functools
import json
from dataclasses import dataclass
from datetime import datetime
from decimal import Decimal
from pathlib import Path
from typing import Any
from urllib.parse import urlencode

from flower.app import rewrite_handler
from flower.views import BaseHandler
from tornado import template, web
from tornado.ioloop import IOLoop

from oncelery.cli.dlq import letter_detail, replay_letters
from oncelery.cli.format import _cell, _utc, to_json
from oncelery.cli.runs import run_detail
from oncelery.errors import ConfigurationError, OnceleryError
from oncelery.models import RunStatus
from oncelery.ops.dead_letters import DeadLetters, ReplayState
from oncelery.ops.fork import preview_fork
from oncelery.runs.browse import OUTCOMES, RunFilter, browse_runs, known_names
from oncelery.runs.timeline import RunTimeline, read_timeline
from oncelery.runs.views import Runs

__all__ = ["ReplayHandler", "RunHandler", "RunsHandler", "install"]

TEMPLATES = Path(__file__).with_name("templates")
_OURS = "oncelery/"  # template names under this prefix are ours; every other name is Flower's
_SECTION = "oncelery_runs"
# Flower's navbar gets one more tab; Tornado template text, rendered in the navbar's own namespace.
_RUNS_TAB = (
    '<li class="nav-item"><a class="nav-link{% if active_tab == \'runs\' %} active{% end %}" '
    "href=\"{{ reverse_url('oncelery_runs') }}\">Runs</a></li>\n"
)


class _Templates(template.Loader):
    """Flower's templates; ours under `oncelery/`; Flower's navbar with a Runs tab at the end of its tab list."""

    def resolve_path(self, name: str, parent_path: str | None = None) -> str:
        """Every name is from the root (ours extend Flower's `base.html`)."""
        return name

    def _create_template(self, name: str) -> template.Template:
        if name.startswith(_OURS):
            return template.Template((TEMPLATES / name.removeprefix(_OURS)).read_bytes(), name=name, loader=self)
        if name == "navbar.html":
            head, end, tail = (Path(self.root) / name).read_text().partition("</ul>")
            if end:  # else a navbar of another shape: Flower's own, as it ships (the section is still at /runs)
                return template.Template(head + _RUNS_TAB + end + tail, name=name, loader=self)
        return super()._create_template(name)


@dataclass(frozen=True)
class _Section:
    """What the pages read and publish with: the claims database and Flower's Celery app."""

    url: str
    capp: Any
    reader: Runs


def install(web_app: Any, url: str) -> None:
    """Add the Runs pages to Flower's Application `web_app`, reading the claims database `url`."""
    if not web_app.capp.conf.get("oncelery_database_url"):
        web_app.capp.conf.oncelery_database_url = url  # where preview_fork reads (as `oncelery fork` sets it)
    web_app.settings[_SECTION] = _Section(url, web_app.capp, Runs(url))
    web_app.settings["template_loader"] = _Templates(web_app.settings["template_path"])
    handlers = [
        web.url(r"/runs", RunsHandler, name="oncelery_runs"),
        web.url(r"/runs/(\d+)", RunHandler, name="oncelery_run"),
        web.url(r"/runs/(\d+)/replay/(\d+)", ReplayHandler, name="oncelery_replay"),
    ]
    if web_app.options.url_prefix:
        handlers = [rewrite_handler(h, web_app.options.url_prefix) for h in handlers]
    web_app.add_handlers(r".*", handlers)  # before Flower's own catch-all 404


class _Page(BaseHandler):  # type: ignore[misc]
    """Flower's handler (auth, XSRF, errors), with the section's database and the formatting the pages use."""

    @property
    def section(self) -> _Section:
        """The claims database and Celery app the pages use."""
        return self.application.settings[_SECTION]  # type: ignore[no-any-return]

    def arg(self, name: str) -> str | None:
        """A query or form argument as given (the template escapes it), or None when empty."""
        value = self.get_argument(name, None, escape=False)
        return value.strip() or None if value is not None else None

    async def off_loop(self, fn: Any, *args: Any) -> Any:
        """Run `fn(*args)` on Flower's thread pool (a database read, a publish): the event loop keeps receiving."""
        try:
            return await IOLoop.current().run_in_executor(None, functools.partial(fn, *args))
        except OnceleryError as exc:  # StoreUnavailable, SchemaMissing: their message names the fix
            raise web.HTTPError(503, str(exc)) from exc

    async def show_run(self, run_id: int, notice: str | None = None, failed: bool = False) -> None:
        """Render run `run_id` with `notice` (an action's outcome) above it; 404 if there is no such run."""
        fork_from, sets = self.arg("fork_from"), [s for s in (self.arg("set") or "").splitlines() if s.strip()]
        page = await self.off_loop(_read_page, self.section, run_id, fork_from, sets)
        if page is None:
            raise web.HTTPError(404, f"No run {run_id}: see the runs list")
        replayed = self.arg("replayed")
        if notice is None and replayed is not None and replayed.isdigit():
            notice = f"Dead letter {replayed} replayed: its run is FAILED again and its message was sent."
        self.render("oncelery/run.html", active_tab="runs", notice=notice, failed=failed, fork_from=fork_from,
                    sets="\n".join(sets), read_only=bool(self.application.options.read_only), **page)  # fmt: skip

    def get_template_namespace(self) -> dict[str, Any]:
        """Tornado's namespace, with the formatting helpers of the Runs templates."""
        namespace: dict[str, Any] = super().get_template_namespace()
        helpers = {"cell": _cell, "dollars": _dollars, "as_json": _as_json, "badge": _badge, "pairs": _pairs}
        namespace.update(helpers)
        return namespace


class RunsHandler(_Page):
    """GET /runs: a page of runs, newest first, filtered; `before` continues below the previous page."""

    @web.authenticated  # type: ignore[untyped-decorator]
    async def get(self) -> None:
        """Render the runs list."""
        try:
            status = self.arg("status")
            flt = RunFilter(self.arg("task"), RunStatus(status.upper()) if status else None, self.arg("tenant"),
                            self.arg("outcome"))  # fmt: skip
            before = _row_id(self.arg("before") or "0") or None
        except (ValueError, ConfigurationError) as exc:
            raise web.HTTPError(400, str(exc)) from exc
        db = self.section.reader.db
        page, (tasks, tenants) = await self.off_loop(lambda: (browse_runs(db, flt, before), known_names(db)))
        shown = {k: v for k, v in (("task", flt.task_name), ("status", status), ("tenant", flt.tenant),
                                   ("outcome", flt.outcome)) if v}  # fmt: skip
        older = None if page.next_before is None else urlencode({**shown, "before": page.next_before})
        self.render(
            "oncelery/runs.html", active_tab="runs", page=page, flt=flt, tasks=tasks, tenants=tenants,
            statuses=[s.value for s in RunStatus], outcomes=list(OUTCOMES), newest=urlencode(shown),
            older=older, before=before,
        )  # fmt: skip


class RunHandler(_Page):
    """GET /runs/<id>: one run's page; with `fork_from` (and `set` lines), a fork's dry-run cost preview."""

    @web.authenticated  # type: ignore[untyped-decorator]
    async def get(self, run_id: str) -> None:
        """Render the run page."""
        await self.show_run(_row_id(run_id))


class ReplayHandler(_Page):
    """POST /runs/<id>/replay/<letter>: replay the run's dead letter as `oncelery dlq replay <letter>` does."""

    @web.authenticated  # type: ignore[untyped-decorator]
    async def post(self, run_id: str, letter_id: str) -> None:
        """Replay the letter, then show the run with what happened (redirected on success)."""
        if self.application.options.read_only:
            raise web.HTTPError(403, "Flower runs with --read_only: replay with `oncelery dlq replay` instead")
        try:
            why = await self.off_loop(_replay, self.section, _row_id(run_id), _row_id(letter_id))
        except ConfigurationError as exc:  # the guard refused: no letter was touched
            why = str(exc)
        if why is None:
            self.redirect(f"{self.reverse_url('oncelery_run', run_id)}?{urlencode({'replayed': letter_id})}")
            return
        self.set_status(409)
        await self.show_run(_row_id(run_id), f"Dead letter {letter_id} not replayed: {why}", failed=True)


def _row_id(text: str) -> int:
    """A row id from the URL or a form: 400 unless it is a whole number a BIGINT holds."""
    try:
        value = int(text)
    except ValueError:
        value = -1
    if not 0 <= value < 2**63:
        raise web.HTTPError(400, f"{text!r} is not a row id")
    return value


def _replay(section: _Section, run_id: int, letter_id: int) -> str | None:
    """Replay letter `letter_id` of run `run_id` as `dlq replay` selects and replays it; None, or why not."""
    found = [x for x in DeadLetters(section.url).list(ids=[letter_id], limit=None) if x.run_id == run_id]
    if not found:
        return "no dead letter matched (replayed already?)"
    report, replayed = replay_letters(section.capp, section.url, found)
    if report.skipped:
        return report.skipped[0][1]
    if any(x.replay is ReplayState.QUEUED for x in replayed):
        return f"replayed, but its message is queued in the outbox ({report.publish_error}): run `oncelery relay`"
    return None


def _read_page(section: _Section, run_id: int, fork_from: str | None, sets: list[str]) -> dict[str, Any] | None:
    """Everything the run page shows, redacted as `runs show` and `dlq show` redact (never in clear)."""
    timeline = read_timeline(section.reader, run_id)
    if timeline is None:
        return None
    run = timeline.run
    # (Only with ids: DeadLetters.list reads every letter when given none.)
    ids = timeline.letter_ids
    letters = DeadLetters(section.url).list(ids=ids, include_replayed=True, limit=None) if ids else []
    preview, preview_error = None, None
    if fork_from is not None:
        try:
            preview = preview_fork(section.capp, run.task_name, run.key, from_step=fork_from, overrides=sets,
                                   tenant=run.tenant).as_json()  # fmt: skip
        except ConfigurationError as exc:  # not COMPLETED, no such step, a bad --set: what `fork --dry-run` says
            preview_error = str(exc)
    return {
        "run": run,
        "detail": run_detail(run, timeline.steps, timeline.calls, show_payload=False),
        "attempts": _attempts(timeline),
        "timeline": timeline,
        "letters": [(letter_detail(x), x.replayable) for x in letters],
        "preview": preview,
        "preview_error": preview_error,
    }


def _attempts(timeline: RunTimeline) -> list[tuple[int, list[dict[str, Any]]]]:
    """Per holder (fencing token), its steps and model calls in position order, each a row of the timeline."""
    out = []
    ledger = {c.ledger_call_id: c for c in timeline.calls if c.ledger_call_id}
    for attempt in timeline.attempts():
        rows: list[tuple[tuple[int, int, int], dict[str, Any]]] = []
        for st in attempt.steps:
            rows.append(((st.position, 1, 0), {"kind": "step", "position": st.position, "name": st.name,
                         "state": "checkpointed", "seconds": st.seconds, "at": st.created_at}))  # fmt: skip
        for i in attempt.intents:
            call = ledger.get(i.public_id)
            rows.append(((i.position, 0, i.attempt), {
                "kind": "model call", "position": i.position, "name": f"{i.step} (attempt {i.attempt})",
                "state": i.state, "seconds": _took(i.prepared_at, i.ended_at), "at": i.prepared_at, "intent": i,
                "call": call, "label": (call.reason if call else None) or i.repeat_reason,
            }))  # fmt: skip
        matched = {i.public_id for i in attempt.intents}
        for n, c in enumerate(x for x in attempt.calls if x.ledger_call_id not in matched):  # metered outside self.llm
            rows.append(((10**9, 2, n), {"kind": "model call", "position": None, "name": c.step or c.prompt or "-",
                         "state": "done" if c.ok else "failed", "seconds": c.latency_ms / 1000, "at": c.created_at,
                         "call": c, "label": c.reason}))  # fmt: skip
        out.append((attempt.token, [row for _, row in sorted(rows, key=lambda r: r[0])]))
    return out


def _dollars(value: Decimal | int | None, micros: bool = False) -> str:
    """USD with 6 decimals ("-" for no price); `micros`: the value is in micro-USD."""
    if value is None:
        return "-"
    return f"{(Decimal(value) / 10**6 if micros else Decimal(value)):.6f}"


def _took(start: datetime | None, end: datetime | None) -> float | None:
    """Seconds from `start` to `end` (None when either is missing)."""
    if start is None or end is None:
        return None
    return (_utc(end) - _utc(start)).total_seconds()


def _as_json(value: Any) -> str:
    return json.dumps(to_json(value), indent=2, sort_keys=True, ensure_ascii=False)


def _name_of(value: Any) -> str:
    return str(getattr(value, "value", value))


# Bootstrap's badge colours per run status and intent state (the pages' only styling of their own).
_BADGES = {
    "COMPLETED": "text-bg-success", "done": "text-bg-success", "RUNNING": "text-bg-primary", "sent": "text-bg-primary",
    "WAITING": "text-bg-info", "prepared": "text-bg-info", "FAILED": "text-bg-warning", "failed": "text-bg-warning",
    "DEAD": "text-bg-danger", "lost": "text-bg-danger", "abandoned": "text-bg-danger",
}  # fmt: skip


def _badge(value: Any) -> str:
    return _BADGES.get(_name_of(value), "text-bg-secondary")


def _pairs(values: dict[str, int], money: bool = False) -> str:
    """`{limiter: units}` or `{budget: micro-USD}` as "name: value, ..." in name order."""
    return ", ".join(f"{k}: {_dollars(v, True) if money else v}" for k, v in sorted(values.items()))
