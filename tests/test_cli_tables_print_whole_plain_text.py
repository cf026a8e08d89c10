"""Every `oncelery` table (format_table, laid out by rich) is the same plain text wherever it goes: no ANSI code
to a pipe, a terminal or Click's CliRunner, even with FORCE_COLOR and a 40-column COLUMNS; no cell cut, wrapped or
folded however wide; None as "-"; a header line a script splits into the column names; wide characters aligned."""

from __future__ import annotations

import os
import re
import subprocess
from pathlib import Path

import pytest
from click.testing import CliRunner

from oncelery.cli import format_table
from oncelery.cli import oncelery as oncelery_cli
from oncelery.runs.claims import RunStore
from oncelery.runs.keys import Identity
from tests.services import ONCELERY, clean_env

CLI_TIMEOUT = 60.0
LONG = "oncelery." + "t" * 191  # 200 characters: a task name far wider than any terminal
HEADERS = ["id", "task", "key", "status", "token", "attempts", "owner", "lease_expires_at", "updated_at"]
RULE = re.compile(r"^-+( -+)*$")
# What a terminal-minded library reads to decide on colour and width: none of it may change the table.
COLOUR_ENV = {"FORCE_COLOR": "1", "CLICOLOR_FORCE": "1", "TTY_COMPATIBLE": "1", "TERM": "xterm-256color"}


def start(line: str, word: str) -> int:
    """Where the whitespace-delimited `word` starts in `line`."""
    found = re.search(rf"(?<!\S){re.escape(word)}(?!\S)", line)
    assert found is not None, (word, line)
    return found.start()


def check_table(text: str, headers: list[str], task: str) -> list[str]:
    """Assert `text` starts with the plain table of `headers` and has one whole row whose second cell is `task`;
    return that row's cells (split on whitespace)."""
    assert "\x1b" not in text, repr(text[:300])
    lines = text.replace("\r\n", "\n").splitlines()
    assert lines[0].split() == headers, lines[0]
    assert RULE.match(lines[1]), lines[1]
    assert len(lines[1].split()) == len(headers)
    assert all(line == line.rstrip() for line in lines)
    rows = [line for line in lines[2:] if line.split()[1:2] == [task]]
    assert len(rows) == 1, text
    return rows[0].split()


def test_a_wide_table_is_whole_plain_and_shows_none_as_a_dash() -> None:
    """A 200-character cell is printed whole on its line, None as "-", markup-looking data and a tab's neighbours
    as they are; the rule under the header is one run of dashes per column."""
    rows = [[1, LONG, "[bold]x[/] :smile:", None], [2, "b", None, 3], [3, "tab\there", "-", "end"]]
    text = format_table(["id", "name", "note", "n"], rows)
    lines = text.splitlines()
    assert "\x1b" not in text
    assert lines[0].split() == ["id", "name", "note", "n"]
    assert RULE.match(lines[1]) and len(lines[1].split()) == 4
    assert lines[2].split() == ["1", LONG, "[bold]x[/]", ":smile:", "-"]
    assert lines[3].split() == ["2", "b", "-", "3"]
    assert lines[4].split() == ["3", "tab", "here", "-", "end"]  # a tab is spaces, and nothing after it is lost
    # Left-aligned: each column starts where its header does.
    for header, cell in (("name", LONG), ("note", "[bold]x[/]"), ("n", "-")):
        assert start(lines[2], cell) == start(lines[0], header), (header, lines)


def test_wide_characters_keep_the_columns_aligned() -> None:
    """A cell of CJK characters (two terminal columns each) does not push the columns after it out of line."""
    lines = format_table(["name", "status"], [["日本語", "ok"], ["abcdefg", "done"]]).splitlines()
    assert lines[1].split() == ["-" * 8, "-" * 6]

    def column(line: str, text: str) -> int:  # where `text` starts, in terminal columns
        before = line[: line.index(text)]
        return sum(2 if ord(ch) > 0x2E7F else 1 for ch in before)

    assert column(lines[2], "ok") == column(lines[3], "done") == column(lines[0], "status")


def test_an_empty_table_is_its_header_and_rule() -> None:
    """No rows: the header line and the rule, so a script still finds the columns."""
    assert format_table(["a", "bb"], []).splitlines() == ["a  bb", "-- --"]


@pytest.fixture
def long_run_db(tmp_path: Path) -> str:
    """A migrated SQLite database holding one completed run of a task with a 200-character name."""
    url = f"sqlite:///{tmp_path / 'tables.db'}"
    upgraded = subprocess.run(
        [ONCELERY, "--database-url", url, "db", "upgrade"],
        cwd=tmp_path,
        env=clean_env(),
        capture_output=True,
        text=True,
        timeout=CLI_TIMEOUT,
    )
    assert upgraded.returncode == 0, upgraded.stderr
    store = RunStore(url)
    claimed = store.claim(LONG, Identity("tables:k1", "f" * 64, {"a": "0" * 64}), lease=30)
    assert claimed.claim is not None
    store.complete(claimed.claim, {"ok": True})
    return url


def test_runs_list_is_plain_and_whole_in_a_pipe_a_terminal_and_clirunner(long_run_db: str, tmp_path: Path) -> None:
    """`oncelery runs list`, its stdout a pipe and then a pseudo-terminal (with FORCE_COLOR and COLUMNS=40), and
    through CliRunner, prints the same table: no ANSI, the 200-character task name whole, None as "-"."""
    argv = [ONCELERY, "--database-url", long_run_db, "runs", "list"]
    env = clean_env(COLUMNS="40", **COLOUR_ENV)
    piped = subprocess.run(argv, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=CLI_TIMEOUT)
    assert piped.returncode == 0, piped.stderr
    row = check_table(piped.stdout, HEADERS, LONG)
    assert row[2:5] == ["tables:k1", "COMPLETED", "1"] and "-" in row[5:]

    # A terminal: the console script's stdout is a pty (rich decides on colour and width per stream).
    leader, follower = os.openpty()
    try:
        done = subprocess.run(argv, cwd=tmp_path, env=env, stdout=follower, stderr=subprocess.PIPE, timeout=CLI_TIMEOUT)
        os.close(follower)
        follower = -1
        chunks = []
        while True:
            try:
                chunk = os.read(leader, 65536)
            except OSError:  # EIO: the writer has gone and everything it wrote was read (Linux)
                break
            if not chunk:
                break
            chunks.append(chunk)
    finally:
        if follower != -1:
            os.close(follower)
        os.close(leader)
    assert done.returncode == 0, done.stderr
    assert check_table(b"".join(chunks).decode(), HEADERS, LONG) == row

    invoked = CliRunner().invoke(oncelery_cli, ["--database-url", long_run_db, "runs", "list"], color=True, env=env)
    assert invoked.exit_code == 0, invoked.output
    assert check_table(invoked.output, HEADERS, LONG) == row
