"""User-facing errors.

Every mistake a user can make in a config, a path or a checkpoint ends in a :class:`ConfigError`. The ``pl-fed``
entry point catches it and prints exactly one line (``error: <message>``) with a non-zero exit status, never a
traceback. Messages name the parameter, the value received and what is allowed.
"""

from __future__ import annotations

from typing import Any

__all__ = ["ConfigError", "DataNotFoundError", "CheckpointError", "check"]


class ConfigError(ValueError):
    """A configuration value, path or input that the user can fix."""


class DataNotFoundError(ConfigError):
    """A dataset is missing locally and cannot be downloaded; the message says how to get it."""


class CheckpointError(ConfigError):
    """A checkpoint is unreadable, corrupted or belongs to another configuration."""


def check(condition: bool, param: str, value: Any, allowed: str) -> None:
    """Raise :class:`ConfigError` with the project's one-line format unless ``condition`` holds.

    Args:
        condition: what must hold.
        param: the dotted config name of the parameter (e.g. ``"data.alpha"``).
        value: the value received.
        allowed: a short description of what is allowed (e.g. ``"a number > 0"``).

    Example:
        >>> check(0.5 > 0, "data.alpha", 0.5, "a number > 0")
        >>> check(-1 > 0, "data.alpha", -1, "a number > 0")
        Traceback (most recent call last):
        ...
        pl_fedsparse.errors.ConfigError: data.alpha=-1 is invalid: expected a number > 0
    """
    if not condition:
        raise ConfigError(f"{param}={value!r} is invalid: expected {allowed}")
