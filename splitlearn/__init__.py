"""Federated split learning: models, splitting, data, wire format, tracking."""
