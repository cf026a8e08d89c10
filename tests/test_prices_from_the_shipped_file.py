"""Prices come from LiteLLM's table shipped in the wheel, below the user's `oncelery_prices`: exact Decimals per 1M
tokens, a provider prefix found, the table turned off or replaced by `oncelery_price_file`, a bad file or setting
refused naming the fix; and a real call through a worker and the fake provider is priced from the file."""

from __future__ import annotations

import json
from collections.abc import Iterator
from decimal import Decimal
from pathlib import Path
from typing import Any

import pytest
from celery import Celery
from sqlalchemy import select

from oncelery import ConfigurationError, IdempotentTask, Price, model_call, output_text, price_of
from oncelery.basetask.llm_step import resolve_adapter
from oncelery.basetask.startup import check_spending_settings
from oncelery.fake_provider import FakeProvider, Knobs
from oncelery.ledger.prices import SHIPPED_PRICE_FILE, load_price_table, trim
from oncelery.llm.adapters.openai_responses import OpenAIResponses
from oncelery.models import ModelCall
from oncelery.models.money import micros_up
from oncelery.settings import CONF_PRICE_FILE, check_settings
from oncelery.store.database import get_engine

MODEL = "gpt-4o-mini"  # in LiteLLM's table: 1.5e-07 and 6e-07 USD per token
UNLISTED = "oncelery-unlisted-model"  # in no price table
JOB = 60.0


def conf(**settings: Any) -> Any:
    """A Celery app's configuration with these settings (no broker is touched)."""
    app = Celery("prices", set_as_current=False)
    app.conf.update(**settings)
    return app.conf


def shipped_per_token(model: str) -> tuple[Decimal, Decimal]:
    """The model's (input, output) USD per token as the shipped file writes them, read here on its own."""
    entry = json.loads(SHIPPED_PRICE_FILE.read_text(), parse_float=Decimal)[model]
    return entry["input_cost_per_token"], entry["output_cost_per_token"]


def litellm_file(tmp_path: Path, entries: dict[str, Any] | str, name: str = "prices.json") -> Path:
    """A price file in LiteLLM's format (or any text) in the test's folder."""
    path = tmp_path / name
    path.write_text(entries if isinstance(entries, str) else json.dumps(entries))
    return path


def test_a_listed_model_gets_the_shipped_files_exact_price() -> None:
    """No oncelery_prices: gpt-4o-mini is priced from the file, per 1M tokens, with no float in between
    (1.5e-07 per token is exactly 0.15); a provider prefix finds the same entry; an unlisted model has none."""
    per_token = shipped_per_token(MODEL)
    assert per_token == (Decimal("1.5e-07"), Decimal("6e-07"))
    price = price_of(MODEL, conf())
    assert price == Price(per_token[0] * 10**6, per_token[1] * 10**6)
    assert (price.input, price.output) == (Decimal("0.15"), Decimal("0.6"))
    assert (str(price.input), str(price.output)) == ("0.15", "0.6")
    assert price.cost(1_000_000, 1_000_000) == Decimal("0.75") and price.cost_micros(3, 1) == 2  # 1.05 µUSD, up
    assert price_of(f"openai/{MODEL}", conf()) == price
    assert price_of(f"anthropic/{MODEL}", conf()) is None  # another provider's prefix: not OpenAI's entry
    assert price_of(UNLISTED, conf()) is None
    # A price per token with an exponent above 1M is a whole number, not Decimal("1E+1").
    assert str(price_of("gpt-4o-2024-08-06", conf()).output) == "10"  # type: ignore[union-attr]


def test_the_users_price_wins_and_is_checked_as_before() -> None:
    """oncelery_prices overrides the file for its models only; a bad entry there is refused as it always was."""
    settings = conf(oncelery_prices={MODEL: {"input": 1, "output": 2}})
    assert price_of(MODEL, settings) == Price(1, 2)
    assert price_of("gpt-4.1-mini", settings) == Price("0.4", "1.6")  # not overridden: the file's
    with pytest.raises(ConfigurationError, match=r"oncelery_prices\['gpt-4o-mini'\]"):
        price_of(MODEL, conf(oncelery_prices={MODEL: {"prompt": 1}}))
    with pytest.raises(ConfigurationError, match="oncelery_prices must be a dict"):
        price_of(MODEL, conf(oncelery_prices=[MODEL]))


