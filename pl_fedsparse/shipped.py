"""The configs shipped with the package, by name.

The top-level ``configs/*.yaml`` of the repository are installed with the package (``pl_fedsparse/configs/`` inside
the wheel, mapped from ``configs/`` by ``setup.py``; an editable install or a source checkout reads the repository's
``configs/`` directly), so ``pl-fed fit --config quickstart.yaml`` works from any directory.

Resolution of one ``--config VALUE`` (:func:`resolve_config`), in order:

1. ``VALUE`` is an existing path: used as it is (a real path always wins);
2. ``VALUE`` is a bare name without ``.yaml`` and ``VALUE.yaml`` exists in the working directory: that file;
3. ``VALUE`` or ``VALUE.yaml`` is the name of a shipped config: the shipped file (its absolute path, so that paths
   inside it resolve as they would from the repository);
4. anything else that looks like a file name is a one-line :class:`~pl_fedsparse.errors.ConfigError` listing the
   closest shipped names; a YAML string (``--config '{trainer: {num_rounds: 2}}'``) is left to jsonargparse.

:func:`rewrite_config_args` applies this to every ``--config``/``-c`` value of a ``pl-fed`` command line before
jsonargparse parses it, so several ``--config`` flags, ``--print_config``, ``--help`` and resuming from a run's
``config.yaml`` behave exactly as before.
"""

from __future__ import annotations

import difflib
import os
import re
import shutil
import textwrap
from pathlib import Path

from pl_fedsparse.errors import ConfigError

__all__ = ["config_dir", "describe", "format_listing", "resolve_config", "rewrite_config_args", "shipped_configs"]

SUFFIX = ".yaml"
_PROG = "pl-fed"
_CONFIG_FLAGS = ("--config", "-c")
# a plain file name (no directory part): what a user types for a shipped config
_NAME = re.compile(r"^[\w.+-]+$")


def config_dir() -> Path:
    """The folder of the shipped configs.

    ``pl_fedsparse/configs`` of an installed wheel; in a source checkout or an editable install (no such folder next
    to the package) the repository's top-level ``configs/``.
    """
    package = Path(__file__).resolve().parent
    installed = package / "configs"
    if installed.is_dir():
        return installed
    checkout = package.parent
    if (checkout / "pyproject.toml").is_file() and (checkout / "configs").is_dir():
        return checkout / "configs"
    return installed


def shipped_configs() -> dict[str, Path]:
    """Every shipped config, ``{"quickstart.yaml": Path(...), ...}``, sorted by name."""
    folder = config_dir()
    if not folder.is_dir():
        return {}
    return {p.name: p for p in sorted(folder.glob(f"*{SUFFIX}")) if p.is_file()}


def describe(path: Path) -> str:
    """The description of a config: its leading comment lines, joined into one paragraph.

    The comment lines before the first line that is not a comment (blank lines before them are skipped), without
    the ``#``, whitespace collapsed; the example command (``#   pl-fed fit --config configs/X.yaml ...``: the listing
    says how to run a config by name) is left out. A config that does not start with a comment has no description.

    Example:
        >>> import tempfile
        >>> p = Path(tempfile.mkdtemp()) / "x.yaml"
        >>> _ = p.write_text("\\n# FedAvg on a toy task,\\n# in one minute.\\n#   pl-fed fit --config x.yaml\\n"
        ...                  "seed_everything: 0\\n# not this\\n")
        >>> describe(p)
        'FedAvg on a toy task, in one minute.'
    """
    words: list[str] = []
    try:
        with open(path, encoding="utf-8") as f:
            for line in f:
                text = line.strip()
                if not text.startswith("#"):
                    if text or words:
                        break
                    continue  # a blank line before the comments
                body = text[1:].strip()
                if not body.startswith(f"{_PROG} "):  # the example command
                    words += body.split()
    except (OSError, UnicodeDecodeError):
        pass
    return " ".join(words)


