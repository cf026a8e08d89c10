"""The built wheel: one `oncelery` import package, installed into a fresh virtualenv, under a user's own project.

The repository's folders `idempotency/`, `models/` and `tasks/` (and the top-level `celeryconfig.py`) become
`oncelery`, `oncelery.models`, `oncelery.tasks` (and `oncelery.celeryconfig`) in the wheel. Nothing else is
installed, so a user project with its own `models.py`, `tasks.py` and `celeryconfig.py` imports its own files,
and its worker runs an `IdempotentTask` from the installed wheel on a real Redis broker.
"""

from __future__ import annotations

import configparser
import json
import re
import subprocess
import sysconfig
import zipfile
from pathlib import Path

import pytest

from tests import services
from tests.wheel_venv import Built, Venv, new_venv, run

MARKER_TIMEOUT = 45.0
STOP_TIMEOUT = 30.0
OUTER_PTH = "zz_outer_dependencies.pth"
# pyproject's package-dir: each repository folder's files and where the wheel must have them.
PACKAGE_DIRS = {"idempotency": "oncelery", "models": "oncelery/models", "tasks": "oncelery/tasks"}
PACKAGED_SUFFIXES = {".py", ".mako", ".typed", ".jsonl", ".json", ".md"}
# The sample articles `oncelery process --sample` scores: package data of oncelery.tasks (samples/ links to it).
SAMPLE_IN_WHEEL = "oncelery/tasks/samples/articles.jsonl"
# The default price table (LiteLLM's, trimmed) and the note of its source and licence: package data of oncelery.ledger.
PRICES_IN_WHEEL = ("oncelery/ledger/data/model_prices.json", "oncelery/ledger/data/NOTICE.md")
# The repository's folders and the module that the wheel maps into `oncelery`: none may be installed top-level.
REPO_TOP_LEVEL = ("models", "tasks", "idempotency", "celeryconfig")


@pytest.fixture(scope="module")
def built(oncelery_wheel: Built) -> Built:
    """The project's wheel (built once per test session: tests/wheel_venv.py), and the copy it was built from."""
    return oncelery_wheel


@pytest.fixture(scope="module")
def fresh_venv(built: Built, tmp_path_factory: pytest.TempPathFactory) -> Venv:
    """A new virtualenv (no pip) with the wheel installed; its dependencies come from this virtualenv by a .pth."""
    venv = new_venv(built.wheel, tmp_path_factory.mktemp("fresh") / "venv")
    # Plain path entries: the outer site-packages' own .pth files (the editable finder) are not run. All of this
    # virtualenv's packages (pytest for oncelery.testing too); tests/test_adoption_walk.py gives only what a
    # user installs.
    outer = dict.fromkeys([sysconfig.get_paths()["purelib"], sysconfig.get_paths()["platlib"]])
    (venv.site_packages / OUTER_PTH).write_text("".join(f"{p}\n" for p in outer))
    return venv


def packaged_sources(source: Path) -> set[str]:
    """Return the wheel paths that the repository's package folders' modules and data files must have."""
    expected = set()
    for folder, package in PACKAGE_DIRS.items():
        for path in (source / folder).rglob("*"):
            if path.suffix in PACKAGED_SUFFIXES and "__pycache__" not in path.parts:
                expected.add(f"{package}/{path.relative_to(source / folder).as_posix()}")
    return expected


