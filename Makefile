# The test lanes, one short command each. `make test` runs them all, in the order CI does:
# README's test command (and .ci/run) builds a fresh virtual environment, then runs it.
# The unit lane builds the docs too (tests/unit/test_docs.py). Timings: CONTRIBUTING.md.
PYTEST = python -m pytest

.PHONY: test bytecode web chromium lint unit integration serial docs

test: bytecode web lint unit integration serial

# The README's test command installs with --no-compile, and CI sets PYTHONDONTWRITEBYTECODE:
# without this, each of the hundreds of processes the tests start (ClientApps, Ray workers,
# SuperNodes) compiles torch, Flower and Ray from source again (4.5 of the 6.5 s a ClientApp
# spends importing). Test folders are skipped; one file in torch is Python 3.12 only.
bytecode:  ## compile the environment's Python once, on every core
	python -m compileall -q -j 0 -x '/tests?/|/test_|/testing/_internal/' \
		"$$(python -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')" \
		clients server splitlearn strategies protocols experiments benchmarks

# The web device runtime (web/) and what its browser test drives: npm installs the locked
# dependencies (again only when web/package-lock.json changes), esbuild bundles
# web/dist/device.js, and Debian's Chromium is installed if there is none (as root, as CI
# runs; Playwright cannot download a browser of its own here).
web: web/dist/device.js chromium  ## the web runtime's bundle and Chromium (the web test)

web/node_modules/.package-lock.json: web/package.json web/package-lock.json
	npm ci --prefix web --no-audit --no-fund --loglevel=error

web/dist/device.js: web/node_modules/.package-lock.json web/build.mjs web/tsconfig.json $(wildcard web/src/*.ts)
	npm run build --prefix web --silent

chromium:
	@command -v chromium >/dev/null || { apt-get update -qq && DEBIAN_FRONTEND=noninteractive \
		apt-get install -y -qq --no-install-recommends chromium >/dev/null; }

lint:  ## style and docstrings (ruff), the layers (import-linter)
	ruff check .
	lint-imports

docs:  ## the docs site, every link and reference checked (build/site)
	NO_MKDOCS_2_WARNING=1 mkdocs build --strict --quiet --site-dir build/site

unit:  ## fast, in-process tests on two workers
	$(PYTEST) tests/unit -n 2

integration:  ## one process each: the shipped apps, gRPC, worker processes
	$(PYTEST) tests/integration -m "not serial and not must_show" -n 2

serial: web  ## Flower's engines, flwr run, a Ray cluster, Chromium; deployment files in own lanes
	$(PYTEST) tests/integration -m "serial and not must_show" -n 3 --dist loadgroup --durations=10
