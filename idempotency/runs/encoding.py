"""How values stand in what a run stores: canonical JSON, keyed digests, and the text of a key (one-to-one).

Keys mean one thing (G9). Every value substituted into a key template is encoded, and two values give the same
text if and only if they are equal after this normalisation: strings are NFC (also inside lists and dicts; a
dict's keys are kept as given), integral floats are ints (3 == 3.0), tuples are lists. The encoding:

- a string is percent-encoded (every character but A-Z a-z 0-9 "-" "." "_"; "%" and "~" too, so no string's
  text starts with "~"), and a string that would read as an integer has its first character encoded as well
  ("42" -> "%342", so it never shares a key with the number 42);
- an int, or an integral float, is written in decimal ("-3");
- anything else (bool, None, other floats, lists, dicts) is "~" + its canonical JSON, percent-encoded.

A lone surrogate has no UTF-8 form: it is refused (InvalidKey in a key, PayloadNotJSON in a fingerprint).

Digests are keyed (`keyed_digest`, HMAC-SHA256), so a low-entropy argument (a PIN, a yes/no) cannot be recovered
from what is stored without the secret. `sha256_hex` and `encode_key_value_before` give the forms stored before
(a legacy lookup's, never a new run's).
"""

from __future__ import annotations

import hashlib
import hmac
import json
import math
import re
import unicodedata
from typing import Any
from urllib.parse import quote

from oncelery.errors import InvalidKey, PayloadNotJSON
from oncelery.settings import MAX_KEY_LENGTH

__all__ = [
    "canonical_json",
    "encode_key_value",
    "encode_key_value_before",
    "encoded_differently_before",
    "jsonable",
    "keyed_digest",
    "printable",
    "refuse_unencodable",
    "sha256_hex",
]


def canonical_json(value: Any) -> str:
    """Encode `value` as canonical JSON (sorted keys, no spaces, no NaN), raising PayloadNotJSON if it can't."""
    try:
        return json.dumps(value, sort_keys=True, separators=(",", ":"), ensure_ascii=False, allow_nan=False)
    except (TypeError, ValueError) as exc:
        raise PayloadNotJSON(
            f"Cannot fingerprint a non-JSON value ({exc}); pass JSON types (str, int, float, bool, None, "
            f"list, dict) as task arguments",
        ) from exc


def sha256_hex(text: str) -> str:
    """Return the hex sha256 of `text` encoded as UTF-8: the unkeyed form of runs stored before keyed digests."""
    return hashlib.sha256(refuse_unencodable(text)).hexdigest()


def keyed_digest(secret: bytes, text: str, purpose: str = "") -> str:
    """Return hex HMAC-SHA256 of `text` under `secret` (for `purpose`): the one digest of anything a run stores.

    Without the secret, no guess can be checked against it. Raises PayloadNotJSON for text with no UTF-8 form.
    """
    message = refuse_unencodable(f"{purpose}\0{text}" if purpose else text)
    return hmac.digest(secret, message, "sha256").hex()


def refuse_unencodable(text: str) -> bytes:
    """Return `text` as UTF-8, or raise PayloadNotJSON naming the lone surrogate that has no UTF-8 form."""
    try:
        return text.encode("utf-8")
    except UnicodeEncodeError as exc:
        raise PayloadNotJSON(
            f"Cannot fingerprint text with a lone surrogate ({exc.object[exc.start : exc.end]!r} at {exc.start}); "
            f"send valid Unicode text (the producer's JSON must not split a surrogate pair)",
        ) from exc


def printable(text: str) -> str:
    """Return `text` as ASCII with backslash escapes: safe in a message and a log line, whatever it holds."""
    return text.encode("utf-8", "backslashreplace").decode("ascii", "backslashreplace")


# Characters a substituted string keeps as they are; every other one is percent-encoded ("%" included, so the
# encoding is one-to-one). quote() always keeps "~" too: it is encoded after, since "~" marks a JSON value.
_KEY_SAFE = "-._"
# The text of an int: a string that would read the same has its first character percent-encoded.
_INTEGER_TEXT = re.compile(r"-?(?:0|[1-9][0-9]*)")


def encode_key_value(value: Any) -> str:
    """Return `value` as it stands in a key: two values give one text iff they are equal once normalised."""
    if isinstance(value, str):
        return _encode_text(value)
    if isinstance(value, int) and not isinstance(value, bool):
        return _decimal(value)
    if isinstance(value, float) and math.isfinite(value) and value.is_integer():
        return _decimal(int(value))
    return "~" + _quoted(canonical_json(jsonable(value)))


def _encode_text(text: str) -> str:
    encoded = _quoted(unicodedata.normalize("NFC", text)).replace("~", "%7E")
    if _INTEGER_TEXT.fullmatch(encoded):
        return f"%{ord(encoded[0]):02X}{encoded[1:]}"  # "42" -> "%342": never the int 42's "42"
    return encoded


def _decimal(value: int) -> str:
    try:
        return str(value)
    except ValueError as exc:  # past Python's int-to-text limit (4,300 digits): far past any key's length
        raise InvalidKey(
            f"An integer of {value.bit_length()} bits cannot be part of a key (the limit is {MAX_KEY_LENGTH} "
            f"characters): hash it, or pass a shorter value",
            key="",
        ) from exc


def _quoted(text: str) -> str:
    try:
        return quote(text, safe=_KEY_SAFE)
    except UnicodeEncodeError as exc:
        raise InvalidKey(
            f"A key value contains a lone surrogate {exc.object[exc.start : exc.end]!r} (it has no UTF-8 form): "
            f"send valid Unicode text",
            key=printable(text),
        ) from exc


def encode_key_value_before(value: Any) -> str:
    """The text the encoding before injective keys gave `value` (a legacy lookup's; see the module's doc)."""
    if isinstance(value, str):
        return quote(unicodedata.normalize("NFC", value), safe=_KEY_SAFE)
    return encode_key_value(value)  # only strings changed


def encoded_differently_before(value: Any) -> bool:
    """Whether `value` had other text before injective keys (a cheap test: only such strings changed)."""
    return isinstance(value, str) and ("~" in value or _INTEGER_TEXT.fullmatch(value) is not None)


def jsonable(value: Any) -> Any:
    """Return `value` in its one JSON form (the normalisation of keys and fingerprints alike)."""
    # One JSON form per value, so a retried message fingerprints as the first one did: tuples are lists,
    # strings are NFC (café typed two ways is one value), integral floats are ints (3.0 is version 3). A dict's
    # keys are kept as given: normalising them could merge two keys, and two payloads, into one.
    if isinstance(value, str):
        return unicodedata.normalize("NFC", value)
    if isinstance(value, float) and math.isfinite(value) and value.is_integer():
        return int(value)
    if isinstance(value, tuple):
        return [jsonable(v) for v in value]
    if isinstance(value, list):
        return [jsonable(v) for v in value]
    if isinstance(value, dict):
        return {k: jsonable(v) for k, v in value.items()}
    return value
