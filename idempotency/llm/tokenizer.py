"""OpenAI's tokenizer (tiktoken, the `oncelery[tokens]` extra) where it is at hand WITHOUT a download.

`oncelery.llm.tokens.estimate_tokens(text, model)` takes the larger of its built-in conservative estimate and
tiktoken's exact count, for a model tiktoken knows (OpenAI's), only when:
- tiktoken is importable (imported on the first estimate for a model, never when this module is imported);
- the model's encoding loads from files already on the machine. tiktoken fetches its BPE file from the internet on
  first use and caches it ($TIKTOKEN_CACHE_DIR, else <tmp>/data-gym-cache). While an encoding loads here, tiktoken's
  file reader refuses every URL for this thread (other threads read as usual), so only a cached encoding is used:
  a worker never waits on a download in the delivery path, and a machine without network never tries one.

Anything else (not installed, a model tiktoken does not know, an encoding not cached, a tiktoken whose reader is
not where this expects it, any error of tiktoken's) leaves the built-in estimate, and the outcome is kept per
encoding for the process: one attempt each. Why the built-in estimate is enough by default: a reservation (of a
budget or a limiter) is settled from the provider's reported usage, so only its conservativeness matters.
"""

from __future__ import annotations

import functools
import importlib
import logging
import threading
from types import ModuleType
from typing import Any

__all__ = ["tiktoken_count"]

logger = logging.getLogger("oncelery.llm")

_loaded: dict[str, Any] = {}  # encoding name -> tiktoken Encoding, or None: not at hand in this process
_load_lock = threading.Lock()
_offline = threading.local()  # .on while this thread loads an encoding: its downloads are refused


class _DownloadRefused(OSError):
    """Raised inside tiktoken when it would download an encoding while Oncelery loads one (never escapes here)."""


def tiktoken_count(text: str, model: str) -> int | None:
    """Return tiktoken's exact count of `text` for `model`, or None where it cannot be had offline (see above)."""
    encoding = _encoding(model)
    return None if encoding is None else len(encoding.encode_ordinary(text))


@functools.cache
def _tiktoken() -> ModuleType | None:
    try:
        tiktoken = importlib.import_module("tiktoken")
        importlib.import_module("tiktoken.model")  # the model -> encoding table (an attribute of tiktoken once loaded)
    except ImportError:
        return None
    return tiktoken


def _encoding(model: str) -> Any:
    tiktoken = _tiktoken()
    if tiktoken is None:
        return None
    try:
        # A provider prefix ("openai/gpt-4o", "azure/gpt-4o") names the same OpenAI model.
        name = tiktoken.model.encoding_name_for_model(model.rsplit("/", 1)[-1])
    except (KeyError, AttributeError):
        return None  # not an OpenAI model: its provider's tokenizer is not tiktoken's
    if name not in _loaded:
        with _load_lock:
            if name not in _loaded:
                _loaded[name] = _load_offline(tiktoken, name)
    return _loaded[name]


def _load_offline(tiktoken: ModuleType, name: str) -> Any:
    """The encoding `name` from tiktoken's cache, or None: tiktoken's reader refuses URLs (this thread's) meanwhile."""
    try:
        files: Any = importlib.import_module("tiktoken.load")
    except ImportError:
        return None
    read_file = getattr(files, "read_file", None)
    if not callable(read_file):
        return None  # a tiktoken that reads another way: it could not be kept from downloading

    def cached_only(blobpath: str) -> bytes:
        if getattr(_offline, "on", False) and "://" in blobpath:
            raise _DownloadRefused(f"{blobpath} is not in tiktoken's cache, and Oncelery never downloads it")
        return bytes(read_file(blobpath))

    files.read_file = cached_only
    _offline.on = True
    try:
        encoding = tiktoken.get_encoding(name)
    except Exception as exc:  # not cached, corrupt, or any of tiktoken's own errors: the built-in estimate
        logger.info("token estimates use the built-in estimate, not tiktoken's %s: %s", name, exc)
        return None
    finally:
        _offline.on = False
        files.read_file = read_file
    logger.info("token estimates of %s models count with tiktoken (from its cache)", name)
    return encoding
