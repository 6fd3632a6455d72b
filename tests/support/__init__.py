"""Shared test builders, oracles and fixtures (imported by test modules; no test module imports another)."""