def test_the_wheel_holds_one_oncelery_package(built: Built) -> None:
    """The wheel installs only `oncelery/` and its dist-info: every module, migration, template, py.typed and
    sample file of idempotency/, models/ and tasks/ is in it under oncelery/ (nothing more), the celeryconfig
    link is packaged as the real file, the sample articles and the price table are package data, and both entry
    points are declared (and no pytest plugin: the kit loads only where asked)."""
    wheel = built.wheel
    with zipfile.ZipFile(wheel) as zf:
        names = zf.namelist()
        entry_points = zf.read(next(n for n in names if n.endswith(".dist-info/entry_points.txt"))).decode()
        top_level_txt = zf.read(next(n for n in names if n.endswith(".dist-info/top_level.txt"))).decode()
        packaged_config = zf.read("oncelery/celeryconfig.py")
        packaged_sample = zf.read(SAMPLE_IN_WHEEL)
    source_config = (built.source / "celeryconfig.py").read_bytes()

    tops = {name.split("/", 1)[0] for name in names}
    dist_info = {t for t in tops if t.endswith(".dist-info")}
    assert tops - dist_info == {"oncelery"}, sorted(tops)
    assert len(dist_info) == 1 and re.fullmatch(r"oncelery-[^/]+\.dist-info", dist_info.pop())
    for top in REPO_TOP_LEVEL:
        assert not any(n == f"{top}.py" or n.startswith(f"{top}/") for n in names), top
    for required in (
        "oncelery/__init__.py",
        "oncelery/celeryconfig.py",
        "oncelery/py.typed",
        "oncelery/models/__init__.py",
        "oncelery/models/migrations/env.py",
        "oncelery/models/migrations/script.py.mako",
        "oncelery/tasks/__init__.py",
        "oncelery/tasks/app.py",
        SAMPLE_IN_WHEEL,
        *PRICES_IN_WHEEL,
    ):
        assert required in names, f"{required} is missing from {wheel.name}"
    # Every subpackage must be listed in pyproject's `packages`: a folder left out is missing from the wheel.
    expected = packaged_sources(built.source)
    packaged = {n for n in names if n.startswith("oncelery/") and Path(n).suffix in PACKAGED_SUFFIXES}
    assert packaged == expected, f"missing from the wheel: {sorted(expected - packaged)}; not in the source: " + str(
        sorted(packaged - expected)
    )
    # The link idempotency/celeryconfig.py -> ../celeryconfig.py is packaged as the file it points at.
    assert packaged_config.strip() and packaged_config == source_config
    # The quickstart's sample runs from a pip install: the wheel holds the articles of samples/articles.jsonl.
    assert packaged_sample == (built.source / "samples" / "articles.jsonl").read_bytes()
    assert len(packaged_sample.splitlines()) >= 100
    assert top_level_txt.split() == ["oncelery"]

    parsed = configparser.ConfigParser()
    parsed.read_string(entry_points)
    assert dict(parsed["console_scripts"]) == {"oncelery": "oncelery.tasks.commands:main"}
    assert dict(parsed["celery.commands"]) == {"oncelery": "oncelery.cli:oncelery"}
    # No pytest11: the test kit loads only where a project asks (tests/test_kit_plugin_loads_only_where_asked.py).
    assert "pytest11" not in parsed.sections(), parsed.sections()


USER_MODELS = '''\
"""The user's own models module: a name the installed framework must not shadow."""

MODELS_OWNER = "userproj"


class Order:
    """An order of the user's project."""

    def __init__(self, order_id: str) -> None:
        self.order_id = order_id
'''

USER_TASKS = '''\
"""The user's own tasks module: a Celery app configured from the user's celeryconfig.py."""

import json
import sys
from pathlib import Path

import oncelery
from celery import Celery
from oncelery import IdempotentTask

app = Celery("userproj")
app.config_from_object("celeryconfig")


def write_marker(path: str, **fields: str) -> None:
    import models

    fields.update(
        models=models.__file__,
        celeryconfig=sys.modules["celeryconfig"].__file__,
        oncelery=oncelery.__file__,
        owner=models.MODELS_OWNER,
    )
    tmp = Path(path + ".tmp")
    tmp.write_text(json.dumps(fields))
    tmp.replace(path)  # appears whole


@app.task(name="user.record")
def record(marker: str, order_id: str) -> str:
    from models import Order

    order = Order(order_id)
    write_marker(marker, order=order.order_id)
    return order.order_id


@app.task(base=IdempotentTask, bind=True, name="user.idem")
def idem(self, marker: str, order_id: str) -> str:
    write_marker(marker, order=order_id, task=self.name)
    return order_id
'''

USER_CELERYCONFIG = '''\
"""The user's own Celery configuration (loaded by name: `app.config_from_object("celeryconfig")`)."""

import os

broker_url = os.environ["USERPROJ_BROKER_URL"]
oncelery_database_url = os.environ["ONCELERY_DATABASE_URL"]
task_default_queue = {queue!r}
task_acks_late = True
task_reject_on_worker_lost = True
worker_prefetch_multiplier = 1
task_serializer = "json"
result_serializer = "json"
accept_content = ["json"]
broker_connection_retry_on_startup = True
'''

PRODUCER = """\
import sys

import tasks

tasks.record.apply_async(args=[sys.argv[1], "order-1"])
tasks.idem.apply_async(args=[sys.argv[2], "order-1"])
tasks.app.close()
print("sent")
"""


def table_rows(out: str) -> dict[str, str]:
    """Return the two-column rows of a plain-text table (first cell -> second cell)."""
    return {cells[0]: cells[1] for cells in (line.split() for line in out.splitlines()) if len(cells) == 2}


