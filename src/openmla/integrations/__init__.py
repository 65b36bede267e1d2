"""Adapters that plug openmla into serving engines (each installed with its own extra)."""
