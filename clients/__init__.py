"""Flower ClientApp and the client-side split-learning loop."""
