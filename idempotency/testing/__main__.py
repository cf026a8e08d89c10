"""`python -m oncelery.testing <app path> worker [options]`: a kit worker subprocess (see `worker.main`)."""

from oncelery.testing.worker import main

# Guarded: importing the module (tools that import every module of a package, the wheel's room check) runs nothing.
if __name__ == "__main__":
    main()
