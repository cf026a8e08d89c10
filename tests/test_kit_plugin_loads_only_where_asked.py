"""The pytest plugin `oncelery.testing` loads only where a project asks for it (as Celery's own plugin does):
installing Oncelery registers nothing with pytest, so an unrelated pytest run of the environment imports none of
Oncelery. Asked for by `-p oncelery.testing`, or by a conftest.py's `pytest_plugins` line (which may follow an
import from the kit without pytest's "already imported" warning), its fixtures are there.

Each run is a fresh pytest process in a fresh folder (pytester), as a user's own run would be.
"""

from __future__ import annotations

import pytest

# A plain test file: it reports whether the plugin is loaded and whether anything of Oncelery was imported.
PLAIN = """
import sys

def test_plain(request):
    loaded = request.config.pluginmanager.has_plugin("oncelery.testing")
    print("LOADED", loaded, "IMPORTED", "oncelery" in sys.modules)
"""
# A test of the kit's: it needs one of the plugin's fixtures.
KIT = """
import os

def test_kit(oncelery_pass_through):
    assert os.environ["ONCELERY_PASS_THROUGH"] == "1"
"""
NOT_REWRITTEN = "-W", "error::pytest.PytestAssertRewriteWarning"


def test_a_plain_pytest_run_does_not_load_the_plugin(pytester: pytest.Pytester) -> None:
    pytester.makepyfile(test_plain=PLAIN, test_kit=KIT)
    result = pytester.runpytest_subprocess("-p", "no:cacheprovider", "-s")
    result.assert_outcomes(passed=1, errors=1)
    result.stdout.fnmatch_lines(["*LOADED False IMPORTED False*", "*fixture 'oncelery_pass_through' not found*"])


def test_the_plugin_loads_with_p_oncelery_testing(pytester: pytest.Pytester) -> None:
    pytester.makepyfile(test_plain=PLAIN, test_kit=KIT)
    result = pytester.runpytest_subprocess("-p", "no:cacheprovider", "-s", "-p", "oncelery.testing", *NOT_REWRITTEN)
    result.assert_outcomes(passed=2)
    result.stdout.fnmatch_lines(["*LOADED True IMPORTED True*"])


def test_the_plugin_loads_with_a_conftest_line_after_an_import_from_the_kit(pytester: pytest.Pytester) -> None:
    pytester.makeconftest('from oncelery.testing import ANY  # noqa: F401\n\npytest_plugins = ["oncelery.testing"]\n')
    pytester.makepyfile(test_plain=PLAIN, test_kit=KIT)
    result = pytester.runpytest_subprocess("-p", "no:cacheprovider", "-s", *NOT_REWRITTEN)
    result.assert_outcomes(passed=2)
    result.stdout.fnmatch_lines(["*LOADED True IMPORTED True*"])
