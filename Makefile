# `make test` sets up .venv (first run only), lints, and runs the whole suite, slow end-to-end tests included.
.PHONY: test test-fast lint docs

test:
	./scripts/bootstrap.sh
	.venv/bin/python -m ruff check .
	.venv/bin/python -m pytest -q --durations=40 tests

test-fast:
	./scripts/bootstrap.sh
	.venv/bin/python -m ruff check .
	.venv/bin/python -m pytest -q -m "not slow" tests

lint:
	./scripts/bootstrap.sh
	.venv/bin/python -m ruff check .

docs:
	./scripts/bootstrap.sh
	.venv/bin/python -m megatron_rl.tools.docs_gen --write
