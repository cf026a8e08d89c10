"""The built wheel and fresh virtualenvs for it: shared by tests/test_packaging.py and tests/test_adoption_walk.py.

`oncelery_wheel` (session-scoped, registered in tests/conftest.py) builds the wheel once per test session from a
copy of the repository. `new_venv` makes a virtualenv without pip and installs the wheel into it, without its
dependencies. Tests run offline, so no `pip install` can download them; `OfflineInstaller` stands in for it.
It gives the virtualenv exactly the distributions a requirement needs, taken from this (outer) virtualenv:
the requirement's `Requires-Dist` walked transitively with importlib.metadata, each distribution's top-level
files (from its RECORD) linked into one directory that a `.pth` file puts on the virtualenv's path. A package
nothing asked for (psycopg without the `postgres` extra, pytest before the user installs it) is not there.
"""

from __future__ import annotations

import os
import shutil
import sys
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from importlib import metadata
from pathlib import Path

import pytest
from packaging.requirements import Requirement
from packaging.utils import canonicalize_name

from tests import services

REPO_ROOT = Path(__file__).resolve().parents[1]
BUILD_TIMEOUT = 180.0
COMMAND_TIMEOUT = 60.0
# Left out of the copy the wheel is built from: VCS, virtualenvs, caches and earlier build output (a stale
# build/lib would put deleted modules into the wheel).
_NOT_SOURCE = {".git", ".venv", "build", "dist", ".pytest_cache", ".ruff_cache", ".mypy_cache", ".oncelery"}
# The name of the .pth file that puts the linked distributions on a fresh virtualenv's path.
LINKS_PTH = "zz_offline_links.pth"


@dataclass(frozen=True)
class Built:
    """The wheel, and the copy of the repository it was built from."""

    wheel: Path
    source: Path


@dataclass(frozen=True)
class Venv:
    """A fresh virtualenv with the wheel installed (its dependencies are given by a .pth file)."""

    root: Path
    python: Path
    site_packages: Path
    env: dict[str, str] = field(repr=False)

    def script(self, name: str) -> Path:
        """Return the path of a console script installed into this virtualenv."""
        return self.root / "bin" / name


def run(argv: list[str | Path], cwd: Path, env: Mapping[str, str], timeout: float = COMMAND_TIMEOUT) -> services.Done:
    """Run `argv` to completion in its own session (stopped and failed on timeout)."""
    code, out, err = services.run_to_completion([str(a) for a in argv], cwd, dict(env), timeout, lambda _out: None)
    return services.Done(code, out, err)


def venv_env(root: Path, **extra: str) -> dict[str, str]:
    """This environment as if `root` were activated: no Python path overrides, no ONCELERY_/CELERY_ settings."""
    dropped = ("PYTHONPATH", "PYTHONHOME", "PYTHONSTARTUP", "PYTHONSAFEPATH", "VIRTUAL_ENV", "__PYVENV_LAUNCHER__")
    env = {k: v for k, v in os.environ.items() if k not in dropped and not k.startswith(("ONCELERY_", "CELERY_"))}
    env["VIRTUAL_ENV"] = str(root)
    env["PATH"] = os.pathsep.join([str(root / "bin"), env.get("PATH", "")])
    env.update(extra)
    return env


# -- the wheel -------------------------------------------------------------------------------------------------


def _ignore_non_source(src: Path) -> Callable[[str, list[str]], Iterable[str]]:
    def ignore(directory: str, names: list[str]) -> set[str]:
        skipped = {n for n in names if n == "__pycache__" or n.endswith((".pyc", ".egg-info"))}
        if Path(directory) == src:
            skipped |= {n for n in names if n in _NOT_SOURCE or n.startswith("oncelery.db")}
        return skipped

    return ignore


def build_wheel(workdir: Path) -> Built:
    """Build the project's wheel from a copy of the repository with this virtualenv's setuptools."""
    src = workdir / "source" / "oncelery"
    # A copy, so the build writes no build/ or *.egg-info into the work tree and sees one state of a tree that
    # may be edited meanwhile (symlinks are kept as links).
    shutil.copytree(REPO_ROOT, src, symlinks=True, ignore=_ignore_non_source(REPO_ROOT))
    out = workdir / "wheelhouse"
    out.mkdir()
    argv = [sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "--disable-pip-version-check"]
    done = run([*argv, "-w", out, src], cwd=out, env=os.environ, timeout=BUILD_TIMEOUT)
    assert done.code == 0, (
        f"building the wheel failed with setuptools {metadata.version('setuptools')} "
        f"(this virtualenv's build backend):\n{done.out[-3000:]}\n{done.err[-5000:]}"
    )
    wheels = sorted(out.glob("oncelery-*.whl"))
    assert len(wheels) == 1, f"expected one wheel in {out}: {wheels}"
    return Built(wheels[0], src)


