"""``python -m benchmarks NAME [overrides ...]``: see :mod:`benchmarks.cli`."""

from benchmarks.cli import main

main()
