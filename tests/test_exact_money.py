"""Money is exact: costs are integer micro-USD in the database and Decimal USD in Python, on SQLite and PostgreSQL.

A thousand 0.1-dollar calls sum to 100.000000 (floats say 99.9999999999986), a sub-micro call is rounded up to
one micro-USD, and migration 0015 carries float costs written before it to micro-USD (half-up), keeping every
total to the micro-dollar and every trigger in place, and back again on downgrade.
"""

from __future__ import annotations

import json
import math
from collections.abc import Iterator
from decimal import Decimal
from pathlib import Path
from typing import Any

import pytest
from celery import Celery, current_app
from click.testing import CliRunner
from sqlalchemy import Connection, func, insert, select, text

from oncelery import ConfigurationError, Price, cost_report, model_call
from oncelery.cli import oncelery as oncelery_cli
from oncelery.ledger.rows import add_call, write_call
from oncelery.ledger.spool import flush_spools, spool_row
from oncelery.models import Outcome, RunStatus
from oncelery.models.migrate import downgrade, upgrade
from oncelery.models.money import micros_up, usd
from oncelery.runs.outcomes import record_outcome
from oncelery.settings import CONF_LEDGER_SPOOL_DIR
from oncelery.store.database import Database, get_engine
from oncelery.store.tables import CALLS, HISTOGRAM_BUCKETS, RUN_STATUS_TOTALS, RUNS, TOTALS
from tests.test_metrics import migrated_database, scrape

TASK = "oncelery.t_money"
MODEL = "gpt-x"


