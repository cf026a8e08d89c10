"""Settings whose value is in a file: VAR_FILE names a file that holds VAR's value (Docker and Kubernetes secrets).

THE rule, written once for every reader (the settings, celeryconfig.py, the deploy/bin scripts' start guard),
as the official postgres image's `file_env` does it:

    VAR set (non-empty), VAR_FILE unset   -> VAR
    VAR_FILE set, VAR unset               -> the file's content, trailing newlines removed (`echo pw > f` works)
    both set                              -> SettingFileError: which one wins would be a guess
    the file unreadable, or empty         -> SettingFileError naming VAR_FILE and the path
    neither                               -> None (the caller's default, or its "set VAR" error)

A file is read once per process: a secret lives as long as the engines and connections built from it, so a
rotated secret takes a restart, as it would with VAR. This module imports nothing of Oncelery but its errors,
so `oncelery.settings` can read through it.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from pathlib import Path

from oncelery.errors import SettingFileError

__all__ = [
    "FILE_SUFFIX",
    "env_value",
]

FILE_SUFFIX = "_FILE"

_read: dict[str, str] = {}  # path -> content, read once per process


def env_value(name: str, environ: Mapping[str, str] | None = None) -> str | None:
    """VAR's value from the environment or from the file VAR_FILE names (never both), or None if neither is set."""
    env = os.environ if environ is None else environ
    value = env.get(name, "")
    path = env.get(name + FILE_SUFFIX, "")
    if value and path:
        raise SettingFileError.both_set(name)
    if not path:
        return value or None
    if path not in _read:
        try:
            content = Path(path).read_text(encoding="utf-8").rstrip("\r\n")
        except (OSError, UnicodeDecodeError) as exc:
            raise SettingFileError.unreadable(name, path, exc) from exc
        if not content.strip():
            raise SettingFileError.empty(name, path)
        _read[path] = content
    return _read[path]
