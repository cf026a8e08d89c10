"""Token estimates count with tiktoken only where it is installed AND the model's encoding is already cached: a
missing tiktoken or an encoding that would need a download leaves the built-in estimate at once, with no network
and no exception; a cached encoding (a tiny one made here, loaded through tiktoken's own cache and hash check)
is used, and the estimate is never below either count."""

from __future__ import annotations

import base64
import hashlib
import math
import socket
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import tiktoken
import tiktoken.load
import tiktoken.model
import tiktoken.registry

from oncelery.llm import tokenizer
from oncelery.llm.tokens import count_tokens, estimate_tokens

TEXT = "Résumé: the council approved 3 budgets — 12,500 € each!"
FLOOR = max(count_tokens(TEXT), math.ceil(len(TEXT.encode()) / 3))  # the built-in estimate, as documented
BYTES = "oncelery_bytes"  # a tiny encoding: every byte is one token (no merges)
BYTES_URL = "https://tiktoken.invalid/oncelery_bytes.tiktoken"  # never fetched: it is read from the cache or refused
BYTES_MODEL = "oncelery-bytes-model"
# A bound on a hang (a download waiting on a network that is not there), not a benchmark: a loaded 2-core
# machine can take a second to import tiktoken.
FAST_S = 10.0


ATTEMPTS: list[Any] = []  # connections tried during the test (each refused); the fixture checks none was


@pytest.fixture
def fresh(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> Iterator[Path]:
    """Nothing remembered of earlier tries, an empty tiktoken cache of the test's own, and no network: every
    connection attempt is refused and recorded, and the test fails if there was one. Yields the cache folder."""
    cache = tmp_path / "tiktoken-cache"
    cache.mkdir()
    monkeypatch.setenv("TIKTOKEN_CACHE_DIR", str(cache))
    ATTEMPTS.clear()

    def no_network(*args: Any, **kwargs: Any) -> Any:
        ATTEMPTS.append(args)  # recorded: an error raised here could be swallowed on its way up
        raise OSError(f"no network in this test: {args!r}")

    monkeypatch.setattr(socket, "getaddrinfo", no_network)
    monkeypatch.setattr(socket, "create_connection", no_network)
    monkeypatch.setattr(socket.socket, "connect", no_network)
    tokenizer._loaded.clear()
    tokenizer._tiktoken.cache_clear()
    yield cache
    assert ATTEMPTS == [], "a token estimate tried the network"
    tokenizer._loaded.clear()
    tokenizer._tiktoken.cache_clear()
    tiktoken.registry.ENCODINGS.pop(BYTES, None)


@pytest.fixture
def bytes_encoding(monkeypatch: pytest.MonkeyPatch) -> bytes:
    """Register the tiny encoding with tiktoken (as a plugin would) for BYTES_MODEL: its file is BYTES_URL, checked
    against its sha256 as tiktoken checks its own. Returns the file's content (not yet in any cache)."""
    content = b"".join(base64.b64encode(bytes([b])) + b" %d\n" % b for b in range(256))
    digest = hashlib.sha256(content).hexdigest()

    def constructor() -> dict[str, Any]:
        ranks = tiktoken.load.load_tiktoken_bpe(BYTES_URL, expected_hash=digest)
        return {"name": BYTES, "pat_str": r"\S+|\s+", "mergeable_ranks": ranks, "special_tokens": {}}

    tiktoken.registry.list_encoding_names()  # tiktoken finds its plugins' constructors first
    assert tiktoken.registry.ENCODING_CONSTRUCTORS is not None
    monkeypatch.setitem(tiktoken.registry.ENCODING_CONSTRUCTORS, BYTES, constructor)
    monkeypatch.setitem(tiktoken.model.MODEL_TO_ENCODING, BYTES_MODEL, BYTES)
    return content


def cache_file(cache: Path, url: str) -> Path:
    """Where tiktoken keeps the file of `url` in its cache folder."""
    return cache / hashlib.sha1(url.encode()).hexdigest()


def timed(model: str) -> tuple[int, float]:
    started = time.perf_counter()
    estimate = estimate_tokens(TEXT, model)
    return estimate, time.perf_counter() - started


def test_without_tiktoken_the_estimate_is_the_built_in_one(fresh: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "tiktoken", None)  # `import tiktoken` raises ImportError
    estimate, took = timed("gpt-4o-mini")
    assert estimate == estimate_tokens(TEXT) == FLOOR and took < FAST_S


def test_an_encoding_that_would_need_a_download_is_never_fetched(fresh: Path) -> None:
    """tiktoken is installed, gpt-4o-mini's encoding (o200k_base) is not in the cache: the estimate is the built-in
    one, fast, with no connection attempted and nothing written to the cache; tiktoken's reader is as it was,
    and the next estimate does not try again."""
    reader = tiktoken.load.read_file
    estimate, took = timed("gpt-4o-mini")
    assert estimate == FLOOR and took < FAST_S
    assert tiktoken.load.read_file is reader and list(fresh.iterdir()) == []
    assert tokenizer._loaded == {"o200k_base": None}
    assert timed("openai/gpt-4o-mini")[0] == FLOOR and tokenizer._loaded == {"o200k_base": None}


def test_a_model_tiktoken_does_not_know_keeps_the_built_in_estimate(fresh: Path) -> None:
    assert estimate_tokens(TEXT, "claude-sonnet-4-5") == estimate_tokens(TEXT, None) == FLOOR
    assert tokenizer._loaded == {}  # no encoding was even looked for


def test_a_cached_encoding_counts_and_the_estimate_is_never_below_either(fresh: Path, bytes_encoding: bytes) -> None:
    """The tiny encoding's file in tiktoken's cache (under its URL's key, passing its hash check): it counts each
    UTF-8 byte, above the built-in floor, so the estimate is its count; a provider prefix finds it too. Text the
    floor counts higher (a short word per token) keeps the floor."""
    cache_file(fresh, BYTES_URL).write_bytes(bytes_encoding)
    assert estimate_tokens(TEXT, BYTES_MODEL) == len(TEXT.encode()) > FLOOR
    assert estimate_tokens(TEXT, f"openai/{BYTES_MODEL}") == len(TEXT.encode())
    assert estimate_tokens("a b c", BYTES_MODEL) == 5 and count_tokens("a b c") == 3  # 5 bytes: 5 tokens
    assert tokenizer._loaded[BYTES] is not None


def test_the_same_encoding_not_cached_is_refused_before_any_download(fresh: Path, bytes_encoding: bytes) -> None:
    """The cache is empty: tiktoken would fetch BYTES_URL; the load is refused inside tiktoken's reader (no
    connection), the built-in estimate is given, tiktoken's reader is its own again, and once the file is cached
    a new process (here: the memory of the refusal forgotten) counts with it."""
    reader = tiktoken.load.read_file
    estimate, took = timed(BYTES_MODEL)
    assert estimate == FLOOR and took < FAST_S and tokenizer._loaded == {BYTES: None}
    assert tiktoken.load.read_file is reader and list(fresh.iterdir()) == []
    cache_file(fresh, BYTES_URL).write_bytes(bytes_encoding)
    assert estimate_tokens(TEXT, BYTES_MODEL) == FLOOR  # this process tried once: it does not try again
    tokenizer._loaded.clear()
    assert estimate_tokens(TEXT, BYTES_MODEL) == len(TEXT.encode())
