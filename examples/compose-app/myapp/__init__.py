"""An example of your own app on Oncelery's compose stack (docs/compose.md): a Celery app and one job."""
