"""`OpenAICompatibleClient`: chat completions on any OpenAI-compatible server (OpenAI, vLLM, Ollama...)."""

from __future__ import annotations

import logging
import os
import threading
import time
from types import TracebackType
from typing import Any, Final

import httpx

from oncelery import ConfigurationError
from oncelery.tasks.llm.base import INSTRUCTIONS, PROMPT_VERSION, LLMResult, check_task, hash_payload
from oncelery.tasks.llm.errors import LLMHTTPError, LLMMalformedReply, LLMUnavailable

logger = logging.getLogger(__name__)

ENV_BASE_URL: Final = "ONCELERY_LLM_BASE_URL"
ENV_MODEL: Final = "ONCELERY_LLM_MODEL"
ENV_API_KEY: Final = "ONCELERY_LLM_API_KEY"
ENV_MODEL_VERSION: Final = "ONCELERY_LLM_MODEL_VERSION"
ENV_TIMEOUT: Final = "ONCELERY_LLM_TIMEOUT"
ENV_MAX_ATTEMPTS: Final = "ONCELERY_LLM_MAX_ATTEMPTS"

DEFAULT_TIMEOUT: Final = 60.0  # seconds per request (read); connecting gets at most CONNECT_TIMEOUT
CONNECT_TIMEOUT: Final = 10.0
DEFAULT_MAX_ATTEMPTS: Final = 4
DEFAULT_BACKOFF: Final = 0.5  # first retry delay; doubles per attempt up to BACKOFF_CAP
BACKOFF_CAP: Final = 20.0
_RETRY_STATUSES: Final = frozenset({408, 429})  # request timeout, rate limited: transient 4xx
_BODY_EXCERPT: Final = 300


