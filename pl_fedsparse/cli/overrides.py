"""One callback's argument from the command line: ``--trainer.callbacks.NAME.ARG VALUE`` (the class name or full
class path of a callback in ``trainer.callbacks``) or ``--trainer.callbacks.INDEX.ARG VALUE`` (0-based position).

The overrides are taken out of the command line (:func:`split_callback_overrides`), the rest is parsed, and the
overrides are applied to the resulting ``trainer.callbacks`` (:func:`apply_callback_overrides`; values read as
YAML), which is then parsed again so that jsonargparse checks the new values exactly as config values. An unknown
name, an index out of range, a name two callbacks share, an argument the class does not take or a value of the wrong
type is one ``error: ...`` line naming the option and listing the configured callbacks.
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from copy import deepcopy
from dataclasses import dataclass
from typing import Any

import lightning.pytorch as pl
import yaml

from pl_fedsparse.errors import (
    ConfigError,
)

__all__ = ["CallbackOverride", "apply_callback_overrides", "split_callback_overrides"]


# ---------------------------------------------------------------------------------------------- callback overrides
#: ``--trainer.callbacks.<selector>.<arg>[=value]``; a first part in this set is jsonargparse's own syntax
_CALLBACK_OPTION = re.compile(r"^--trainer\.callbacks\.(?P<rest>[^=]+)(?:=(?P<value>.*))?$", flags=re.DOTALL)

_JSONARGPARSE_KEYS = {"help", "class_path", "init_args", "dict_kwargs"}

_SCIENTIFIC = re.compile(r"^[-+]?(\d+\.?\d*|\.\d+)[eE][-+]?\d+$")


@dataclass(frozen=True)
class CallbackOverride:
    """One ``--trainer.callbacks.<selector>.<arg> VALUE`` of the command line.

    Args:
        option: the option as typed, without the value (named in errors).
        path: what follows ``--trainer.callbacks.``: ``"DualMask.iterations"``, ``"0.iterations"`` or
            ``"pl_fedsparse.callbacks.DualMask.iterations"``.
        value: the value, as typed (parsed as YAML when applied).
    """

    option: str
    path: str
    value: str


def split_callback_overrides(args: Sequence[str]) -> tuple[list[str], list[CallbackOverride]]:
    """Take the per-callback overrides out of a command line.

    ``--trainer.callbacks.NAME.ARG VALUE`` (``NAME``: a configured callback's class name or class path) and
    ``--trainer.callbacks.INDEX.ARG VALUE`` (0-based position in ``trainer.callbacks``), also with ``=VALUE``;
    ``--trainer.callbacks.ARG VALUE`` (jsonargparse's own form: the last callback), ``--trainer.callbacks.help``
    and everything after ``--`` are left as they are.

    Example:
        >>> rest, found = split_callback_overrides(["fit", "--trainer.callbacks.DualMask.iterations", "2",
        ...                                         "--trainer.callbacks.1.shifts=[0.5]", "--trainer.num_rounds", "3"])
        >>> rest, [(o.path, o.value) for o in found]
        (['fit', '--trainer.num_rounds', '3'], [('DualMask.iterations', '2'), ('1.shifts', '[0.5]')])

    Raises:
        ConfigError: an override without a value.
    """
    rest: list[str] = []
    found: list[CallbackOverride] = []
    i = 0
    while i < len(args):
        arg = args[i]
        if arg == "--":
            rest.extend(args[i:])
            break
        m = _CALLBACK_OPTION.match(arg)
        if m is None or "." not in m["rest"] or m["rest"].split(".", 1)[0] in _JSONARGPARSE_KEYS:
            rest.append(arg)
            i += 1
            continue
        option = arg.split("=", 1)[0]
        if m["value"] is not None:
            value, i = m["value"], i + 1
        elif i + 1 < len(args) and not args[i + 1].startswith("--"):
            value, i = args[i + 1], i + 2
        else:
            raise ConfigError(f"{option} expects a value: {option} VALUE")
        found.append(CallbackOverride(option, m["rest"], value))
    return rest, found


def _yaml_value(text: str) -> Any:
    """A command-line value as YAML (``1e-3`` is a float, as jsonargparse reads it)."""
    if _SCIENTIFIC.match(text.strip()):
        return float(text)
    try:
        return yaml.safe_load(text)
    except yaml.YAMLError:
        return text


def _listing(entries: Sequence[dict[str, Any]]) -> str:
    return ", ".join(f"{i}: {str(e.get('class_path', '?')).rsplit('.', 1)[-1]}" for i, e in enumerate(entries)) \
        or "none"


def apply_callback_overrides(entries: list[dict[str, Any]], overrides: Sequence[CallbackOverride]
                             ) -> list[dict[str, Any]]:
    """``entries`` (``trainer.callbacks`` as ``{"class_path", "init_args"}`` dicts) with ``overrides`` applied, in
    order; ``entries`` is not changed.

    Raises:
        ConfigError: an override names no configured callback, an index out of range, a class name that two
            callbacks share (the index is then required) or an argument the class does not take; the message names
            the option and lists the configured callbacks.
    """
    out = deepcopy(entries)
    touched: dict[int, list[tuple[CallbackOverride, str]]] = {}
    for o in overrides:
        configured = f"trainer.callbacks is [{_listing(out)}]"
        head, _, key = o.path.partition(".")
        if head.isdigit():
            idx = int(head)
            if idx >= len(out):
                raise ConfigError(f"{o.option}: no callback at index {idx}; {configured} (indices from 0)")
        else:
            paths = [str(e.get("class_path", "")) for e in out]
            full = [i for i, p in enumerate(paths) if o.path.startswith(p + ".")]
            if full:
                idx = full[0]
                key = o.path[len(paths[idx]) + 1:]
            else:
                named = [i for i, p in enumerate(paths) if p.rsplit(".", 1)[-1] == head]
                if not named:
                    raise ConfigError(f"{o.option}: no configured callback is named {head!r}; {configured} (address "
                                      f"one by class name or index, e.g. --trainer.callbacks.0.{key})")
                if len(named) > 1:
                    raise ConfigError(f"{o.option}: {len(named)} callbacks are named {head!r} (indices "
                                      f"{', '.join(map(str, named))}): address one by index, e.g. "
                                      f"--trainer.callbacks.{named[0]}.{key}; {configured}")
                idx = named[0]
        init = out[idx].get("init_args")
        init = {} if init is None else init
        out[idx]["init_args"] = init
        name = str(out[idx].get("class_path", "?")).rsplit(".", 1)[-1]
        keys = key.split(".")
        if not key or any(not k for k in keys):
            raise ConfigError(f"{o.option}: expected --trainer.callbacks.{head}.ARG")
        if keys[0] not in init:
            raise ConfigError(f"{o.option}: {name} (trainer.callbacks[{idx}]) has no argument {keys[0]!r}; its "
                              f"arguments: {', '.join(init) or 'none'}")
        node = init
        for k in keys[:-1]:
            if not isinstance(node.get(k), dict):
                node[k] = {}
            node = node[k]
        node[keys[-1]] = _yaml_value(o.value)
        touched.setdefault(idx, []).append((o, keys[0]))
    for idx, done in touched.items():
        _check_callback_types(out[idx], done)
    return out


def _check_callback_types(entry: dict[str, Any], done: Sequence[tuple[CallbackOverride, str]]) -> None:
    """jsonargparse's type check of one overridden callback, with its complaint in one line naming the option (the
    full command line is checked again when parsed: this only gives the message)."""
    from jsonargparse import ArgumentParser

    parser = ArgumentParser(exit_on_error=False)
    parser.add_subclass_arguments(pl.Callback, "callback", required=True)
    try:
        parser.parse_object({"callback": entry})
    except Exception as e:  # noqa: BLE001 - jsonargparse raises several types; the final parse reports the rest
        text = str(e)
        keys = list(re.finditer(r'Parser key "([^"]+)":\n', text))
        inner = keys[-1] if len(keys) > 1 else None
        option, value = done[-1][0].option, done[-1][0].value
        if inner is None:
            return  # not about one argument: left to the final parse
        for o, key in done:
            if key == inner.group(1):
                option, value = o.option, o.value
        lines = text[inner.end():].splitlines()
        depth = len(lines[0]) - len(lines[0].lstrip()) if lines else 0
        why = []
        for line in lines:
            if line.strip() and len(line) - len(line.lstrip()) < depth:
                break
            why.append(line.strip())
        raise ConfigError(f"{option}={value} is invalid: {' '.join(w for w in why if w)}") from None
