# The test lanes, one short command each. `make test` runs them all, in the order CI does:
# README's test command (and .ci/run) builds a fresh virtual environment, then runs it.
# The unit lane builds the docs too (tests/unit/test_docs.py). Timings: CONTRIBUTING.md.
PYTEST = python -m pytest

.PHONY: test lint unit integration serial docs

test: lint unit integration serial

lint:  ## style and docstrings (ruff), the layers (import-linter)
	ruff check .
	lint-imports

docs:  ## the docs site, every link and reference checked (build/site)
	NO_MKDOCS_2_WARNING=1 mkdocs build --strict --quiet --site-dir build/site

unit:  ## fast, in-process tests on two workers
	$(PYTEST) tests/unit -n 2

integration:  ## one process each: the shipped apps, gRPC, worker processes
	$(PYTEST) tests/integration -m "not serial" -n 2

serial:  ## Flower's engines, flwr run, a Ray cluster; each deployment file in a lane of its own
	$(PYTEST) tests/integration -m serial -n 3 --dist loadgroup --durations=10