ROOM_PROBE = """\
import importlib, json, pkgutil, sys
import oncelery
rooms = sys.argv[1:]
seen = {}
for room in rooms:
    package = importlib.import_module("oncelery." + room)
    names = [m.name for m in pkgutil.walk_packages(package.__path__, package.__name__ + ".")]
    seen[room] = {"file": package.__file__, "modules": {n: importlib.import_module(n).__file__ for n in names}}
# What `oncelery process --sample` reads: the articles shipped as package data.
from oncelery.tasks.commands.article_file import load_sample
sample = load_sample()
# What price_of reads when the app names no price file: the table shipped as package data.
from oncelery.ledger.prices import SHIPPED_PRICE_FILE, load_price_table
price = load_price_table(SHIPPED_PRICE_FILE).per_million("gpt-4o-mini")
shipped = [str(SHIPPED_PRICE_FILE), str(price.input), str(price.output)]
print(json.dumps({"rooms": seen, "sample": [len(sample), sample[0].id], "prices": shipped}))
"""


def room_modules(folder: Path, package: str) -> set[str]:
    """The dotted names of every module and subpackage under a room's folder (its own __init__ left out)."""
    names = set()
    for path in folder.rglob("*.py"):
        parts = path.relative_to(folder).with_suffix("").parts
        if "__pycache__" in parts:
            continue
        if parts[-1] == "__init__":
            parts = parts[:-1]
        if parts:
            names.add(".".join((package, *parts)))
    return names


def source_rooms(source: Path) -> list[str]:
    """The framework's subpackages in the repository: every folder of idempotency/ with an __init__.py."""
    return sorted(p.parent.name for p in (source / "idempotency").glob("*/__init__.py"))


def test_every_room_imports_from_the_wheel(built: Built, fresh_venv: Venv, tmp_path: Path) -> None:
    """Each subpackage of the framework (basetask, delivery, runs, store, ops, relay, cli, testing, and any room
    added later) and every module and nested package in it (llm.adapters, relay.batcher) imports from the
    installed wheel, not from the repository: a room or a nested package missing from pyproject's `packages`
    fails here, and so does a module that runs on import (a `__main__` without its guard). In that folder (no
    samples/), the sample articles of `oncelery process --sample` and the default price table load from the
    installed package."""
    rooms = source_rooms(built.source)
    expected = {"basetask", "delivery", "runs", "store", "ops", "relay", "fake_provider", "cli", "testing"}
    assert expected <= set(rooms), rooms
    neutral = tmp_path / "elsewhere"
    neutral.mkdir()
    probed = run([fresh_venv.python, "-c", ROOM_PROBE, *rooms], cwd=neutral, env=fresh_venv.env)
    assert probed.code == 0, f"a room does not import from the wheel:\n{probed.err[-3000:]}"
    probe = json.loads(probed.out)
    assert probe["sample"] == [112, "a001"], probe["sample"]
    seen = probe["rooms"]
    installed = fresh_venv.site_packages / "oncelery"
    assert probe["prices"] == [str(installed / "ledger" / "data" / "model_prices.json"), "0.15", "0.6"], probe["prices"]
    for room in rooms:
        assert Path(seen[room]["file"]) == installed / room / "__init__.py", seen[room]
        expected = room_modules(built.source / "idempotency" / room, f"oncelery.{room}")
        assert set(seen[room]["modules"]) == expected, (room, sorted(seen[room]["modules"]), sorted(expected))
        for module, file in seen[room]["modules"].items():
            assert Path(file).is_relative_to(installed), f"{module} imported from {file}, not the wheel"


