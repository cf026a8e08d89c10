"""The fake model provider: a real HTTP server on 127.0.0.1 that speaks OpenAI's, Anthropic's and Gemini's protocols.

Public: `oncelery.testing` re-exports it, the demo (`oncelery process`) runs on it, and your own tests start it to
call a model without a key, a bill or a network. The names below are the stable surface; the modules are not.

It answers `POST /v1/responses` (foreground, background, streamed with sequence numbers; retrieve, stream
resume with `starting_after`, cancel, the `openai-poll-after-ms` header), `POST /v1/chat/completions`,
Anthropic's `POST /v1/messages` and Gemini's `POST /v1beta/models/{model}:generateContent`, with deterministic
text (`generate_text`) and exact token counts of its own (`count_tokens`), and the three providers' batch APIs
(OpenAI Files and Batch, Anthropic Message Batches, Gemini batch mode), time compressed: a batch advances as it
is polled.

Start it in a thread of your test (`with FakeProvider() as fake:`, or `FakeProvider(Knobs(...)).start()` and
`.stop()`; point an adapter at `fake.openai_base_url`, `fake.url` or `fake.gemini_base_url`), or as a process of
its own, `python -m oncelery.fake_provider --port 0 [--knobs JSON]`: the first line it prints is its URL and
SIGTERM stops it. Drive either over HTTP with `FakeProviderControl(url)` (a `FakeProvider` is one):
`stats()`, `set_knobs(...)`, `release()`, `forget()`, `reset()`, `wait_for(predicate)`.

Its counters (`stats()`) are the oracle of every test of a model call: what a provider would have billed and
served. `creates` (per endpoint) and `creates_by_intent` (per intent id a client sent: a count above 1 is a call
made twice), `polls`, `cancels`, `errors_served` and `rate_limited` (the 429s), `billed_input_tokens` and
`billed_output_tokens`, `batches_created` and `items_by_custom_id` (a count above 1 is a batch item submitted
twice), `max_in_flight` (the most calls generating at once) and `requests_seen` (the last requests' headers).
`Knobs` make it slow, forgetful, stuck, failing, rate-limited, or hold a create's answer so that a test can
kill a worker inside the create window every time; each can change while it runs.

Standard library only (import-linter holds it to that: no third-party package, no other room of the framework),
so it imports without pytest, Celery, a database or any provider SDK, and runs on a plain `pip install oncelery`.

Reading order: `tokens` (the billed text and the token count), `generate` (the answers' text), `state`
(responses, knobs, counters), `protocol` (wire shapes); the batch APIs: `batch_records` (files, batches, their
items), `files` (OpenAI's Files API), `batch_checks` (creates validated), `batches` (a batch's life, time
compressed), `batch_shapes` (the providers' batch objects); HTTP: `exchange` (reading a request, answering in a
provider's shapes), `batch_routes` (the Files and batch routes), `handler` (the routes, the model creates, the
`/_fake/*` control API), `server` (the server, in a thread or as the process), `control` (`FakeProviderControl`,
the control API's client); `__main__` (the process).
"""

from oncelery.fake_provider.control import FakeProviderControl
from oncelery.fake_provider.generate import generate_text
from oncelery.fake_provider.server import FakeProvider
from oncelery.fake_provider.state import KnobError, Knobs
from oncelery.token_count import count_tokens

__all__ = [
    # The provider, in a thread; its client over HTTP (for a thread or a process)
    "FakeProvider",
    "FakeProviderControl",
    # How it behaves
    "KnobError",
    "Knobs",
    # Its answers and its bill, for a test's expected values
    "count_tokens",
    "generate_text",
]
