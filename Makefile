# The test lanes, one short command each. `make test` runs them all, in the order CI does:
# README's test command (and .ci/run) builds a fresh virtual environment, then runs it.
# The unit lane builds the docs too (tests/unit/test_docs.py). Timings: CONTRIBUTING.md.
PYTEST = python -m pytest

.PHONY: test bytecode lint unit integration serial docs

test: bytecode lint unit integration serial

# The README's test command installs with --no-compile, and CI sets PYTHONDONTWRITEBYTECODE:
# without this, each of the hundreds of processes the tests start (ClientApps, Ray workers,
# SuperNodes) compiles torch, Flower and Ray from source again (4.5 of the 6.5 s a ClientApp
# spends importing). Test folders are skipped; one file in torch is Python 3.12 only.
bytecode:  ## compile the environment's Python once, on every core
	python -m compileall -q -j 0 -x '/tests?/|/test_|/testing/_internal/' \
		"$$(python -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')" \
		clients server splitlearn strategies protocols experiments benchmarks

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
