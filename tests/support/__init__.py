"""Shared test builders and oracles (imported by test modules; no test module imports another)."""