def format_listing(configs: dict[str, Path] | None = None, width: int | None = None) -> str:
    """The text of ``pl-fed configs``: every shipped config with its whole description (:func:`describe`), wrapped
    to ``width`` columns.

    The descriptions start in one column, after the longest name, where that leaves at least 60 columns for them,
    else 4 columns in, on the line after the name; their other lines are indented to that column. A word longer than
    the line (a file name) is not broken.

    Args:
        configs: ``{name: path}`` (default: :func:`shipped_configs`).
        width: the line width (default: the terminal's, ``$COLUMNS`` where set; at least 40).

    Example:
        >>> import tempfile
        >>> d = Path(tempfile.mkdtemp())
        >>> _ = (d / "a.yaml").write_text("# One two three four five six.\\nx: 1\\n")
        >>> print(format_listing({"a.yaml": d / "a.yaml"}, width=40), end="")
        a.yaml
            One two three four five six.
    """
    configs = shipped_configs() if configs is None else configs
    if width is None:
        width = shutil.get_terminal_size((100, 24)).columns - 1
    width = max(width, 40)
    names = max((len(n) for n in configs), default=0)
    # the description column: after the longest name, unless that leaves less than 60 columns for the text (then
    # every description starts on the line after its name)
    column = names + 2 if width - (names + 2) >= 60 else 4
    lines: list[str] = []
    for name, path in configs.items():
        text = describe(path)
        if not text:
            lines.append(name)
            continue
        body = textwrap.wrap(text, width - column, break_long_words=False, break_on_hyphens=False)
        if len(name) + 2 <= column:
            lines.append(f"{name:<{column}}{body[0]}")
            body = body[1:]
        else:
            lines.append(name)
        lines += [" " * column + b for b in body]
    return "".join(line.rstrip() + "\n" for line in lines)


def _close_matches(value: str, names: list[str]) -> list[str]:
    """Up to three shipped names closest to ``value`` (compared with and without ``.yaml``)."""
    stem = value.removesuffix(SUFFIX)
    stems = {n.removesuffix(SUFFIX): n for n in names}
    found = difflib.get_close_matches(stem.lower(), list(stems), n=3, cutoff=0.5)
    if not found:  # a fragment ("dmpfl"): names that contain it
        found = [s for s in stems if stem.lower() in s][:3]
    return [stems[s] for s in found]


def resolve_config(value: str, cwd: str | os.PathLike | None = None) -> str:
    """The path ``--config value`` stands for (see the module docstring).

    Args:
        value: what followed ``--config``.
        cwd: the folder relative paths are taken from (default: the working directory).

    Returns:
        ``value`` itself, unchanged, when it is an existing path or not a file name at all (a YAML string); the
        local ``value.yaml``; or the absolute path of the shipped config.

    Raises:
        ConfigError: ``value`` names no file and no shipped config (the message lists close matches).
    """
    base = Path(os.getcwd() if cwd is None else cwd)
    if os.path.exists(base / value):
        return value
    bare = _NAME.match(value) is not None
    if bare and not value.endswith(SUFFIX) and (base / (value + SUFFIX)).is_file():
        return value + SUFFIX
    shipped = shipped_configs()
    if bare:
        for name in (value, value + SUFFIX):
            if name in shipped:
                return str(shipped[name])
    elif not _looks_like_path(value):
        return value  # YAML content: jsonargparse parses it
    name = os.path.basename(value.rstrip("/\\"))
    hint = _close_matches(name, list(shipped))
    what = "no such file" + (" and no shipped config of that name" if bare else "")
    if not bare and name in shipped:
        allowed = f"an existing file or a shipped config by its bare name: --config {name}"
    elif hint:
        allowed = f"an existing file or a shipped config name; close matches: {', '.join(hint)}"
    else:
        allowed = "an existing file or a shipped config name"
    raise ConfigError(f"config={value!r} is invalid: {what}; expected {allowed} (`pl-fed configs` lists the "
                      f"{len(shipped)} shipped configs)")


def _looks_like_path(value: str) -> bool:
    """A value with a directory part that is not YAML content (no newline, braces, brackets or ``key: value``)."""
    return not any(c in value for c in "\n{}[]") and ": " not in value and value.strip() == value and value != ""


def rewrite_config_args(args: list[str], cwd: str | os.PathLike | None = None) -> list[str]:
    """``args`` with every ``--config VALUE``, ``--config=VALUE`` and ``-c VALUE`` resolved by
    :func:`resolve_config`; nothing else changes.

    Example:
        >>> rewrite_config_args(["fit", "--trainer.num_rounds", "2"])
        ['fit', '--trainer.num_rounds', '2']
    """
    out: list[str] = []
    i = 0
    while i < len(args):
        arg = args[i]
        if arg == "--":  # everything after it is positional
            out.extend(args[i:])
            break
        if arg in _CONFIG_FLAGS and i + 1 < len(args):
            out += [arg, resolve_config(args[i + 1], cwd)]
            i += 2
            continue
        if arg.startswith("--config="):
            out.append("--config=" + resolve_config(arg[len("--config="):], cwd))
        else:
            out.append(arg)
        i += 1
    return out
