"""Oncelery's AI jobs and pipelines, built on the `idempotency` framework."""
