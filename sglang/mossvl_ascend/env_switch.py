"""An on/off environment variable, read one way for every switch of the plugin: a value that is neither on nor off
stops start-up naming the variable, instead of being read as one of them."""

from __future__ import annotations

import os

ON = ("1", "true", "yes", "on")
OFF = ("0", "false", "no", "off")


def env_switch(name: str, default: bool) -> bool:
    """``name``'s value as a switch; unset or empty is ``default``."""
    value = os.environ.get(name, "").strip().lower()
    if value == "":
        return default
    if value in ON:
        return True
    if value in OFF:
        return False
    raise ValueError(f"{name}={value!r}: use 1 or 0")
