"""One place for the wire: a JSON POST/GET with no retries, each failure turned into one typed error.

No retry here on purpose: a create retried by a transport would be a second paid call that no intent records
(the official SDKs retry twice by default). The caller decides, with a new intent.
"""

from __future__ import annotations

import json
import os
import re
from collections.abc import Generator, Mapping
from dataclasses import dataclass
from datetime import UTC, datetime
from email.utils import parsedate_to_datetime
from typing import Any, Self

import httpx

from oncelery.llm.errors import ProviderRateLimited, ProviderRejected, ProviderUnavailable, ResponseGone
from oncelery.llm.observe import on_request

DEFAULT_TIMEOUT_S = 60.0
AZURE_KEY_ENV = "AZURE_OPENAI_API_KEY"  # the variable Azure's own SDK reads
_DURATION = re.compile(r"(?P<n>\d+(?:\.\d+)?)(?P<unit>ms|h|m|s)")
_UNIT_S = {"ms": 0.001, "s": 1.0, "m": 60.0, "h": 3600.0}


@dataclass(frozen=True)
class RateHint:
    """What a provider's rate-limit headers said about the caller's remaining budget (None: not said)."""

    remaining_requests: int | None = None
    remaining_tokens: int | None = None
    reset_s: float | None = None  # until the tighter of the windows refills
    retry_after_s: float | None = None


def duration_s(text: str) -> float | None:
    """Parse OpenAI's reset durations ("1s", "6m0s", "20ms", "0.5s") into seconds; None if unreadable."""
    parts = list(_DURATION.finditer(text.strip()))
    if not parts or "".join(p.group(0) for p in parts) != text.strip():
        return None
    return sum(float(p["n"]) * _UNIT_S[p["unit"]] for p in parts)


def retry_after_s(value: str | None) -> float | None:
    """Parse `retry-after`: delta seconds or an HTTP date (RFC 9110); None if absent or unreadable."""
    if not value:
        return None
    try:
        return max(0.0, float(value))
    except ValueError:
        pass
    try:
        return max(0.0, (parsedate_to_datetime(value) - datetime.now(UTC)).total_seconds())
    except (TypeError, ValueError):
        return None


def rate_hint(headers: Mapping[str, str]) -> RateHint:
    """Read OpenAI's `x-ratelimit-*`, Anthropic's `anthropic-ratelimit-*` and `retry-after` into one hint."""
    lower = {k.lower(): v for k, v in headers.items()}

    def number(*names: str) -> int | None:
        found = [int(lower[n]) for n in names if lower.get(n, "").isdigit()]
        return min(found) if found else None

    resets = [duration_s(lower[n]) for n in ("x-ratelimit-reset-requests", "x-ratelimit-reset-tokens") if n in lower]
    for name in ("anthropic-ratelimit-requests-reset", "anthropic-ratelimit-tokens-reset"):
        if name in lower:
            try:
                at = datetime.fromisoformat(lower[name].replace("Z", "+00:00"))
                resets.append(max(0.0, (at - datetime.now(UTC)).total_seconds()))
            except ValueError:
                pass
    known = [r for r in resets if r is not None]
    return RateHint(
        remaining_requests=number("x-ratelimit-remaining-requests", "anthropic-ratelimit-requests-remaining"),
        remaining_tokens=number(
            "x-ratelimit-remaining-tokens",
            "anthropic-ratelimit-tokens-remaining",
            "anthropic-ratelimit-input-tokens-remaining",
            "anthropic-ratelimit-output-tokens-remaining",
        ),
        reset_s=max(known) if known else None,
        retry_after_s=retry_after_s(lower.get("retry-after")),
    )


