"""Secrets from files: VAR_FILE names a file holding VAR's value, for every reader of Oncelery's settings (a worker
started any way, celeryconfig.py), and the deploy scripts' start guard exports it and refuses placeholders.

In-process and without services: the rule is pure; tests/test_compose.py runs the scripts that use it.
"""

from __future__ import annotations

import runpy
from pathlib import Path

import pytest

from oncelery.cli.service_env import service_environ
from oncelery.errors import ConfigurationError, PlaceholderSecret, SettingFileError
from oncelery.settings import configured_database_url, digest_secret
from oncelery.settings_files import env_value

ROOT = Path(__file__).resolve().parent.parent


def secret(tmp_path: Path, name: str, content: str) -> str:
    """Write `content` to a file of its own (as a mounted secret is) and return its path."""
    path = tmp_path / name
    path.write_text(content)
    return str(path)


def test_a_value_comes_from_the_variable_or_its_file_never_both(tmp_path: Path) -> None:
    """VAR, else VAR_FILE's content without its trailing newline; empty VAR is unset; both set is refused."""
    path = secret(tmp_path, "url", "postgresql://u:pw@db/x\n")
    assert env_value("X", {"X": "direct"}) == "direct"
    assert env_value("X", {"X_FILE": path}) == "postgresql://u:pw@db/x"
    assert env_value("X", {"X": "", "X_FILE": path}) == "postgresql://u:pw@db/x"
    assert env_value("X", {"X": ""}) is None and env_value("X", {}) is None
    with pytest.raises(SettingFileError, match=r"both X and X_FILE are set: keep one"):
        env_value("X", {"X": "direct", "X_FILE": path})


def test_an_unreadable_or_empty_file_is_refused_naming_the_variable(tmp_path: Path) -> None:
    """A missing file or one holding only whitespace is one line naming VAR_FILE and the path, never a None."""
    missing = str(tmp_path / "nowhere")
    with pytest.raises(SettingFileError, match=rf"X_FILE={missing}: cannot read it \(No such file"):
        env_value("X", {"X_FILE": missing})
    blank = secret(tmp_path, "blank", " \n")
    with pytest.raises(SettingFileError, match=rf"X_FILE={blank} is empty"):
        env_value("X", {"X_FILE": blank})
    assert issubclass(SettingFileError, ConfigurationError)  # a worker's startup check prints it in one line


