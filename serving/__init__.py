"""Helpers to run the stock sglang server with the mossvl_ascend plugin: start, wait for health, stop by PID."""
