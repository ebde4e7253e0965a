"""Helpers for testing code that uses aiodist (and for aiodist's own tests)."""