def test_the_settings_and_celeryconfig_read_the_files(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A worker started any way (no deploy script) finds its database, digest key, broker and backend in files."""
    for name in ("ONCELERY_DATABASE_URL", "ONCELERY_DIGEST_KEY", "ONCELERY_BROKER_URL", "ONCELERY_RESULT_BACKEND"):
        monkeypatch.delenv(name, raising=False)
    files = {
        "ONCELERY_DATABASE_URL_FILE": secret(tmp_path, "db", "postgresql+psycopg://app:s3cret@db/app\n"),
        "ONCELERY_DIGEST_KEY_FILE": secret(tmp_path, "digest", "k" * 32),
        "ONCELERY_BROKER_URL_FILE": secret(tmp_path, "broker", "redis://:pw@broker:6379/0\n"),
        "ONCELERY_RESULT_BACKEND_FILE": secret(tmp_path, "backend", "redis://:pw@broker:6379/1"),
    }
    for name, path in files.items():
        monkeypatch.setenv(name, path)
    assert configured_database_url() == "postgresql+psycopg://app:s3cret@db/app"
    assert digest_secret() == b"k" * 32
    conf = runpy.run_path(str(ROOT / "celeryconfig.py"))  # the module's code, as a worker imports it
    assert conf["broker_url"] == "redis://:pw@broker:6379/0"
    assert conf["result_backend"] == "redis://:pw@broker:6379/1"
    assert conf["oncelery_database_url"] == "postgresql+psycopg://app:s3cret@db/app"


def test_the_start_guard_exports_files_and_refuses_placeholders_and_gaps(tmp_path: Path) -> None:
    """service_environ: VAR from VAR_FILE (VAR_FILE dropped), empty as unset; a placeholder or a missing
    required setting is a one-line ConfigurationError naming the variable."""
    auth = secret(tmp_path, "auth", "ops:s3cret\n")
    env = service_environ(
        {"FLOWER_BASIC_AUTH_FILE": auth, "ONCELERY_DIGEST_KEY": "", "OTHER": "kept"},
        required=["FLOWER_BASIC_AUTH"],
    )
    assert env == {"FLOWER_BASIC_AUTH": "ops:s3cret", "OTHER": "kept"}
    placeholder = {"ONCELERY_DATABASE_URL": "postgresql://oncelery:change-me-postgres-password@postgres/oncelery"}
    with pytest.raises(PlaceholderSecret, match=r"^ONCELERY_DATABASE_URL holds the placeholder 'change-me'"):
        service_environ(placeholder)
    in_file = {"FLOWER_BASIC_AUTH_FILE": secret(tmp_path, "example", "admin:change-me-flower-password")}
    with pytest.raises(PlaceholderSecret, match=r"^FLOWER_BASIC_AUTH holds"):
        service_environ(in_file, secrets=["FLOWER_BASIC_AUTH"])
    with pytest.raises(ConfigurationError, match=r"^set ONCELERY_BROKER_URL \(or ONCELERY_BROKER_URL_FILE"):
        service_environ({"ONCELERY_BROKER_URL": ""}, required=["ONCELERY_BROKER_URL"])


def test_the_start_guard_reads_provider_keys_and_the_apps_own_secrets_from_files(tmp_path: Path) -> None:
    """Every provider key (PROVIDER_KEY_SETTINGS) and each name in ONCELERY_EXTRA_SECRETS: VAR from VAR_FILE and
    exported as VAR (a provider's SDK reads VAR only), empty as unset, both set refused, a placeholder refused; a
    name in ONCELERY_EXTRA_SECRETS that is not a variable's name is refused, naming it."""
    environ = {
        "OPENAI_API_KEY_FILE": secret(tmp_path, "openai", "sk-from-file\n"),
        "ANTHROPIC_API_KEY": "ak-direct",
        "AZURE_OPENAI_API_KEY": "",
        "AZURE_OPENAI_API_KEY_FILE": "",
        "GEMINI_API_KEY_FILE": secret(tmp_path, "gemini", "gk-from-file"),
        "ONCELERY_EXTRA_SECRETS": "MISTRAL_API_KEY, VECTOR_TOKEN",
        "MISTRAL_API_KEY_FILE": secret(tmp_path, "mistral", "mk-from-file\n"),
        "VECTOR_TOKEN": "vt-direct",
        "MYAPP_SETTING_FILE": "/not/a/secret",  # not a listed name: left as it is
    }
    env = service_environ(environ)
    assert env == {
        "OPENAI_API_KEY": "sk-from-file",
        "ANTHROPIC_API_KEY": "ak-direct",
        "GEMINI_API_KEY": "gk-from-file",
        "ONCELERY_EXTRA_SECRETS": "MISTRAL_API_KEY, VECTOR_TOKEN",
        "MISTRAL_API_KEY": "mk-from-file",
        "VECTOR_TOKEN": "vt-direct",
        "MYAPP_SETTING_FILE": "/not/a/secret",
    }
    with pytest.raises(SettingFileError, match=r"both OPENAI_API_KEY and OPENAI_API_KEY_FILE are set"):
        service_environ(dict(environ, OPENAI_API_KEY="sk-direct"))
    with pytest.raises(PlaceholderSecret, match=r"^ANTHROPIC_API_KEY holds the placeholder 'change-me'"):
        service_environ({"ANTHROPIC_API_KEY": "change-me-anthropic-key"})
    with pytest.raises(PlaceholderSecret, match=r"^MISTRAL_API_KEY holds"):
        service_environ({"ONCELERY_EXTRA_SECRETS": "MISTRAL_API_KEY", "MISTRAL_API_KEY": "change-me"})
    with pytest.raises(ConfigurationError, match=r"^ONCELERY_EXTRA_SECRETS lists 'MISTRAL-KEY', not a variable's"):
        service_environ({"ONCELERY_EXTRA_SECRETS": "OK_NAME MISTRAL-KEY"})
