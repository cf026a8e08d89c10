"""The start guard of the deploy/bin scripts: the environment a service starts with, or one line saying why not.

    python -m oncelery.cli.service_env [--require VAR]... [--secret VAR]... -- COMMAND [ARG]...

Every deploy/bin script runs itself through it once (docker-compose.yml starts each service with one). It
then execs COMMAND, so the service stays PID 1 of its container and gets `docker stop`'s SIGTERM, with:

- every secret setting (oncelery.settings.SECRET_SETTINGS, and each --secret) read from VAR_FILE when that
  is set (oncelery.settings_files: THE rule, the same a worker started any other way follows), and exported
  as VAR with VAR_FILE removed, so Flower or any other program that reads VAR alone sees the value;
- a secret that still holds .env.example's `change-me...` placeholder refused, naming the variable;
- each --require VAR that is set neither way refused, naming it.

A refusal is one line on stderr, `<script>: <why and what to do>`, and exit code 2 (EXIT_CONFIGURATION):
compose then never starts the services that wait for this one.
"""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Iterable, Mapping, Sequence
from pathlib import Path

from oncelery.cli.context import EXIT_CONFIGURATION
from oncelery.errors import ConfigurationError, PlaceholderSecret
from oncelery.settings import SECRET_SETTINGS
from oncelery.settings_files import FILE_SUFFIX, env_value

__all__ = [
    "CHECKED",
    "PLACEHOLDER",
    "main",
    "service_environ",
]

# What every secret of .env.example starts with: a stack started from the example unedited is refused.
PLACEHOLDER = "change-me"
# Set in the environment of the command it execs: a deploy/bin script runs itself through the guard only once.
CHECKED = "ONCELERY_SERVICE_ENV_CHECKED"


def service_environ(
    environ: Mapping[str, str], required: Iterable[str] = (), secrets: Iterable[str] = ()
) -> dict[str, str]:
    """The environment to start a service with (secrets read from their files), or the ConfigurationError why not."""
    required = tuple(required)
    env = dict(environ)
    for name in dict.fromkeys([*SECRET_SETTINGS, *secrets, *required]):
        value = env_value(name, environ)
        env.pop(name + FILE_SUFFIX, None)
        if value is None:
            env.pop(name, None)  # set but empty: as unset, for this service and what it starts
            if name in required:
                raise ConfigurationError(f"set {name} (or {name}{FILE_SUFFIX}, a file holding it)", setting=name)
            continue
        if PLACEHOLDER in value.lower():
            raise PlaceholderSecret.of(name, PLACEHOLDER)
        env[name] = value
    return env


def main(argv: Sequence[str] | None = None) -> None:
    """Check the environment, then exec the command with it; on a refusal print one line and exit 2."""
    parser = argparse.ArgumentParser(prog="python -m oncelery.cli.service_env", description=__doc__.split("\n")[0])
    parser.add_argument("--require", action="append", default=[], metavar="VAR", help="A setting it needs.")
    parser.add_argument("--secret", action="append", default=[], metavar="VAR", help="One more secret setting.")
    parser.add_argument("command", nargs="+", help="The program to exec, after --.")
    args = parser.parse_args(argv)
    who = Path(args.command[0]).name
    try:
        env = service_environ(os.environ, args.require, args.secret)
    except ConfigurationError as exc:
        print(f"{who}: {' '.join(str(exc).split())}", file=sys.stderr)
        raise SystemExit(EXIT_CONFIGURATION) from None
    env[CHECKED] = "1"
    os.execvpe(args.command[0], args.command, env)


if __name__ == "__main__":
    main()
