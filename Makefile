.PHONY: install test lint demo bench ci

install:
	python3 -m venv .venv && . .venv/bin/activate && pip install -e '.[dev]'

test:
	. .venv/bin/activate && pytest

lint:
	. .venv/bin/activate && ruff check . && ruff format --check . && .ci/as-installed mypy && .ci/as-installed lint-imports

demo:
	. .venv/bin/activate && oncelery demo

bench:
	. .venv/bin/activate && python bench/throughput.py

ci:
	bash .ci/run
