# `make test` sets up .venv (first run only) and runs the whole suite, slow end-to-end tests included.
.PHONY: test test-fast docs

test:
	./scripts/bootstrap.sh
	.venv/bin/python -m pytest -q tests

test-fast:
	./scripts/bootstrap.sh
	.venv/bin/python -m pytest -q -m "not slow" tests

docs:
	./scripts/bootstrap.sh
	.venv/bin/python -m megatron_rl.tools.docs_gen --write
