"""`LocalModel`: the offline default LLMClient — real text algorithms, no network, no weights to download."""

from __future__ import annotations

import logging
import random
import time
from typing import Final

from oncelery import ConfigurationError
from oncelery.tasks.llm.base import PROMPT_VERSION, LLMResult, check_task, hash_payload
from oncelery.tasks.llm.extractive import keywords, summarize
from oncelery.tasks.llm.quality import quality_score

logger = logging.getLogger(__name__)

QUALITY_NOISE: Final = 4.0  # points of standard deviation per unit of temperature


class LocalModel:
    """An `LLMClient` that answers summarize/keywords/quality offline; deterministic at temperature 0.

    With temperature > 0 it samples (sentences and keywords by softmax over their scores, the quality score
    with Gaussian noise) from `random.Random(seed)`: the same seed gives the same answer, another seed
    visibly another — what an un-guarded retry of a real model does. Tokens are counted as whitespace-separated
    words of the input text and of the answer (not a model tokenizer's units).
    """

    model = "local-extractive"
    model_version = "1"

    def __init__(self, *, summary_sentences: int = 3, keyword_count: int = 8) -> None:
        if summary_sentences < 1 or keyword_count < 1:
            raise ConfigurationError("summary_sentences and keyword_count must be >= 1")
        self.summary_sentences = summary_sentences
        self.keyword_count = keyword_count

    def prompt_hash(self, task: str, text: str) -> str:
        """Return sha256 of the task, text, model, version and the parameters that shape the answer."""
        return hash_payload(
            {
                "client": "local",
                "model": self.model,
                "model_version": self.model_version,
                "prompt_version": PROMPT_VERSION,
                "task": check_task(task),
                "params": {"summary_sentences": self.summary_sentences, "keyword_count": self.keyword_count},
                "text": text,
            }
        )

    def complete(
        self, task: str, text: str, *, temperature: float = 0.0, seed: int | None = None, max_tokens: int = 256
    ) -> LLMResult:
        """Answer `task` for `text`: a summary, comma-separated keywords, or a 0..100 score as text."""
        check_task(task)
        started = time.perf_counter()
        # seed=None with temperature > 0 draws from OS entropy: a deliberately unrepeatable answer.
        rng = random.Random(seed)
        if task == "summarize":
            answer = summarize(
                text, n_sentences=self.summary_sentences, max_words=max_tokens, temperature=temperature, rng=rng
            )
        elif task == "keywords":
            answer = ", ".join(keywords(text, k=self.keyword_count, temperature=temperature, rng=rng))
        else:
            score = quality_score(text)
            if temperature > 0:
                score = min(100.0, max(0.0, round(score + rng.gauss(0.0, QUALITY_NOISE * temperature), 1)))
            answer = f"{score:.1f}"
        latency_ms = (time.perf_counter() - started) * 1000.0
        logger.debug("local model %s: %d words in, %.1f ms", task, len(text.split()), latency_ms)
        return LLMResult(
            text=answer,
            input_tokens=len(text.split()),
            output_tokens=len(answer.split()),
            latency_ms=latency_ms,
            model=self.model,
            model_version=self.model_version,
        )

    def __repr__(self) -> str:
        return f"LocalModel(summary_sentences={self.summary_sentences}, keyword_count={self.keyword_count})"
