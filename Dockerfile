# syntax=docker/dockerfile:1
# Oncelery's runtime image: the package built once as a wheel, installed into a slim image, run as a
# non-root user. Every service of docker-compose.yml runs one of the deploy/bin scripts from this image;
# no source bind mount and no `pip install` at container start.

ARG PYTHON_IMAGE=python:3.11-slim

# -- builder: wheels for oncelery[postgres] and Flower, and every dependency ------------------------------
FROM ${PYTHON_IMAGE} AS builder
WORKDIR /src
# Only what the wheel is built from, so an edit to docs or tests does not invalidate this layer.
# idempotency/celeryconfig.py is a link to ./celeryconfig.py: both are copied.
COPY pyproject.toml README.md celeryconfig.py ./
COPY idempotency/ idempotency/
COPY models/ models/
COPY tasks/ tasks/
RUN --mount=type=cache,target=/root/.cache/pip \
    pip wheel --wheel-dir /wheels '.[postgres]' 'flower>=2.0,<3'

# -- runtime ---------------------------------------------------------------------------------------------
FROM ${PYTHON_IMAGE} AS runtime
ENV PYTHONDONTWRITEBYTECODE=1 \
    PYTHONUNBUFFERED=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1 \
    ONCELERY_DATA_DIR=/var/lib/oncelery \
    ONCELERY_HEARTBEAT_FILE=/tmp/oncelery-heartbeat
# ONCELERY_HEARTBEAT_FILE: touched by a worker on each Celery heartbeat and by the relay after each round, in the
# container's own /tmp (never a shared volume: each replica's file is its own); `oncelery-healthcheck heartbeat`
# reads its age. docker-compose.yml gives each service its health check (deploy/bin/oncelery-healthcheck).
# A fixed uid/gid, so a volume's ownership is the same on every host.
RUN groupadd --system --gid 10001 oncelery \
    && useradd --system --uid 10001 --gid oncelery --home-dir /var/lib/oncelery --create-home oncelery \
    && install -d -o oncelery -g oncelery -m 0700 /var/lib/oncelery/ledger-spool
# /var/lib/oncelery/ledger-spool: the worker's ledger spool, a named volume in docker-compose.yml; made here so
# the volume starts owned by oncelery (an empty mount point would be root's).
# Installed offline from the builder's wheels (a bind mount, so the wheels are not kept in a layer).
RUN --mount=type=bind,from=builder,source=/wheels,target=/wheels \
    pip install --no-cache-dir --no-index --find-links /wheels 'oncelery[postgres]' flower
COPY --chmod=0755 deploy/bin/ /usr/local/bin/
USER oncelery
WORKDIR /var/lib/oncelery
# The default command is a worker; compose gives every other service its own deploy/bin script.
CMD ["oncelery-worker"]
