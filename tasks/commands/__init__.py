"""The `oncelery` console script: the framework's commands, plus `demo` and `process` (the main job)."""

from __future__ import annotations

from oncelery.cli import DEMO, build_group
from oncelery.tasks.commands.demo import demo
from oncelery.tasks.commands.process import process

main = build_group()
main.add_command(demo, section=DEMO)
main.add_command(process, section=DEMO)

__all__ = ["main"]
