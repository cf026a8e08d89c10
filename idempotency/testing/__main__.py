"""`python -m oncelery.testing <app path> worker [options]`: a kit worker subprocess (see `worker.main`)."""

from oncelery.testing.worker import main

main()