@pytest.fixture(scope="session")
def oncelery_wheel(tmp_path_factory: pytest.TempPathFactory) -> Built:
    """The project's wheel, built once per test session (tests/test_packaging.py, tests/test_adoption_walk.py)."""
    return build_wheel(tmp_path_factory.mktemp("wheel"))


# -- a fresh virtualenv ----------------------------------------------------------------------------------------


def new_venv(wheel: Path, root: Path) -> Venv:
    """A new virtualenv (no pip) at `root` with only `wheel` installed, without its dependencies."""
    created = run([sys.executable, "-m", "venv", "--without-pip", root], cwd=root.parent, env=os.environ)
    assert created.code == 0, created.err
    python = root / "bin" / "python"
    env = venv_env(root)
    # This pip, run for the fresh interpreter: console scripts get its shebang. Run before any .pth file puts
    # other directories on the path, so pip sees no other `oncelery` (the outer editable install) there.
    pip: list[str | Path] = [sys.executable, "-m", "pip", "--python", python, "--disable-pip-version-check"]
    installed = run([*pip, "install", "--no-deps", "--no-index", wheel], cwd=root, env=env)
    assert installed.code == 0, f"{installed.out}\n{installed.err}"
    paths = run([python, "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"], cwd=root, env=env)
    assert paths.code == 0, paths.err
    site_packages = Path(paths.out.strip())
    assert site_packages.is_relative_to(root), site_packages
    return Venv(root, python, site_packages, env)


class OfflineInstaller:
    """`pip install REQUIREMENT...` for a fresh virtualenv, without a network: links this virtualenv's copies.

    Each distribution a requirement needs (transitively, extras and markers evaluated) is found installed
    here by importlib.metadata; its top-level entries (packages, modules, its .dist-info; from its RECORD) are
    linked into `links`, which one .pth file puts on the fresh virtualenv's path. A requirement on the
    project itself reads the `Requires-Dist` of the wheel installed in the fresh virtualenv. Versions are the
    ones installed here (they satisfy the project's pins: this virtualenv was installed from them).
    """

    def __init__(self, venv: Venv, links: Path) -> None:
        self.venv = venv
        self.links = links
        self.links.mkdir(parents=True, exist_ok=True)
        self.installed: set[str] = set()
        self._done: set[tuple[str, frozenset[str]]] = set()
        (venv.site_packages / LINKS_PTH).write_text(f"{links}\n")

    def install(self, *requirements: str) -> list[str]:
        """Link every distribution `requirements` need that is not linked yet; return their names, in order."""
        before = set(self.installed)
        added: list[str] = []
        for requirement in requirements:
            self._need(Requirement(requirement), added)
        return [name for name in added if name not in before]

    def _need(self, req: Requirement, added: list[str]) -> None:
        name = canonicalize_name(req.name)
        extras = frozenset(canonicalize_name(e) for e in req.extras)
        if (name, extras) in self._done:
            return
        self._done.add((name, extras))
        dist = self._wheel_dist() if name == "oncelery" else metadata.distribution(req.name)
        if name != "oncelery" and name not in self.installed:
            self._link(dist)
            self.installed.add(name)
            added.append(name)
        for spec in dist.requires or []:
            sub = Requirement(spec)
            if sub.marker is None or any(sub.marker.evaluate({"extra": e}) for e in (extras or {""})):
                self._need(sub, added)

    def _wheel_dist(self) -> metadata.Distribution:
        found = [d for d in metadata.distributions(path=[str(self.venv.site_packages)]) if d.name == "oncelery"]
        assert len(found) == 1, f"the wheel is not installed in {self.venv.site_packages}: {found}"
        return found[0]

    def _link(self, dist: metadata.Distribution) -> None:
        files = dist.files
        assert files, f"{dist.name} has no RECORD: it cannot be linked into a fresh virtualenv"
        # Scripts (../../../bin/...) and byte code are not linked: each command runs `python -m ...`.
        tops = {f.parts[0] for f in files if f.parts and f.parts[0] not in ("..", "__pycache__")}
        for top in sorted(tops):
            source = Path(str(dist.locate_file(top)))
            if source.exists() and not (self.links / top).exists():
                (self.links / top).symlink_to(source)
