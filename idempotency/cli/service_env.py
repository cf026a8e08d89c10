"""The start guard of the deploy/bin scripts: the environment a service starts with, or one line saying why not.

    python -m oncelery.cli.service_env [--require VAR]... [--secret VAR]... -- COMMAND [ARG]...

Every deploy/bin script runs itself through it once (docker-compose.yml starts each service with one). It
then execs COMMAND, so the service stays PID 1 of its container and gets `docker stop`'s SIGTERM, with:

- every secret setting (oncelery.settings.SECRET_SETTINGS), every model provider's key (PROVIDER_KEY_SETTINGS:
  OPENAI_API_KEY, ANTHROPIC_API_KEY, AZURE_OPENAI_API_KEY ...), each name in $ONCELERY_EXTRA_SECRETS (an app's
  own secrets, separated by spaces or commas) and each --secret read from VAR_FILE when that is set
  (oncelery.settings_files: THE rule, the same a worker started any other way follows), and exported as VAR with
  VAR_FILE removed, so Flower, a provider's SDK or any other program that reads VAR alone sees the value;
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
from oncelery.settings import ENV_EXTRA_SECRETS, PROVIDER_KEY_SETTINGS, SECRET_SETTINGS
from oncelery.settings_files import FILE_SUFFIX, env_value

__all__ = [
    "CHECKED",
    "PLACEHOLDER",
    "extra_secrets",
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
    names = [*SECRET_SETTINGS, *PROVIDER_KEY_SETTINGS, *extra_secrets(environ), *secrets, *required]
    for name in dict.fromkeys(names):
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


def extra_secrets(environ: Mapping[str, str]) -> list[str]:
    """The names $ONCELERY_EXTRA_SECRETS lists (spaces or commas between them), or ConfigurationError for one
    that is not a variable's name."""
    names = environ.get(ENV_EXTRA_SECRETS, "").replace(",", " ").split()
    for name in names:
        # A name is spliced into VAR_FILE and exported: refuse what no shell could have set (a typo, a value).
        if not name.isidentifier() or not name.isascii():
            raise ConfigurationError(
                f"{ENV_EXTRA_SECRETS} lists {name!r}, not a variable's name: give names like MISTRAL_API_KEY",
                setting=ENV_EXTRA_SECRETS,
            )
    return names


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
