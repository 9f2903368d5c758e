"""Flower ServerApp, the shared trunk and its gRPC data-plane service."""