@pytest.mark.parametrize("off", [None, False])
def test_the_file_turned_off_leaves_only_the_users_prices(off: Any) -> None:
    settings = conf(oncelery_price_file=off, oncelery_prices={"mine": {"input": 1}})
    assert price_of(MODEL, settings) is None
    assert price_of("mine", settings) == Price(1, 0)
    check_settings(settings)  # a known setting, not a typo


def test_a_file_of_the_users_own_replaces_the_shipped_one(tmp_path: Path) -> None:
    """A path to a file in LiteLLM's format (its sample_spec, image and embedding entries too): its token prices,
    exact; a model it does not list has none, even one the shipped file lists."""
    path = litellm_file(
        tmp_path,
        """{
        "sample_spec": {"input_cost_per_token": 0.0, "output_cost_per_token": 0.0, "litellm_provider": "x"},
        "my-model": {"input_cost_per_token": 2.5e-06, "output_cost_per_token": 1e-05, "mode": "chat"},
        "my-embedder": {"input_cost_per_token": 2e-08, "litellm_provider": "openai", "mode": "embedding"},
        "my-painter": {"output_cost_per_image": 0.04, "mode": "image_generation"}
        }""",
    )
    for given in (str(path), path):
        settings = conf(oncelery_price_file=given)
        assert price_of("my-model", settings) == Price("2.5", "10")
        assert price_of("openai/my-embedder", settings) == Price("0.02", 0)
        assert price_of("my-painter", settings) is None  # priced per image, not per token
        assert price_of("sample_spec", settings) is None  # the fields' documentation, not a model
        assert price_of(MODEL, settings) is None


def test_the_shipped_file_is_litellms_trimmed_with_every_number_as_written() -> None:
    """`trim` keeps each token-priced entry with its prices and provider, numbers as written; the shipped file is
    what it makes of itself (so of the upstream file it came from), and it holds thousands of priced models."""
    upstream = """{
    "sample_spec": {"input_cost_per_token": 0.0, "output_cost_per_token": 0.0},
    "m1": {"input_cost_per_token": 1.5e-07, "output_cost_per_token": 6e-07, "litellm_provider": "openai",
           "max_tokens": 16384, "supports_vision": true, "input_cost_per_token_batches": 7.5e-08},
    "img": {"output_cost_per_image": 0.04},
    "m2": {"input_cost_per_token": 0, "output_cost_per_token": 0.0000025}
    }"""
    assert trim(upstream) == (
        "{\n"
        '"m1": {"input_cost_per_token": 1.5e-07, "output_cost_per_token": 6e-07, "litellm_provider": "openai"},\n'
        '"m2": {"input_cost_per_token": 0, "output_cost_per_token": 0.0000025}\n'
        "}\n"
    )
    shipped = SHIPPED_PRICE_FILE.read_text()
    assert trim(shipped) == shipped
    assert len(load_price_table(SHIPPED_PRICE_FILE)) > 3000
    assert (SHIPPED_PRICE_FILE.parent / "NOTICE.md").read_text().count("MIT License") == 1


@pytest.mark.parametrize(
    ("content", "expected"),
    [
        (None, r"cannot read the price file .*missing\.json"),
        ("{not json", r"is not JSON"),
        ('["gpt-4o-mini"]', r"is not a price table"),
        ('{"m": 0.1}', r"is not a price table"),
        ('{"m": {"input_cost_per_token": "0.1"}}', r"\['m'\]\['input_cost_per_token'\] = '0.1': give a number >= 0"),
        ('{"m": {"input_cost_per_token": -1e-06}}', r"\['m'\]\['input_cost_per_token'\] = Decimal\('-0.000001'\)"),
        ('{"m": {"output_cost_per_token": NaN}}', r"\['m'\]\['output_cost_per_token'\] = nan: give a number"),
    ],
)
def test_a_bad_price_file_is_refused_naming_the_fix(tmp_path: Path, content: str | None, expected: str) -> None:
    path = tmp_path / "missing.json" if content is None else litellm_file(tmp_path, content)
    with pytest.raises(ConfigurationError, match=expected) as refused:
        price_of("m", conf(oncelery_price_file=str(path)))
    assert "oncelery_price_file the path of a file in LiteLLM's model_prices_and_context_window.json format" in str(
        refused.value
    )
    assert "or None to price from app.conf.oncelery_prices alone" in str(refused.value)


