"""Tracing: OpenTelemetry spans and metrics that tell a real model call from a replay (the `oncelery[otel]` extra).

Reading order: `otel` (on or off, the providers, the run and step spans, key digests), `calls` (the model-call
part: which call is real, which replayed, and who records its tokens). Below the basetask room, which opens the
spans; above the call layer, whose two observation points (`llm.observe`) it watches. Imports no celery, kombu,
redis or click: an app is read by its attributes.
"""

__all__: list[str] = []  # a room: its modules are imported by their own paths
