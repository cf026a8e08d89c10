"""The example's job: summarise a document once per (doc_id, version), with one durable model call."""

import os
from typing import Any

from myapp.celery import app
from oncelery import IdempotentTask, OpenAIResponses, output_text


def openai() -> OpenAIResponses:
    """The adapter, made once per worker process: its key is $OPENAI_API_KEY (from .env, or from the file
    OPENAI_API_KEY_FILE names: the deploy scripts export it), never baked into the image."""
    return OpenAIResponses(os.environ.get("MYAPP_OPENAI_BASE_URL") or "https://api.openai.com/v1")


@app.task(
    base=IdempotentTask,
    bind=True,
    name="myapp.summarize",
    idempotency_key="summary:{doc_id}:v{version}",
    llm_adapter=openai,
)
def summarize(self: IdempotentTask, doc_id: str, version: int, text: str) -> dict[str, Any]:
    """Summarise `text` once per (doc_id, version): a redelivery replays the model's answer, never pays again."""
    model = os.environ.get("MYAPP_MODEL", "gpt-5-mini")
    response = self.llm("summary", model=model, input=f"Summarise in one sentence:\n{text}", max_output_tokens=200)
    return {"doc_id": doc_id, "version": version, "summary": output_text(response)}