class OpenAICompatibleClient:
    """An `LLMClient` over POST {base_url}/chat/completions: retries transient failures, types every other one."""

    def __init__(
        self,
        base_url: str,
        model: str,
        api_key: str | None = None,
        *,
        model_version: str | None = None,
        timeout: float = DEFAULT_TIMEOUT,
        max_attempts: int = DEFAULT_MAX_ATTEMPTS,
        backoff: float = DEFAULT_BACKOFF,
    ) -> None:
        if not base_url or not model:
            raise ConfigurationError(
                f"OpenAICompatibleClient needs a base URL and a model: set {ENV_BASE_URL} and {ENV_MODEL}"
            )
        if max_attempts < 1 or timeout <= 0 or backoff < 0:
            raise ConfigurationError("max_attempts must be >= 1, timeout > 0 and backoff >= 0")
        self.base_url = base_url.rstrip("/")
        self.model = model
        # Without a pinned version the model name stands for it; pin one to catch silent model upgrades.
        self.model_version = model_version or model
        self.timeout = timeout
        self.max_attempts = max_attempts
        self.backoff = backoff
        self._api_key = api_key
        self._http: httpx.Client | None = None
        self._pid = 0
        self._lock = threading.Lock()

    @classmethod
    def from_env(cls, **overrides: Any) -> OpenAICompatibleClient:
        """Build a client from ONCELERY_LLM_* variables (keyword arguments win); fail early naming what is unset."""
        env = os.environ
        settings: dict[str, Any] = {
            "base_url": env.get(ENV_BASE_URL, ""),
            "model": env.get(ENV_MODEL, ""),
            "api_key": env.get(ENV_API_KEY) or None,
            "model_version": env.get(ENV_MODEL_VERSION) or None,
        }
        # Each variable is checked on its own, so the message names the one to fix and what to give.
        if env.get(ENV_TIMEOUT):
            settings["timeout"] = _number(env[ENV_TIMEOUT], float, ENV_TIMEOUT, "seconds as a number > 0 (e.g. 60)")
        if env.get(ENV_MAX_ATTEMPTS):
            settings["max_attempts"] = _number(env[ENV_MAX_ATTEMPTS], int, ENV_MAX_ATTEMPTS, "a whole number >= 1")
        settings.update(overrides)
        missing = [name for name, field in ((ENV_BASE_URL, "base_url"), (ENV_MODEL, "model")) if not settings[field]]
        if missing:
            raise ConfigurationError(
                f"Set {' and '.join(missing)} to use an OpenAI-compatible server "
                f"(e.g. {ENV_BASE_URL}=http://127.0.0.1:11434/v1 for Ollama), or use the offline LocalModel"
            )
        return cls(**settings)

    def messages(self, task: str, text: str) -> list[dict[str, str]]:
        """Return the exact chat messages sent for `task` over `text`."""
        return [{"role": "system", "content": INSTRUCTIONS[check_task(task)]}, {"role": "user", "content": text}]

    def prompt_hash(self, task: str, text: str) -> str:
        """Return sha256 of the rendered messages, model, pinned version and prompt version (equal in every process)."""
        return hash_payload(
            {
                "client": "openai-compatible",
                "model": self.model,
                "model_version": self.model_version,
                "prompt_version": PROMPT_VERSION,
                "messages": self.messages(task, text),
            }
        )

    def complete(
        self, task: str, text: str, *, temperature: float = 0.0, seed: int | None = None, max_tokens: int = 256
    ) -> LLMResult:
        """Make one chat completion (retrying transient failures) and return its text, usage and latency."""
        body: dict[str, Any] = {
            "model": self.model,
            "messages": self.messages(task, text),
            "temperature": temperature,
            "max_tokens": max_tokens,
        }
        if seed is not None:
            body["seed"] = seed
        started = time.perf_counter()
        reply = self._post_with_retries(body)
        latency_ms = (time.perf_counter() - started) * 1000.0
        return self._parse(reply, latency_ms)

    def _post_with_retries(self, body: dict[str, Any]) -> httpx.Response:
        url = f"{self.base_url}/chat/completions"
        problem = ""
        for attempt in range(1, self.max_attempts + 1):
            wait = self.backoff * 2 ** (attempt - 1)
            try:
                response = self._client().post(url, json=body)
            except (httpx.TimeoutException, httpx.TransportError) as exc:
                problem = f"{type(exc).__name__}: {exc}"
            else:
                status = response.status_code
                if status < 300:
                    return response
                if status < 500 and status not in _RETRY_STATUSES:
                    raise self._http_error(response)
                problem = f"HTTP {status}: {response.text[:_BODY_EXCERPT]}"
                wait = max(wait, _retry_after(response))
            if attempt < self.max_attempts:
                wait = min(wait, BACKOFF_CAP)
                logger.warning(
                    "LLM call to %s failed (attempt %d/%d): %s; retrying in %.2fs",
                    url,
                    attempt,
                    self.max_attempts,
                    problem,
                    wait,
                )
                time.sleep(wait)
        raise LLMUnavailable(
            f"LLM server {url} failed {self.max_attempts} times; last: {problem}",
            url=url,
            attempts=self.max_attempts,
        )

    def _http_error(self, response: httpx.Response) -> LLMHTTPError:
        status = response.status_code
        if 300 <= status < 400:
            fix = f"the server redirects to {response.headers.get('location')!r}; set {ENV_BASE_URL} to that API root"
        elif status in (401, 403):
            fix = f"check the API key ({ENV_API_KEY})"
        elif status == 404:
            fix = (
                f"check the model name {self.model!r} ({ENV_MODEL}) and that {ENV_BASE_URL}={self.base_url} "
                f"is the API root (usually ending in /v1)"
            )
        else:
            fix = "the server rejected the request; see its message"
        return LLMHTTPError(
            f"LLM server answered HTTP {status}: {fix}. Body: {response.text[:_BODY_EXCERPT]}",
            status_code=status,
        )

    def _parse(self, response: httpx.Response, latency_ms: float) -> LLMResult:
        try:
            data = response.json()
        except ValueError as exc:
            raise LLMMalformedReply(
                f"LLM reply is not JSON: {response.text[:_BODY_EXCERPT]!r}", body=response.text[:_BODY_EXCERPT]
            ) from exc
        try:
            content = data["choices"][0]["message"]["content"]
        except (KeyError, IndexError, TypeError) as exc:
            raise LLMMalformedReply(
                f"LLM reply has no choices[0].message.content: {response.text[:_BODY_EXCERPT]!r}",
                body=response.text[:_BODY_EXCERPT],
            ) from exc
        if not isinstance(content, str):
            raise LLMMalformedReply(f"LLM reply content is {type(content).__name__}, not text", body=str(content)[:80])
        usage = data.get("usage") or {}
        answered_by = data.get("model")
        return LLMResult(
            text=content.strip(),
            # Servers that report no usage are recorded as 0 tokens (the ledger then undercounts, visibly).
            input_tokens=_int(usage.get("prompt_tokens")),
            output_tokens=_int(usage.get("completion_tokens")),
            latency_ms=latency_ms,
            model=self.model,
            # The snapshot the server says answered (e.g. "gpt-4o-2024-08-06") is the truest version we get.
            model_version=answered_by if isinstance(answered_by, str) and answered_by else self.model_version,
        )

    def _client(self) -> httpx.Client:
        # One pooled client per process: a client created before a prefork fork must not share its sockets.
        with self._lock:
            if self._http is None or self._pid != os.getpid():
                headers = {"Authorization": f"Bearer {self._api_key}"} if self._api_key else {}
                timeout = httpx.Timeout(self.timeout, connect=min(self.timeout, CONNECT_TIMEOUT))
                self._http = httpx.Client(timeout=timeout, headers=headers)
                self._pid = os.getpid()
            return self._http

    def close(self) -> None:
        """Close the pooled HTTP connections of this process."""
        with self._lock:
            if self._http is not None and self._pid == os.getpid():
                self._http.close()
            self._http = None

    def __enter__(self) -> OpenAICompatibleClient:
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.close()

    def __repr__(self) -> str:
        return f"OpenAICompatibleClient(base_url={self.base_url!r}, model={self.model!r})"


def _retry_after(response: httpx.Response) -> float:
    """Seconds the server asked us to wait (Retry-After in seconds), else 0."""
    try:
        return max(0.0, float(response.headers.get("retry-after", "0")))
    except ValueError:
        return 0.0


def _int(value: Any) -> int:
    return value if isinstance(value, int) and value >= 0 else 0


def _number(raw: str, kind: type[float] | type[int], name: str, what: str) -> Any:
    """Return `raw` as `kind` if positive, else raise ConfigurationError naming the variable and what to give."""
    try:
        value = kind(raw.strip())
    except ValueError:
        value = 0
    if not value > 0:
        raise ConfigurationError(f"{name}={raw!r}: give {what}")
    return value