@pytest.mark.parametrize("value", [True, 3, "", "  "])
def test_a_bad_price_file_setting_is_refused_naming_the_choices(value: Any) -> None:
    with pytest.raises(ConfigurationError, match=rf"app.conf.{CONF_PRICE_FILE}=.*: give the path of a price file"):
        price_of(MODEL, conf(oncelery_price_file=value))


def test_a_starting_worker_refuses_a_price_file_it_cannot_read_and_prices_budgeted_models_from_the_file(
    tmp_path: Path,
) -> None:
    """At worker start: an unreadable price file is refused before any call; under a budget, a task's model the
    shipped file prices passes the price check that used to need an oncelery_prices entry, and fails without it."""
    app = Celery("prices-start", set_as_current=False)

    @app.task(shared=False, base=IdempotentTask, name="oncelery.t_price_start", llm_models=(MODEL,))
    def job() -> None: ...

    app.conf.oncelery_budgets = {"global": {"day": 10}}
    check_spending_settings(app, IdempotentTask)
    app.conf.oncelery_price_file = None
    with pytest.raises(ConfigurationError, match=rf"no price in oncelery_prices: {MODEL} \(nor in the price file"):
        check_spending_settings(app, IdempotentTask)
    app.conf.oncelery_price_file = str(tmp_path / "gone.json")
    with pytest.raises(ConfigurationError, match=r"cannot read the price file .*gone\.json"):
        check_spending_settings(app, IdempotentTask)


@pytest.fixture
def fake() -> Iterator[FakeProvider]:
    """The fake provider as a server, answering at once."""
    with FakeProvider(Knobs(poll_after_ms=5, generation_s=0.0)) as provider:
        yield provider


def test_a_real_call_through_a_worker_is_priced_from_the_shipped_file(
    app: Celery, worker_factory: Any, db_url: str, fake: FakeProvider
) -> None:
    """No oncelery_prices: a `self.llm` call to the fake provider and a `model_call` in a step, run by a real
    worker, each leave a ledger row whose cost is its tokens at the shipped file's price, rounded up once."""
    base = fake.openai_base_url

    @app.task(shared=False, base=IdempotentTask, bind=True, name="oncelery.t_priced_from_file",
              idempotency_key="doc:{doc_id}", llm_adapter=lambda: OpenAIResponses(base, "sk"))  # fmt: skip
    def summarize(self: IdempotentTask, doc_id: str, text: str) -> str:
        summary = output_text(self.llm("summarize", model=MODEL, input=text, max_output_tokens=12))

        def recorded() -> str:
            with model_call("gpt-4.1-mini", prompt="keywords") as call:
                call.tokens(1_234, 56)
            return summary

        return str(self.step("keywords", recorded))

    try:
        with worker_factory(app, concurrency=2):
            assert summarize.delay("d1", "The council approved the new library budget on Tuesday.").get(timeout=JOB)
    finally:
        resolve_adapter(summarize, None).close()
    with get_engine(db_url).connect() as conn:
        rows = conn.execute(
            select(ModelCall.model, ModelCall.input_tokens, ModelCall.output_tokens, ModelCall.cost_micros).order_by(
                ModelCall.id
            )
        ).all()
    assert [r.model for r in rows] == [MODEL, "gpt-4.1-mini"]
    for row in rows:
        per_input, per_output = shipped_per_token(row.model)
        assert row.input_tokens > 0 and row.output_tokens > 0
        assert row.cost_micros == micros_up(row.input_tokens * per_input + row.output_tokens * per_output)
    assert rows[1].cost_micros == 584  # gpt-4.1-mini: 1,234 x 0.40 + 56 x 1.60 USD per 1M = 583.2 µUSD, rounded up
