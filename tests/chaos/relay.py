"""`python -m tests.chaos.relay --republish-after S --rewake-after S`: the outbox relay of the chaos app.

`oncelery relay` with the chaos runner's settings, built on the public `oncelery.Relay` because the command has
no option for the waker's `rewake_after` (a wake marked but never sent is sent again only after it; 300 s by
default, longer than a whole `ci` run): the runner kills the relay between a wake's mark and its send, and the
run must then wake within the run's time. Everything else is as `oncelery relay --interval 0.2
--sweep-interval off --retention off` runs it: the same rounds (`Relay.serve`), stopped by SIGTERM after the
round in hand, the same start line (which the runner waits for) and the same logs.
"""

from __future__ import annotations

import argparse
import logging
import os
import signal
import sys
import threading
from typing import Any

from oncelery import Relay


def main(argv: list[str] | None = None) -> int:
    """Serve relay rounds on the chaos app until SIGTERM or SIGINT."""
    p = argparse.ArgumentParser(prog="python -m tests.chaos.relay", description=__doc__.split("\n\n", 1)[0])
    p.add_argument("--interval", type=float, default=0.2)
    p.add_argument("--republish-after", type=float, required=True)
    p.add_argument("--rewake-after", type=float, required=True)
    args = p.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="[%(asctime)s: %(levelname)s/%(name)s] %(message)s")
    from tests.chaos.jobs import app

    url = os.environ["ONCELERY_DATABASE_URL"]
    relay = Relay(app, url, republish_after=args.republish_after, sweep_interval=None, rewake_after=args.rewake_after)
    stop = threading.Event()

    def _stop(_signum: int, _frame: Any) -> None:
        stop.set()  # finish the round in hand, then exit

    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, _stop)
    print("relay: publishing the outbox of the chaos database (SIGTERM stops)", flush=True)
    total = relay.serve(stop, args.interval, None)
    print(f"relay stopped: {vars(total)}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
