"""Device profiles, the virtual clock and (later) cut planning: pure Python, no torch/flwr."""