def test_a_user_project_runs_on_the_installed_wheel(fresh_venv: Venv, tmp_path: Path) -> None:
    """In a fresh virtualenv with only the wheel installed: no top-level models/tasks/idempotency/celeryconfig,
    `import oncelery` is the wheel's copy, a project's own models.py/tasks.py/celeryconfig.py are the ones
    imported, the `oncelery` console script migrates its SQLite database, a real worker on Redis runs its
    plain task and its IdempotentTask, and `celery -A tasks oncelery outcomes` counts one execution."""
    services.need("Redis", services.redis_available(), "start redis-server (see README: Services)")
    venv = fresh_venv
    py = venv.python

    # -- the installed layout ------------------------------------------------------------------------------
    for top in REPO_TOP_LEVEL:
        leaked = [p for p in (venv.site_packages / top, venv.site_packages / f"{top}.py") if p.exists()]
        assert not leaked, f"installed top-level: {leaked}"
    installed = {p.name for p in venv.site_packages.iterdir()} - {OUTER_PTH}
    assert {n for n in installed if not n.endswith(".dist-info")} == {"oncelery"}, sorted(installed)
    neutral = tmp_path / "elsewhere"
    neutral.mkdir()
    probe = (
        "import importlib.util, json, oncelery\n"
        f"names = {list(REPO_TOP_LEVEL)!r}\n"
        "print(json.dumps({'oncelery': oncelery.__file__, "
        "'found': [n for n in names if importlib.util.find_spec(n) is not None]}))"
    )
    probed = run([py, "-c", probe], cwd=neutral, env=venv.env)
    assert probed.code == 0, probed.err
    layout = json.loads(probed.out)
    assert Path(layout["oncelery"]) == venv.site_packages / "oncelery" / "__init__.py", layout
    assert layout["found"] == [], f"importable outside a project: {layout['found']}"

    # -- the user's project ----------------------------------------------------------------------------------
    project = tmp_path / "userproj"
    project.mkdir()
    queue = services.unique_queue()
    (project / "models.py").write_text(USER_MODELS)
    (project / "tasks.py").write_text(USER_TASKS)
    (project / "celeryconfig.py").write_text(USER_CELERYCONFIG.format(queue=queue))
    database = tmp_path / "claims.db"
    env = {
        **venv.env,
        "USERPROJ_BROKER_URL": services.REDIS_URL,
        "ONCELERY_DATABASE_URL": f"sqlite:///{database}",
    }

    imported = run([py, "-c", "import models, tasks; print(models.__file__); print(tasks.__file__)"], project, env)
    assert imported.code == 0, imported.err
    assert [Path(p) for p in imported.out.split()] == [project / "models.py", project / "tasks.py"]

    upgraded = run([venv.script("oncelery"), "db", "upgrade"], project, env)
    assert upgraded.code == 0, f"{upgraded.out}\n{upgraded.err}"
    assert "upgraded from revision <none> to" in upgraded.out and database.exists(), upgraded.out

    # -- a real worker -------------------------------------------------------------------------------------
    record_marker = tmp_path / "record.json"
    idem_marker = tmp_path / "idem.json"
    worker_log = tmp_path / "worker.log"
    worker_argv = [str(py), "-m", "celery", "-A", "tasks", "worker", "--pool", "solo", "--loglevel", "INFO"]
    worker_argv += ["--without-gossip", "--without-mingle", "--without-heartbeat", "-n", f"{queue}@%h"]
    with worker_log.open("wb") as log:
        worker = subprocess.Popen(
            worker_argv, cwd=project, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True
        )
    try:
        sent = run([py, "-c", PRODUCER, record_marker, idem_marker], project, env)
        assert sent.code == 0 and "sent" in sent.out, f"{sent.out}\n{sent.err}"

        def both_markers() -> bool:
            if worker.poll() is not None:
                pytest.fail(f"the worker exited with {worker.returncode}:\n{worker_log.read_text()}")
            return record_marker.exists() and idem_marker.exists()

        services.wait_for(both_markers, timeout=MARKER_TIMEOUT, what=f"both tasks' markers (log: {worker_log})")
    finally:
        stopped = services.stop_sessions([worker], grace=STOP_TIMEOUT)[0]
    # A warm shutdown: the worker finished (and recorded) its tasks before exiting.
    assert stopped == 0, f"the worker exited with {stopped}:\n{worker_log.read_text()}"

    wheel_init = venv.site_packages / "oncelery" / "__init__.py"
    for marker, task_fields in ((record_marker, {}), (idem_marker, {"task": "user.idem"})):
        fields = json.loads(marker.read_text())
        assert fields == {
            "order": "order-1",
            **task_fields,
            "models": str(project / "models.py"),
            "celeryconfig": str(project / "celeryconfig.py"),
            "oncelery": str(wheel_init),
            "owner": "userproj",
        }

    # -- `celery -A tasks oncelery ...`: the celery.commands entry point, on the app's database ------------
    counted = run([py, "-m", "celery", "-A", "tasks", "oncelery", "outcomes", "--task", "user.idem"], project, env)
    assert counted.code == 0, f"{counted.out}\n{counted.err}"
    rows = table_rows(counted.out)
    assert rows.get("executed") == "1" and rows.get("total") == "1", counted.out
