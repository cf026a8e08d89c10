"""A fake model provider: a real HTTP server on 127.0.0.1 that speaks OpenAI's, Anthropic's and Gemini's protocols.

It answers `POST /v1/responses` (foreground, background, streamed with sequence numbers; retrieve, stream
resume with `starting_after`, cancel, the `openai-poll-after-ms` header), `POST /v1/chat/completions`,
Anthropic's `POST /v1/messages` and Gemini's `POST /v1beta/models/{model}:generateContent`, with deterministic
text and exact token counts of its own, and the three providers' batch APIs (OpenAI Files and Batch, Anthropic
Message Batches, Gemini batch mode), time compressed: a batch advances as it is polled.
Its counters (creates per intent, 429s served, polls, cancels, batch items per custom_id) are the oracle of every
test of a model call: they are what a provider would have billed. Knobs make it slow, forgetful, stuck, failing,
or hold a create's answer so that a test can kill a worker inside the create window every time.

Standard library only: it imports without pytest, the demo or any provider SDK, so `oncelery process` can run it
on a plain `pip install oncelery`. Run it in a thread (`FakeProvider()`) or as a process
(`python -m oncelery.llm.fake --port 0`), and drive either over HTTP with `FakeProviderControl`.

Reading order: `generate` (text and tokens), `state` (responses, knobs, counters), `protocol` (wire shapes);
the batch APIs: `batch_records` (files, batches, their items), `files` (OpenAI's Files API), `batch_checks`
(creates validated), `batches` (a batch's life, time compressed), `batch_shapes` (the providers' batch objects);
HTTP: `exchange` (reading a request, answering in a provider's shapes), `batch_routes` (the Files and batch
routes), `handler` (the routes, the model creates, the `/_fake/*` control API), `server` (the server, in a thread
or as the process), `control` (`FakeProviderControl`, the control API's client).
"""

from oncelery.llm.fake.control import FakeProviderControl
from oncelery.llm.fake.generate import generate_text
from oncelery.llm.fake.server import FakeProvider
from oncelery.llm.fake.state import Knobs
from oncelery.llm.tokens import count_tokens

__all__ = ["FakeProvider", "FakeProviderControl", "Knobs", "count_tokens", "generate_text"]
