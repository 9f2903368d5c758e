"""Experiment entry points: the Hydra run, benchmarks."""
