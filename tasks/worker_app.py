"""The Celery app of the workers `oncelery process` starts: `tasks.app`, optionally with another article lease.

`oncelery process --lease S` sets ONCELERY_PROCESS_LEASE in its worker's environment; it reaches the task
through Celery's `task_annotations` (the documented way to set a task attribute by configuration), so a
job held by a killed worker is taken over after S seconds instead of the task's default lease.
"""

from __future__ import annotations

import os

from oncelery.tasks.app import app
from oncelery.tasks.commands.producer import ENV_LEASE

ARTICLE_TASK = "oncelery.score_article"

if os.environ.get(ENV_LEASE):
    app.conf.task_annotations = {ARTICLE_TASK: {"lease": float(os.environ[ENV_LEASE])}}

__all__ = ["app"]
