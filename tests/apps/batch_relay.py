"""A relay subprocess whose batcher is SIGKILLed once at a batch crash point (`python -m tests.apps.batch_relay`).

    ONCELERY_DATABASE_URL      the claims database
    ONCELERY_BROKER_URL        the Redis broker (the woken runs are re-sent there)
    ONCELERY_RESULT_BACKEND    the Redis result backend
    ONCELERY_OUTBOX_QUEUE      the test's queue
    ONCELERY_FAKE_PROVIDER_URL the fake provider (its batch API)
    ONCELERY_KILL_AT           a batch fault point (oncelery.runs.faults) where this process SIGKILLs itself, once
    ONCELERY_CRASH_MARKS       a folder: the kill leaves a mark there, so a restarted relay passes the point
    ONCELERY_BATCH_PROVIDER    "openai" (default: Files and Batches, tagged), "anthropic" (Message Batches, untagged)
                               or "gemini" (batch mode: inline requests, tagged by displayName)
    ONCELERY_BATCH_UNTAGGED_SEARCH_S  seconds an untagged batch waits for a running one before it is created
                               again (default: the batcher's 24 h)
    ONCELERY_TEST_PRICES       the app's `oncelery_prices` as JSON (the batcher prices a duplicate batch's calls)

It serves rounds until SIGTERM (or the kill).
"""

from __future__ import annotations

import json
import logging
import os
import signal
import threading
from pathlib import Path
from typing import Any

from oncelery import Relay
from oncelery.llm.adapters.batch import AnthropicBatches, GeminiBatches, OpenAIBatches
from oncelery.runs.faults import fault_injected
from tests.apps.outbox_app import ENV_DATABASE_URL, create_app


def _kill_once(point: str) -> Any:
    mark = Path(os.environ["ONCELERY_CRASH_MARKS"]) / f"relay.{point}"

    def hook(_name: str, _context: dict[str, Any]) -> None:
        try:
            mark.touch(exist_ok=False)
        except FileExistsError:
            return
        os.kill(os.getpid(), signal.SIGKILL)

    return hook


def main() -> None:
    """Serve relay rounds (the batcher polling every 50 ms) until SIGTERM; die at $ONCELERY_KILL_AT once."""
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(levelname)s %(message)s")
    app = create_app(os.environ)
    app.conf.oncelery_prices = json.loads(os.environ.get("ONCELERY_TEST_PRICES") or "null")
    stop = threading.Event()
    signal.signal(signal.SIGTERM, lambda *_: stop.set())
    url = os.environ["ONCELERY_FAKE_PROVIDER_URL"]
    provider = os.environ.get("ONCELERY_BATCH_PROVIDER") or "openai"
    adapters = {"anthropic": AnthropicBatches, "gemini": GeminiBatches, "openai": OpenAIBatches}
    adapter = adapters[provider](url + ("/v1beta" if provider == "gemini" else "/v1"), "sk-batch")
    search = os.environ.get("ONCELERY_BATCH_UNTAGGED_SEARCH_S")
    bound = {"batch_untagged_search_s": float(search)} if search else {}
    relay = Relay(app, os.environ[ENV_DATABASE_URL], sweep_interval=None, batch_adapters={provider: adapter},
                  batch_poll_s=0.05, batch_lease_s=1.0, **bound)  # fmt: skip
    point = os.environ.get("ONCELERY_KILL_AT")
    if point:
        with fault_injected(point, _kill_once(point)):
            relay.serve(stop, interval=0.05)
    else:
        relay.serve(stop, interval=0.05)


if __name__ == "__main__":
    main()
