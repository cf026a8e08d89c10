"""The article pipeline's model, served: which provider `self.llm()` calls, and the request each step sends.

Offline (the default), the steps call the fake provider (`oncelery.FakeProvider`, a real HTTP server on
127.0.0.1) in OpenAI's background mode, and its answers are written by the demo's `LocalModel`: a worker killed
mid-call leaves the call running there, and the next holder re-attaches to it. `oncelery process` runs one
provider for all its workers and names it in $ONCELERY_FAKE_PROVIDER_URL; a worker started without it runs one
of its own (re-attaching then works within that worker only). With $ONCELERY_LLM_BASE_URL set, the steps call
that OpenAI-compatible server's chat completions instead (synchronous: a call in flight at a crash is sent
again, labelled `sync_unknown` in the ledger).
"""

from __future__ import annotations

import atexit
import os
import threading
from collections.abc import Mapping
from typing import Any, Final

from oncelery import BatchPolicy, FakeProvider, OpenAIChat, OpenAIResponses
from oncelery.tasks.llm.base import INSTRUCTIONS, check_task
from oncelery.tasks.llm.local import LocalModel
from oncelery.tasks.llm.openai_compat import ENV_API_KEY, ENV_BASE_URL, ENV_MODEL, OpenAICompatibleClient

ENV_FAKE_PROVIDER_URL: Final = "ONCELERY_FAKE_PROVIDER_URL"
# "batch": the article steps are items of provider batches at about half the price (`oncelery process --batch`).
ENV_LLM_MODE: Final = "ONCELERY_LLM_MODE"
# Each step of every article in one provider batch, sent once the oldest item waited a second.
BATCH: Final = BatchPolicy(max_items=10_000, max_wait_s=1.0)
MAX_OUTPUT_TOKENS: Final = 256
SEED_KEY: Final = "oncelery_seed"  # in the request's metadata: the step's seed, which the digest leaves out
_BY_INSTRUCTIONS = {text: task for task, text in INSTRUCTIONS.items()}
_served: dict[int, Any] = {}  # per process: its adapter (and the provider it started, if any)
_lock = threading.Lock()  # a threads pool asks for it from several threads at once: make one


def local_answer(request: Mapping[str, Any]) -> str:
    """The fake provider's answer to a demo request: LocalModel's, at the request's temperature and seed."""
    task = _BY_INSTRUCTIONS.get(str(request.get("instructions")), "summarize")
    seed = (request.get("metadata") or {}).get(SEED_KEY)
    temperature = float(request.get("temperature") or 0.0)
    limit = int(request.get("max_output_tokens") or MAX_OUTPUT_TOKENS)
    text = str(request.get("input") or "")
    return (
        LocalModel()
        .complete(task, text, temperature=temperature, seed=int(seed) if seed else None, max_tokens=limit)
        .text
    )


def start_provider(call_seconds: tuple[float, float] = (0.0, 0.0)) -> FakeProvider:
    """Start a fake provider answering with LocalModel, each call taking between `call_seconds` (min, max)."""
    low, high = call_seconds
    provider = FakeProvider(generator=local_answer).start()
    provider.set_knobs(generation_s=low, generation_max_s=high, poll_after_ms=20)
    return provider


def adapter() -> Any:
    """This process's adapter: chat completions on $ONCELERY_LLM_BASE_URL, else the (fake) provider's Responses."""
    pid = os.getpid()
    with _lock:
        if pid not in _served:
            _served[pid] = made = _make_adapter()
            atexit.register(made.close)  # its HTTP connections, closed when the process ends
        return _served[pid]


def _make_adapter() -> Any:
    if os.environ.get(ENV_BASE_URL):
        key = os.environ.get(ENV_API_KEY) or "none"
        return OpenAIChat(os.environ[ENV_BASE_URL], key, provider="openai-compatible")
    # A worker started without the command's provider runs one of its own, for as long as it lives.
    url = os.environ.get(ENV_FAKE_PROVIDER_URL) or start_provider().url
    return OpenAIResponses(url.rstrip("/") + "/v1", "sk-local", provider="local")


def batched() -> bool:
    """Whether this process's article steps are batch items ($ONCELERY_LLM_MODE=batch; the fake provider only:
    a compatible server's chat completions have no batch API)."""
    return os.environ.get(ENV_LLM_MODE) == "batch" and not os.environ.get(ENV_BASE_URL)


def request(task: str, text: str, temperature: float, seed: int) -> dict[str, Any]:
    """The request step `task` sends for `text`: a Responses request, or chat messages for a compatible server."""
    check_task(task)
    if os.environ.get(ENV_BASE_URL):
        messages = OpenAICompatibleClient(os.environ[ENV_BASE_URL], os.environ.get(ENV_MODEL) or "model").messages(
            task, text
        )
        return {
            "model": os.environ.get(ENV_MODEL) or "",
            "messages": messages,
            "temperature": temperature,
            "seed": seed,
            "max_tokens": MAX_OUTPUT_TOKENS,
        }
    return {
        "model": LocalModel.model,
        "instructions": INSTRUCTIONS[task],
        "input": text,
        "temperature": temperature,
        "max_output_tokens": MAX_OUTPUT_TOKENS,
        "metadata": {SEED_KEY: str(seed)},
    }
