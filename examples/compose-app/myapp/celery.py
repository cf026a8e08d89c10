"""The app the stack runs with ONCELERY_CELERY_APP=myapp.celery:app: configured from the environment.

`oncelery.celeryconfig` reads ONCELERY_BROKER_URL, ONCELERY_RESULT_BACKEND and ONCELERY_DATABASE_URL (or each
from its *_FILE), which docker-compose.yml gives every service, with Oncelery's delivery defaults (late acks,
prefetch 1, JSON only) and task events for Flower.
"""

from celery import Celery

app = Celery("myapp", include=["myapp.tasks"])
app.config_from_object("oncelery.celeryconfig")
# Your models' prices (USD per 1M tokens), so `oncelery costs` and budgets show money: check your provider's.
app.conf.oncelery_prices = {"gpt-5-mini": {"input": 0.25, "output": 2.00}}
