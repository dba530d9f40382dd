"""Atrium package."""
