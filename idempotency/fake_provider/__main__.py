"""`python -m oncelery.fake_provider [--port N] [--knobs JSON]`: a fake provider as a process (stopped by SIGTERM)."""

from __future__ import annotations

import argparse
import contextlib
import json
import signal
import sys
from typing import Any

from oncelery.fake_provider.server import serve
from oncelery.fake_provider.state import KnobError, Knobs


def main(argv: list[str] | None = None) -> int:
    """Parse the options, then serve until SIGTERM or SIGINT; the first line on stdout is the URL."""
    parser = argparse.ArgumentParser(prog="python -m oncelery.fake_provider", description=__doc__)
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=0, help="0: a free port (printed)")
    parser.add_argument("--knobs", default="{}", help="initial knobs as JSON, e.g. '{\"generation_s\": 0.5}'")
    args = parser.parse_args(argv)
    knobs = Knobs()
    try:
        knobs.update(json.loads(args.knobs))
    except (ValueError, KnobError) as exc:
        parser.error(f"--knobs: {exc}")

    def stop(*_: Any) -> None:
        raise KeyboardInterrupt

    signal.signal(signal.SIGTERM, stop)
    with contextlib.suppress(KeyboardInterrupt):
        serve(args.host, args.port, knobs, lambda url: print(url, flush=True))
    return 0


if __name__ == "__main__":
    sys.exit(main())