class Transport:
    """JSON over one httpx client for one provider, with no retries; raises only `ProviderError`s."""

    def __init__(
        self,
        provider: str,
        base_url: str,
        headers: Mapping[str, str],
        timeout_s: float = DEFAULT_TIMEOUT_S,
        client: httpx.Client | None = None,
        *,
        proxy: str | None = None,
        params: Mapping[str, str] | None = None,
    ) -> None:
        self.provider = provider
        # Query parameters every request carries (Azure's `api-version`). Not the client's `params=`: httpx replaces
        # a path's own query with those (a stream resume's `?stream=true&starting_after=N` would be lost).
        hooks = {"request": [_add_params(dict(params))]} if params else None
        self.client = client or httpx.Client(
            base_url=base_url.rstrip("/"),
            headers=dict(headers),
            timeout=timeout_s,
            proxy=proxy,
            event_hooks=hooks,
        )
        self.last_hint = RateHint()

    def __repr__(self) -> str:
        # Never the headers: they hold the API key, and `headers=` may hold a gateway's secret.
        return f"Transport({self.provider!r}, {str(self.client.base_url)!r})"

    def send(self, method: str, path: str, body: Mapping[str, Any] | None = None, model: str = "") -> httpx.Response:
        """Send one request and return its 2xx response; map every other outcome to a typed error."""
        on_request()
        try:
            response = self.client.request(method, path, json=body)
        except httpx.ConnectError as exc:
            # Refused before a byte was sent: the provider cannot have the call.
            raise ProviderUnavailable.of(self.provider, f"cannot connect ({exc})", maybe_sent=False) from exc
        except httpx.HTTPError as exc:
            # A timeout or a cut connection after sending: the provider may have the call (and may bill it).
            raise ProviderUnavailable.of(self.provider, f"{type(exc).__name__}: {exc}", maybe_sent=True) from exc
        self.check(response, method, path, model)
        return response

    def json(self, method: str, path: str, body: Mapping[str, Any] | None = None, model: str = "") -> dict[str, Any]:
        """Send one request and return its JSON object."""
        data = self.send(method, path, body, model).json()
        if not isinstance(data, dict):
            raise ProviderUnavailable.of(self.provider, f"{path} answered {type(data).__name__}, not an object", True)
        return data

    def events(
        self, path: str, body: Mapping[str, Any] | None = None, model: str = ""
    ) -> Generator[dict[str, Any], None, None]:
        """Yield the JSON of each server-sent event of a streamed answer (POST with a body, GET without)."""
        method = "POST" if body is not None else "GET"
        on_request()
        try:
            with self.client.stream(method, path, json=body) as response:
                if not response.is_success:
                    response.read()
                self.check(response, method, path, model)
                for line in response.iter_lines():
                    if line.startswith("data: "):
                        yield json.loads(line[6:])
        except httpx.ConnectError as exc:
            raise ProviderUnavailable.of(self.provider, f"cannot connect ({exc})", maybe_sent=False) from exc
        except httpx.HTTPError as exc:
            raise ProviderUnavailable.of(self.provider, f"{type(exc).__name__}: {exc}", maybe_sent=True) from exc

    def check(self, response: httpx.Response, method: str, path: str, model: str) -> None:
        """Keep the rate hint of any answer; return on a 2xx, else raise the one typed error its status means."""
        self.last_hint = rate_hint(response.headers)
        if response.is_success:
            return
        detail = _detail(response)
        if response.status_code == 429:
            wait = self.last_hint.retry_after_s or self.last_hint.reset_s or retry_delay_s(response) or 1.0
            raise ProviderRateLimited.of(self.provider, model or "?", wait, detail)
        if response.status_code == 404 and method == "GET":
            raise ResponseGone.of(self.provider, path.split("?")[0].rsplit("/", 1)[-1])
        if response.status_code >= 500:
            raise ProviderUnavailable.of(self.provider, f"{response.status_code}: {detail}", maybe_sent=True)
        raise ProviderRejected.of(self.provider, response.status_code, detail)

    def close(self) -> None:
        """Close the HTTP client."""
        self.client.close()


