"""Tracing is off unless configured, refuses to start without its extra (naming it), and follows the GenAI
conventions' opt-in: the run span is `invoke_workflow {task}` only under gen_ai_latest_experimental."""

from __future__ import annotations

import sys
from types import SimpleNamespace

import pytest
from celery import Celery

from oncelery import ConfigurationError
from oncelery.errors import ExtraMissing
from oncelery.tracing import otel
from oncelery.tracing.calls import _labels
from oncelery.tracing.otel import GEN_AI_SEMCONV_VERSION, SCHEMA_URL, Telemetry, key_digest, otel_enabled, telemetry_of
from tests.conftest import offline_job
from tests.otel_kit import sdk


def test_off_unless_the_setting_or_the_variable_says_on(monkeypatch: pytest.MonkeyPatch) -> None:
    app = Celery("otel-switch")
    job = offline_job(app, "oncelery.t_otel_switch")
    monkeypatch.delenv("ONCELERY_OTEL", raising=False)
    assert telemetry_of(job) is None, "off by default"
    monkeypatch.setenv("ONCELERY_OTEL", "1")
    assert otel_enabled(app.conf)
    app.conf.oncelery_otel = False  # the app's setting wins over the variable
    assert not otel_enabled(app.conf)
    app.conf.oncelery_otel = "sometimes"
    with pytest.raises(ConfigurationError, match="oncelery_otel / ONCELERY_OTEL='sometimes'"):
        otel_enabled(app.conf)


def test_switched_on_without_the_extra_it_fails_naming_the_extra(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "opentelemetry", None)  # as if opentelemetry-api were not installed
    monkeypatch.setattr(otel, "_TELEMETRY", {})
    with pytest.raises(ExtraMissing) as raised:
        Telemetry.of_process()
    assert "pip install 'oncelery[otel]'" in str(raised.value) and isinstance(raised.value, ConfigurationError)


def test_the_opt_in_names_the_run_invoke_workflow_and_the_provider_gen_ai_provider_name(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    kit = sdk()
    kit.spans.clear()
    for opt_in, expected in (
        ("", "oncelery.run oncelery.t"),
        ("http,gen_ai_latest_experimental", "invoke_workflow oncelery.t"),
    ):
        monkeypatch.setenv("OTEL_SEMCONV_STABILITY_OPT_IN", opt_in)
        tel = Telemetry()
        with tel.run_attempt("oncelery.t", "0123456789abcdef", None):
            pass
        [span] = kit.spans.get_finished_spans()
        kit.spans.clear()
        assert span.name == expected
        assert span.instrumentation_scope.schema_url == SCHEMA_URL.replace(GEN_AI_SEMCONV_VERSION, "1.41.0")
        assert (span.attributes.get("gen_ai.operation.name") == "invoke_workflow") is bool(opt_in)
        labels = _labels(tel, SimpleNamespace(provider="gemini", endpoint="generateContent"), {"model": "m"})  # type: ignore[arg-type]
        provider = "gen_ai.provider.name" if opt_in else "gen_ai.system"
        assert labels == {
            "gen_ai.operation.name": "generate_content",
            provider: "gcp.gemini",
            "gen_ai.request.model": "m",
        }


def test_a_key_is_put_on_spans_as_a_keyed_digest_never_raw() -> None:
    app = Celery("otel-digest")
    plain = key_digest("oncelery.t", "doc:1", app.conf)
    app.conf.oncelery_digest_key = "a-deployment-secret"
    keyed = key_digest("oncelery.t", "doc:1", app.conf)
    assert len(plain) == len(keyed) == 16 and plain != keyed and "doc" not in plain + keyed
