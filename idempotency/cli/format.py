"""How every `oncelery` command prints: plain-text tables, times in UTC, and the `--json` documents.

The one table shape (`format_table`, laid out by rich), which scripts parse and docs/cli.md shows:

    key       status     created_at
    --------- ---------- -------------------
    doc:7:v1  COMPLETED  2026-01-02 03:04:05
    doc:8:v1  -          2026-01-02 03:04:06

- a header line of the column names, then a rule of ASCII dashes (one run per column), then one line per row;
  columns left-aligned, two spaces apart (a rule's run covers its column and the space after it);
- never an ANSI code, whatever the output is (a terminal, a pipe, Click's CliRunner), and only ASCII besides
  the data: a pipe into a script or a file reads the same text a terminal shows;
- no cell wrapped, cut or folded, however wide the table: an id or key is always whole on its line;
- None shows as "-"; statuses as their value; datetimes as `YYYY-MM-DD HH:MM:SS` in UTC; no trailing spaces;
- a cell's text is printed as it is: `[bold]` or `:smile:` in data is never read as rich markup or emoji, and
  wide characters (CJK) are measured by the cells they take, so the columns after them stay aligned. Only tabs
  (expanded to spaces) and the control characters that move a terminal's cursor (carriage return, backspace,
  vertical tab, form feed, bell: rich drops them) differ; a cell with line breaks takes as many lines.

The one `--json` shape (docs/cli.md): exactly one JSON object on stdout, indented, keys sorted, every key always
present (`null` for no value), times ISO 8601 in UTC, statuses as their strings; a command about several
records lists them under a plural key (`runs`, `letters`, `replayed`) with `count`, how many it lists, beside it.
"""

from __future__ import annotations

import io
import json
from collections.abc import Callable, Sequence
from datetime import UTC, datetime
from decimal import Decimal
from typing import Any, TypeVar

import click
from rich.box import Box
from rich.console import Console
from rich.table import Table
from rich.text import Text

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


# The header rule of rich's SIMPLE_HEAD, in ASCII dashes: a pipe with a non-UTF-8 encoding prints it, and `grep
# -- '---'` still finds it. Only the third line (the rule under the header) draws anything.
_HEADER_RULE = Box("    \n    \n -  \n    \n    \n    \n    \n    \n", ascii=True)


def format_table(headers: Sequence[str], rows: Sequence[Sequence[Any]]) -> str:
    """Return `rows` under `headers` as the plain-text table above: no ANSI, no cell cut or wrapped, None as "-"."""
    cells = [[_cell(v) for v in row] for row in rows]
    table = Table(box=_HEADER_RULE, show_edge=False, pad_edge=False, padding=(0, 1, 0, 0), header_style="none")
    for header in headers:
        # no_wrap + overflow "ignore" never wrap, fold or add an ellipsis; the console's width below then leaves
        # nothing for "ignore" to cut.
        table.add_column(Text(header), no_wrap=True, overflow="ignore")
    for row in cells:
        # Text: data is never read as markup or emoji. Tabs expanded first: rich measures a tab as no width but
        # renders it as spaces, so "ignore" would cut what follows it.
        table.add_row(*(Text(value.expandtabs()) for value in row))
    out = io.StringIO()
    # Not a terminal and no colour system: never an ANSI code, whatever stdout is. Its width bounds the table's
    # from above (a cell takes at most 2 columns per character, plus a separator each), so nothing is cut.
    console = Console(
        file=out,
        width=_width_bound([list(headers), *cells]),
        force_terminal=False,
        force_jupyter=False,
        color_system=None,
        no_color=True,
        markup=False,
        emoji=False,
        highlight=False,
        soft_wrap=False,
    )
    console.print(table)
    return "\n".join(line.rstrip() for line in out.getvalue().splitlines())


def _width_bound(lines: Sequence[Sequence[str]]) -> int:
    widest = [max(len(line[i].expandtabs()) for line in lines) for i in range(len(lines[0]))]
    return max(80, sum(2 * width + 1 for width in widest))


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