class HTTPAdapter:
    """What every adapter over a `Transport` shares: closing its client, and `with` to do so."""

    http: Transport

    def rate_hint(self) -> RateHint:
        """What the provider's rate-limit headers said on the last answer (the shared limiters heed it)."""
        return self.http.last_hint

    def close(self) -> None:
        """Close the adapter's HTTP client."""
        self.http.close()

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def with_extra(own: Mapping[str, str], extra: Mapping[str, str] | None) -> dict[str, str]:
    """An adapter's own headers (auth, protocol version) with the caller's `headers=` added; the caller's win,
    so a gateway can take over authentication."""
    return {**own, **(extra or {})}


class OpenAIAuthAdapter(HTTPAdapter):
    """An adapter on an OpenAI-style API: a base URL and a bearer key ($OPENAI_API_KEY unless given); or Azure
    OpenAI's form (`azure=True`, or the `azure` constructor): the key in `api-key` ($AZURE_OPENAI_API_KEY unless
    given). `api_version` is sent as the `api-version` query parameter of every request, `headers` as extra headers
    of every request (never logged), `proxy` is an HTTP(S) proxy URL every request goes through."""

    def __init__(
        self,
        base_url: str = "https://api.openai.com/v1",
        api_key: str | None = None,
        *,
        provider: str = "openai",
        timeout_s: float = DEFAULT_TIMEOUT_S,
        headers: Mapping[str, str] | None = None,
        proxy: str | None = None,
        api_version: str | None = None,
        azure: bool = False,
    ) -> None:
        self.provider = provider
        if azure:
            key = api_key if api_key is not None else os.environ.get(AZURE_KEY_ENV, "")
            own = {"api-key": key}
        else:
            key = api_key if api_key is not None else os.environ.get("OPENAI_API_KEY", "")
            own = {"Authorization": f"Bearer {key}"}
        params = {"api-version": api_version} if api_version else None
        self.http = Transport(provider, base_url, with_extra(own, headers), timeout_s, proxy=proxy, params=params)

    @classmethod
    def azure(
        cls,
        endpoint: str,
        api_key: str | None = None,
        *,
        api_version: str | None = None,
        provider: str = "azure-openai",
        **options: Any,
    ) -> Self:
        """The adapter on an Azure OpenAI resource (`https://NAME.openai.azure.com`): the deployment is the
        request's `model`. No `api_version` (or "v1"): the v1 API, `{endpoint}/openai/v1/...`; "preview": the same
        with `?api-version=preview`; a dated version ("2025-04-01-preview"): `{endpoint}/openai/...?api-version=`."""
        # URL shapes from Microsoft Learn, "Azure OpenAI Responses API" (learn.microsoft.com/azure/ai-foundry/openai/
        # how-to/responses) and "API version lifecycle": the v1 API needs no api-version and takes the deployment
        # name as `model`; dated versions are the older `/openai/responses?api-version=...` surface.
        root = endpoint.rstrip("/") + "/openai"
        version = None if api_version in (None, "v1") else api_version
        dated = version is not None and version[:1].isdigit()
        base = root if dated else root + "/v1"
        return cls(base, api_key, provider=provider, api_version=version, azure=True, **options)


def retry_delay_s(response: httpx.Response) -> float | None:
    """Read Google's wait of a 429: the error's `google.rpc.RetryInfo` detail (`retryDelay`, "37s"), which Gemini
    sends instead of a `retry-after` header; None if absent or unreadable."""
    try:
        body = response.json()
    except ValueError:
        return None
    error = body.get("error") if isinstance(body, dict) else None
    details = error.get("details") if isinstance(error, dict) else None
    for detail in details if isinstance(details, list) else []:
        if isinstance(detail, dict) and str(detail.get("@type", "")).endswith("google.rpc.RetryInfo"):
            return duration_s(str(detail.get("retryDelay") or ""))
    return None


def _add_params(params: dict[str, str]) -> Any:
    def add(request: httpx.Request) -> None:
        request.url = request.url.copy_merge_params(params)

    return add


def _detail(response: httpx.Response) -> str:
    try:
        body = response.json()
    except ValueError:
        return response.text[:200]
    error = body.get("error") if isinstance(body, dict) else None
    if isinstance(error, dict):
        return str(error.get("message") or error)[:200]
    return str(body)[:200]
