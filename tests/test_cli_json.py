"""One `--json` shape for every command, `--jsonl` for the old lines, and `oncelery --help` in sections.

Every `--json` prints exactly one JSON object: records under a plural key with `count` beside it, every key
present, times ISO 8601 in UTC (docs/cli.md). `dlq list --jsonl` keeps the JSON Lines `dlq list --json`
printed before. The console script's help lists the demo's commands apart from the operations.
"""

from __future__ import annotations

import json
import re
from typing import Any

from click.testing import CliRunner

from oncelery.cli import oncelery as oncelery_cli
from oncelery.tasks.commands import main as console_script
from tests.test_cli_publish_refusal import dead_letter

ISO_UTC = re.compile(r"^\d{4}-\d\d-\d\dT\d\d:\d\d:\d\d(\.\d+)?\+00:00$")
# The keys of a letter in `dlq list --jsonl` (as `--json` printed them before), and what `--json` adds.
LETTER_KEYS = {
    "id",
    "run_id",
    "task",
    "tenant",
    "key",
    "reason",
    "error",
    "attempts",
    "first_failed_at",
    "last_failed_at",
    "replayed_at",
    "replays",
    "run_status",
}
REPLAY_KEYS = {"replay", "replay_error"}
# What the `dlq show --json` letter adds to those (the message stays redacted without --show-payload).
SHOW_KEYS = {"traceback", "message"}


def document(db_url: str, *args: str) -> dict[str, Any]:
    """Run `oncelery --database-url URL ARGS... --json`; check it printed one JSON object, and return it."""
    done = CliRunner().invoke(oncelery_cli, ["--database-url", db_url, *args, "--json"], catch_exceptions=False)
    assert done.exit_code == 0, done.output
    parsed = json.loads(done.stdout)  # the whole output is one document (json.loads refuses a second)
    assert isinstance(parsed, dict), parsed
    assert done.stdout.startswith("{\n"), done.stdout[:80]  # indented, as every --json
    return parsed


def records(doc: dict[str, Any], plural: str) -> list[dict[str, Any]]:
    """The records a document lists under `plural`, checked against its `count`."""
    assert doc["count"] == len(doc[plural]), doc
    return list(doc[plural])


def test_every_json_is_one_document_of_the_documented_shape(db_url: str) -> None:
    """runs list/show, dlq list/show, costs and outcomes print one object each; lists sit under a plural key with
    `count`; letters carry `replay`; times are ISO 8601 UTC; `dlq list --jsonl` gives the old lines."""
    letter = dead_letter(db_url, "shape-1")

    (run,) = records(document(db_url, "runs", "list"), "runs")
    assert (run["key"], run["status"]) == ("shape-1", "DEAD") and ISO_UTC.match(run["created_at"]), run
    (shown_run,) = records(document(db_url, "runs", "show", "shape-1"), "runs")
    assert shown_run["id"] == run["id"] and shown_run["steps"] == []

    (listed,) = records(document(db_url, "dlq", "list"), "letters")
    assert set(listed) == LETTER_KEYS | REPLAY_KEYS, set(listed) ^ (LETTER_KEYS | REPLAY_KEYS)
    assert (listed["id"], listed["replay"], listed["replayed_at"]) == (letter, None, None)
    assert ISO_UTC.match(listed["last_failed_at"]), listed
    (shown,) = records(document(db_url, "dlq", "show", "shape-1"), "letters")
    assert set(shown) == LETTER_KEYS | REPLAY_KEYS | SHOW_KEYS
    assert shown["message"].startswith("<kept to replay it") and "Traceback" in shown["traceback"]

    assert records(document(db_url, "costs"), "lines") == []  # no model call yet: count 0

    counted = document(db_url, "outcomes")
    assert counted["total"] == 0 and set(counted) == {"task", "tenant", "outcomes", "total"}

    # --jsonl: one compact object per line, the keys `dlq list --json` printed before (times as Python's str).
    old = CliRunner().invoke(oncelery_cli, ["--database-url", db_url, "dlq", "list", "--jsonl"])
    assert old.exit_code == 0, old.output
    (line,) = old.stdout.splitlines()
    assert set(json.loads(line)) == LETTER_KEYS and json.loads(line)["id"] == letter
    both = CliRunner().invoke(oncelery_cli, ["--database-url", db_url, "dlq", "list", "--json", "--jsonl"])
    assert both.exit_code == 2 and "choose one" in both.output


def test_help_lists_the_demo_apart_from_the_operations() -> None:
    """`oncelery --help`: sections in order (runs, operations, the demo), each command in exactly one; the
    framework's own group (`celery -A proj oncelery`) has no demo section."""
    done = CliRunner().invoke(console_script, ["--help"])
    assert done.exit_code == 0, done.output
    sections: dict[str, list[str]] = {}
    current = None
    for line in done.output.splitlines():
        if line and not line.startswith(" ") and line.endswith(":"):
            current = line[:-1]
            sections[current] = []
        elif current is not None and line.startswith("  ") and not line.startswith("   "):
            sections[current].append(line.split()[0])
    titles = [t for t in sections if t not in ("Usage", "Options")]
    assert titles == [
        "Schema and runs",
        "Operations (publish, dead letters, retention, metrics)",
        "The demo (embedded default: no servers)",
    ], titles
    assert sections["The demo (embedded default: no servers)"] == ["demo", "process"]
    assert {"relay", "dlq", "purge"} <= set(sections[titles[1]]) and {"db", "runs"} <= set(sections[titles[0]])
    listed = [name for title in titles for name in sections[title]]
    assert sorted(listed) == sorted(console_script.commands), listed
    framework = CliRunner().invoke(oncelery_cli, ["--help"])
    assert "process" not in framework.output and "The demo" not in framework.output


def test_process_takes_a_file_or_the_sample() -> None:
    """`process` needs exactly one of FILE and --sample (a usage error, exit 2, before anything is sent)."""
    for argv in (["process"], ["process", "--sample", __file__]):
        done = CliRunner().invoke(console_script, argv)
        assert done.exit_code == 2 and "--sample" in done.output, done.output
