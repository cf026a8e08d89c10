"""The `oncelery` command line (an entry point: `oncelery`, and `celery -A proj oncelery` through
`celery.commands`).

Reading order: `group` (the group, `db upgrade`, `outcomes`), `context` (how a command finds its database and
app), `format` (tables and JSON), then one module per command family: `runs`, `ops` (relay, purge), `dlq`,
`costs`, `cache`, `metrics`, `flower` (Flower with the Runs section; its pages in `runs_pages`, templates in
`templates/`). This module re-exports what the entry points and an application's own commands need.
"""

from oncelery.cli.group import (
    DEMO,
    EXIT_CONFIGURATION,
    INSPECT,
    OPERATE,
    OnceleryGroup,
    build_group,
    check_services,
    echo_json,
    format_table,
    oncelery,
    refuse_unread_broker,
    resolve_database_url,
)

__all__ = [
    "DEMO",
    "EXIT_CONFIGURATION",
    "INSPECT",
    "OPERATE",
    "OnceleryGroup",
    "build_group",
    "check_services",
    "echo_json",
    "format_table",
    "oncelery",
    "refuse_unread_broker",
    "resolve_database_url",
]
