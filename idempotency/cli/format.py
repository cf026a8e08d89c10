"""How every `oncelery` command prints: plain-text tables, times in UTC, and the `--json` documents.

The one `--json` shape (docs/cli.md): exactly one JSON object on stdout, indented, keys sorted, every key always
present (`null` for no value), times ISO 8601 in UTC, statuses as their strings; a command about several
records lists them under a plural key (`runs`, `letters`, `replayed`) with `count`, how many it lists, beside it.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Sequence
from datetime import UTC, datetime
from decimal import Decimal
from typing import Any, TypeVar

import click

from oncelery.models import Outcome, RunStatus

__all__ = [
    "JSON_HELP",
    "echo_json",
    "format_table",
    "json_option",
    "to_json",
]

JSON_HELP = "Print one JSON document (for scripts; its shape: docs/cli.md) instead of text."
_F = TypeVar("_F", bound=Callable[..., Any])


def format_table(headers: Sequence[str], rows: Sequence[Sequence[Any]]) -> str:
    """Return `rows` as a left-aligned plain-text table under `headers` (None shows as "-")."""
    cells = [[_cell(v) for v in row] for row in rows]
    widths = [max([len(h), *(len(r[i]) for r in cells)]) for i, h in enumerate(headers)]
    lines = [headers, ["-" * w for w in widths], *cells]
    return "\n".join("  ".join(v.ljust(w) for v, w in zip(line, widths, strict=True)).rstrip() for line in lines)


def _cell(value: Any) -> str:
    if value is None:
        return "-"
    if isinstance(value, RunStatus | Outcome):
        return str(value.value)
    if isinstance(value, datetime):
        return _utc(value).strftime("%Y-%m-%d %H:%M:%S")
    return str(value)


def _utc(value: datetime) -> datetime:
    # Both dialects store UTC; PostgreSQL hands it back in the session's time zone, SQLite without one.
    return value.astimezone(UTC) if value.tzinfo is not None else value.replace(tzinfo=UTC)


def to_json(value: Any) -> Any:
    """Return `value` as JSON-ready data: datetimes as ISO 8601 UTC, statuses and Decimals as strings, recursively."""
    if isinstance(value, RunStatus | Outcome):
        return value.value
    if isinstance(value, datetime):
        return _utc(value).isoformat()
    if isinstance(value, Decimal):  # money: exact, as a string ("12.500000"), never a float
        return str(value)
    if isinstance(value, dict):
        return {str(k): to_json(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [to_json(v) for v in value]
    return value


def echo_json(document: dict[str, Any]) -> None:
    """Print `document` as the indented, key-sorted JSON every `--json` option prints."""
    click.echo(json.dumps(to_json(document), indent=2, sort_keys=True, ensure_ascii=False))


def json_option(help_text: str = JSON_HELP) -> Callable[[_F], _F]:
    """The `--json` flag every command that prints for scripts takes (its value: the `as_json` parameter)."""
    return click.option("--json", "as_json", is_flag=True, help=help_text)
