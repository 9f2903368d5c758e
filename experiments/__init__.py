"""Entry points: the Hydra run, the in-process runner, attacks, comparisons, certificates."""
