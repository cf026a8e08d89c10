"""The call layer: a model call as a durable object (write-ahead intents, provider adapters, limits, batches).

It sits between `delivery` (which runs a step) and `runs` (which stores it), and imports no Celery: a call's
protocol is the same whoever delivers the job.

Reading order: `call` (the model-call protocol and its recovery table), `call_step` (what one call is given, what
it may cost and which limiters admit it, how a finished call ends). The fake provider that tests and the demo call
is a room of its own, `oncelery.fake_provider`.
"""
