"""Per-protocol client steps: what a device does with one batch (see :mod:`.base`)."""
