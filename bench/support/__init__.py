"""Helpers of the benchmarks in bench/: the worker app, the harness, reports, py-spy, chaos parts and what-if patches.

Nothing here is a benchmark; every file directly in bench/ is one.
"""