@pytest.fixture(params=["sqlite", "postgresql"])
def money_url(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[str]:
    """A migrated claims database of this test alone (SQLite file, or a new PostgreSQL database)."""
    yield from migrated_database(request.param, tmp_path)


def _run(conn: Connection, key: str, *, replays: int = 0, status: RunStatus = RunStatus.COMPLETED) -> int:
    values = {"task_name": TASK, "tenant": "", "idempotency_key": key, "fingerprint": "f" * 64}
    values |= {"field_digests": {}, "status": status, "replays": replays}
    return int(conn.execute(insert(RUNS).values(**values).returning(RUNS.c.id)).scalar_one())


def _call(n: int, cost_micros: int | None, run_id: int | None = None, ok: bool = True) -> dict[str, Any]:
    return {
        "call_id": f"money-{n}",
        "task_name": TASK,
        "tenant": "",
        "run_id": run_id,
        "model": MODEL,
        "input_tokens": 1_000_000,
        "output_tokens": 0,
        "latency_ms": 1.0,
        "ok": ok,
        "cost_micros": cost_micros,
    }


def _costs_json(url: str) -> dict[str, Any]:
    result = CliRunner().invoke(oncelery_cli, ["--database-url", url, "costs", "--json"])
    assert result.exit_code == 0, result.output
    return dict(json.loads(result.output, parse_float=Decimal))  # the USD figures as printed, exactly


# -- pricing: Decimal from the table, rounded up per call ------------------------------------------------------


def test_a_call_is_priced_exactly_and_rounded_up_to_the_micro_dollar() -> None:
    price = Price.of(MODEL, {"input": 0.15, "output": 0.6})  # floats, as users write them
    assert (price.input, price.output) == (Decimal("0.15"), Decimal("0.6"))  # by repr, never 0.1499999...
    assert price.cost(7, 0) == Decimal("0.00000105")  # exact
    assert price.cost_micros(7, 0) == 2  # 1.05 micro-USD: rounded UP, never down to 1
    assert price.cost_micros(1, 0) == 1  # 0.15 micro-USD still costs one
    assert price.cost_micros(0, 0) == 0  # nothing spent is nothing
    assert price.cost_micros(1_000_000, 1_000_000) == 750_000  # a whole micro stays as it is
    assert price.cost_micros(3, 1) == 2  # one ceiling per call (0.45 + 0.6 = 1.05), not per direction (1 + 1)
    assert micros_up(0.1 + 0.2) == 300_000 and micros_up(1.05e-06) == 2  # a float: its noise dropped, then up
    assert micros_up(Decimal("0.30000000000000004")) == 300_001 and micros_up(Decimal("0.0000001")) == 1
    assert usd(1) == Decimal("0.000001") and usd(None) is None
    assert Price(Decimal("0.15")) == Price(0.15) == Price(input="0.15")
    with pytest.raises(ConfigurationError, match=r"\['input'\] = nan"):
        Price.of(MODEL, {"input": math.nan})


def test_sub_micro_calls_are_each_rounded_up_in_the_ledger(
    db_url: str, monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    """Ten calls of 0.15 micro-USD each are on the books as ten micro-USD (a float ledger said 1.5e-06)."""
    monkeypatch.setenv("ONCELERY_DATABASE_URL", db_url)  # calls outside any task: the env database
    app = Celery("money-prices", set_as_current=False)
    app.conf.oncelery_prices = {MODEL: {"input": 0.15}}
    before = current_app._get_current_object()
    app.set_current()
    try:
        for _ in range(10):
            with model_call(MODEL, prompt="tiny") as call:
                call.tokens(1, 0)
    finally:
        before.set_current()
        app.close()
    assert call.cost_micros == 1 and call.cost == Decimal("0.000001")
    with get_engine(db_url).connect() as conn:
        assert conn.execute(select(CALLS.c.cost_micros)).scalars().all() == [1] * 10
        assert conn.execute(select(TOTALS.c.cost_micros)).scalar_one() == 10
    report = cost_report(db_url)
    assert report.made.cost == Decimal("0.000010") and isinstance(report.made.cost, Decimal)
    assert _costs_json(db_url)["total"]["made"]["cost"] == Decimal("0.00001")
    table = CliRunner().invoke(oncelery_cli, ["--database-url", db_url, "costs"]).output
    assert "0.000010" in table


# -- sums: integers, exact on both stores ----------------------------------------------------------------------


def test_a_thousand_dimes_sum_to_exactly_one_hundred_dollars(db_url: str) -> None:
    """1,000 calls of 0.1 USD (1M tokens at 0.1 USD/1M) made by one run, which 3 duplicates replayed: the
    report, the CLI and the exporter say 100 and 300 USD exactly. With float costs the sum drifts."""
    assert sum([0.1] * 1000) != 100  # the drift this test would catch
    price = Price.of(MODEL, {"input": 0.1})
    db = Database(db_url)
    with db.begin() as conn:
        run_id = _run(conn, "dimes")
        for n in range(1000):
            add_call(conn, db.dialect, _call(n, price.cost_micros(1_000_000, 0), run_id))
    for _ in range(3):  # duplicates answered from the stored result: each saves the run's 1,000 calls
        record_outcome(db, TASK, Outcome.REPLAYED, replayed_run=run_id)

    report = cost_report(db_url)
    assert (report.made.calls, report.made.cost) == (1000, Decimal("100.000000"))
    assert (report.saved.calls, report.saved.cost) == (3000, Decimal("300.000000"))
    printed = _costs_json(db_url)["total"]
    assert (printed["made"]["cost"], printed["saved"]["cost"]) == (Decimal(100), Decimal(300))
    got = scrape(db_url)
    assert got["oncelery_llm_cost_usd_total", (("model", MODEL), ("name", TASK), ("tenant", ""))] == 100.0
    assert got["oncelery_llm_saved_cost_usd_total", (("name", TASK), ("tenant", ""))] == 300.0
    with db.read() as conn:
        assert conn.execute(select(RUNS.c.llm_cost_micros)).scalar_one() == 100_000_000
        assert conn.execute(select(func.sum(CALLS.c.cost_micros))).scalar_one() == 100_000_000


def test_a_row_spooled_before_the_upgrade_is_written_in_micros(db_url: str, tmp_path: Path) -> None:
    """A spool line of an older version (float `cost`) is replayed as micro-USD rounded up, not set aside."""
    legacy = _call(1, None)
    del legacy["cost_micros"]
    conf = {CONF_LEDGER_SPOOL_DIR: str(tmp_path / "spool")}
    spool_row(db_url, conf, {**legacy, "cost": 1.05e-06})
    spool_row(db_url, conf, {**legacy, "call_id": "money-2", "cost": None})
    assert flush_spools()
    with get_engine(db_url).connect() as conn:
        assert conn.execute(select(CALLS.c.cost_micros).order_by(CALLS.c.id)).scalars().all() == [2, None]
    assert not (tmp_path / "spool" / "rejected.jsonl").exists()


# -- migration 0015: float USD -> micro-USD and back -----------------------------------------------------------

_TRIGGERS = {
    "postgresql": "SELECT tgname, tgrelid::regclass::text, pg_get_triggerdef(oid) FROM pg_trigger "
    "WHERE NOT tgisinternal ORDER BY tgname",
    "sqlite": "SELECT name, tbl_name, sql FROM sqlite_master WHERE type = 'trigger' ORDER BY name",
}
_FLOATS = (0.1, 0.2, None, 1.5e-06)  # three priced calls and an unpriced one; 1.5 micro-USD rounds half up


def _triggers(conn: Connection) -> list[tuple[Any, ...]]:
    return [tuple(row) for row in conn.exec_driver_sql(_TRIGGERS[conn.dialect.name])]


def _float_ledger_at_0014(conn: Connection) -> None:
    """What a 0014 database holds after a run made 4 calls (3 ok) and was replayed twice, in float USD."""
    conn.execute(
        text(
            "INSERT INTO task_runs (task_name, tenant, idempotency_key, fingerprint, field_digests, status, "
            "fencing_token, attempts, replays, llm_calls, llm_cost) "
            "VALUES (:t, '', 'k', 'f', '{}', 'COMPLETED', 1, 1, 2, 3, :cost)"
        ),
        {"t": TASK, "cost": 0.1 + 0.2},  # 0.30000000000000004
    )
    run_id = conn.execute(text("SELECT id FROM task_runs")).scalar_one()
    for n, cost in enumerate(_FLOATS):
        conn.execute(
            text(
                "INSERT INTO model_calls (call_id, task_name, tenant, run_id, model, input_tokens, output_tokens, "
                "latency_ms, ok, cost) VALUES (:id, :t, '', :r, :m, 10, 0, 1.0, :ok, :cost)"
            ),
            {"id": f"old-{n}", "t": TASK, "r": run_id, "m": MODEL, "ok": cost != 1.5e-06, "cost": cost},
        )
    conn.execute(
        text(
            "INSERT INTO ledger_totals (task_name, tenant, model, calls, failed_calls, input_tokens, output_tokens, "
            "cost, unpriced_calls) VALUES (:t, '', :m, 4, 1, 40, 0, :cost, 1)"
        ),
        {"t": TASK, "m": MODEL, "cost": 0.1 + 0.2 + 1.5e-06},
    )
    conn.execute(
        text(
            "INSERT INTO delivery_outcomes (task_name, tenant, outcome, shard, count, saved_calls, saved_cost) "
            "VALUES (:t, '', 'replayed', 0, 2, 6, :cost)"
        ),
        {"t": TASK, "cost": 2 * (0.1 + 0.2)},  # 0.6000000000000001
    )


def test_the_upgrade_carries_float_costs_to_micros_and_the_downgrade_back(money_url: str) -> None:
    engine = get_engine(money_url)
    downgrade(engine, "0014")
    with engine.begin() as conn:
        at_0014 = _triggers(conn)
        _float_ledger_at_0014(conn)
    upgrade(engine, "0015")

    with engine.connect() as conn:
        assert _triggers(conn) == at_0014, "no trigger was dropped, added or changed"
        rows = conn.execute(select(CALLS.c.cost_micros).order_by(CALLS.c.id)).scalars().all()
        assert rows == [100_000, 200_000, None, 2]
        assert conn.execute(select(TOTALS.c.cost_micros)).scalar_one() == 300_002
        assert conn.execute(select(RUNS.c.llm_cost_micros)).scalar_one() == 300_000
    upgrade(engine)  # the reports read today's schema (the later revisions only add to it)
    # Every figure a report showed before, to the micro-dollar: the scan of the rows and the running totals agree.
    report = cost_report(money_url)
    assert (report.made.cost, report.saved.cost) == (Decimal("0.300002"), Decimal("0.600000"))
    got = scrape(money_url)
    assert got["oncelery_llm_cost_usd_total", (("model", MODEL), ("name", TASK), ("tenant", ""))] == 0.300002
    assert got["oncelery_llm_saved_cost_usd_total", (("name", TASK), ("tenant", ""))] == 0.6

    # The triggers still keep their totals: a new ledger row is observed by 0012's histogram trigger, a run that
    # fails is counted by 0009's; the ledger's own totals stay equal to the rows, in integers.
    db = Database(money_url)
    write_call(db, _call(9, Price(0.15).cost_micros(7, 0)))
    with db.begin() as conn:
        conn.execute(RUNS.update().values(status=RunStatus.FAILED))
    with db.read() as conn:
        h = HISTOGRAM_BUCKETS.c
        observed = select(func.sum(h["count"])).where(h.family == "llm_call_duration")
        assert conn.execute(observed).scalar_one() == len(_FLOATS) + 1  # the 0014 rows, and the new one
        failed = select(func.sum(RUN_STATUS_TOTALS.c.runs)).where(RUN_STATUS_TOTALS.c.status == RunStatus.FAILED)
        assert conn.execute(failed).scalar_one() == 1
        assert conn.execute(select(TOTALS.c.cost_micros)).scalar_one() == 300_004
        assert conn.execute(select(func.sum(CALLS.c.cost_micros))).scalar_one() == 300_004

    downgrade(engine, "0014")
    with engine.connect() as conn:
        assert _triggers(conn) == at_0014
        floats = conn.execute(text("SELECT cost FROM model_calls ORDER BY id")).scalars().all()
        assert floats == [0.1, 0.2, None, 2e-06, 2e-06]
        assert conn.execute(text("SELECT cost FROM ledger_totals")).scalar_one() == 0.300004
        assert conn.execute(text("SELECT llm_cost FROM task_runs")).scalar_one() == 0.3
        assert conn.execute(text("SELECT SUM(saved_cost) FROM delivery_outcomes")).scalar_one() == 0.6
    upgrade(engine)
    with engine.connect() as conn:
        assert _triggers(conn) == at_0014
    assert cost_report(money_url).made.cost == Decimal("0.300004")
