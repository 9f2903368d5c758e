"""Flower strategies for split learning protocols."""
