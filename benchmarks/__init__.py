"""Benchmarks: numbers, not tests (``python -m benchmarks NAME``), and their dated results.

Not installed with the package: they run from a checkout, beside the code they measure.
"""
