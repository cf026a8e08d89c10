"""`oncelery process --batch`: the article pipeline's steps as items of provider batches, on the embedded default
(no server): every article scored once with the same results as synchronous calls, each step round pooled into
provider batches, and the summary's cost saved exact (the ledger's batch rows against the synchronous price)."""

from __future__ import annotations

from decimal import Decimal
from pathlib import Path

from sqlalchemy import create_engine, func, select

from oncelery.models import IntentState, ModelCall
from oncelery.store.tables import BATCH_ITEMS, INTENTS
from tests.test_process import check_exactly_once, database_state, live_workers, load_articles, process


def test_process_batch_scores_each_article_once_at_half_price(tmp_path: Path) -> None:
    done = process("--limit", "4", "--batch", "--call-seconds", "0", cwd=tmp_path, sample=True)
    assert done.code == 0, f"{done.out}\n{done.err}"
    assert live_workers(done.out) == [], "the command left its worker running"
    url = f"sqlite:///{tmp_path / 'oncelery.db'}"
    state = database_state(url)
    assert state["calls"] == state["ok_calls"] == 12
    check_exactly_once(state, load_articles(4))  # the same results as synchronous calls: the undisturbed model's
    engine = create_engine(url)
    try:
        with engine.connect() as conn:
            modes = dict(conn.execute(select(INTENTS.c.mode, func.count()).group_by(INTENTS.c.mode)).all())
            states = {r.state for r in conn.execute(select(INTENTS))}
            items = conn.execute(select(BATCH_ITEMS)).all()
            ledger = conn.execute(select(func.sum(ModelCall.cost_micros))).scalar_one()
    finally:
        engine.dispose()
    assert modes == {"batch": 12} and states == {IntentState.DONE}, (modes, states)
    assert len(items) == 12 and all(i.request is None and i.response is None for i in items)
    batch = done.summary["batch"]
    assert batch["calls"] == 12 and 3 <= batch["batches"] <= 12, batch  # each step round pooled
    cost, sync, saved = (Decimal(batch[k]) for k in ("cost", "synchronous", "saved"))
    assert cost == Decimal(ledger) / 1_000_000 and saved == sync - cost > 0
    assert cost * 2 - sync <= Decimal("0.000012"), "half price, up to one micro-USD rounded up per call"
    assert "saved by batching" in done.out
    # Every run parked on each batch step and replayed its checkpoints when woken: not calls saved.
    s = done.summary
    assert s["parked"] >= 12 and s["llm_calls_saved"] == 3 * s["replayed"], s
