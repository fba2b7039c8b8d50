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
``config.yaml`` behave exactly as before. Each config *file* it resolves is read once and must hold a YAML mapping
(``trainer:``, ``model:``, ``data:``, ...): an empty file, a list or a bare string is a one-line
:class:`~pl_fedsparse.errors.ConfigError` naming the file (:func:`check_config_file`).
"""

from __future__ import annotations

import difflib
import os
import re
import shutil
import textwrap
from pathlib import Path

import yaml

from pl_fedsparse.errors import ConfigError

__all__ = ["check_config_file", "config_dir", "describe", "format_listing", "resolve_config", "rewrite_config_args",
           "shipped_configs"]

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


_EXPECTED_CONFIG = "a YAML mapping of sections (trainer:, model:, data:, ...)"


def check_config_file(value: str, resolved: str, cwd: str | os.PathLike | None = None) -> None:
    """Refuse a ``--config`` file that is not a non-empty YAML mapping, in one line naming it.

    Only files are read (``resolved`` as :func:`resolve_config` returned it); YAML content given on the command line
    and folders are left to jsonargparse. jsonargparse reports such files as ``Unexpected config: ...`` without
    naming them.

    Args:
        value: what followed ``--config`` (named in the message).
        resolved: the path it stands for.
        cwd: the folder relative paths are taken from (default: the working directory).

    Raises:
        ConfigError: the file is unreadable, not valid YAML, empty (or only comments), or holds something other
            than a mapping (a list, a string, a number, ``null``).
    """
    path = Path(os.getcwd() if cwd is None else cwd) / resolved
    if not path.is_file():
        return
    shown = repr(value) if value == resolved else f"{value!r} ({resolved})"
    head = f"--config={shown} is invalid: expected {_EXPECTED_CONFIG}"
    try:
        text = path.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as e:
        why = e.strerror if isinstance(e, OSError) and e.strerror else type(e).__name__
        raise ConfigError(f"{head}; the file cannot be read as UTF-8 text ({why})") from None
    try:
        data = yaml.safe_load(text)
    except yaml.YAMLError as e:
        mark = getattr(e, "problem_mark", None)
        where = f"line {mark.line + 1}, column {mark.column + 1}: " if mark is not None else ""
        problem = getattr(e, "problem", None) or " ".join(str(e).split())
        raise ConfigError(f"{head}; the file is not valid YAML ({where}{problem})") from None
    if data is None:
        content = [x for x in text.splitlines() if x.strip() and not x.lstrip().startswith(("#", "---", "..."))]
        what = "holds null" if content else "is empty" + (" (only comments)" if text.strip() else "")
        raise ConfigError(f"{head}; the file {what}")
    if not isinstance(data, dict):
        kind = {list: "a list", str: "a string", bool: "a boolean", int: "a number", float: "a number"}.get(
            type(data), type(data).__name__)
        preview = " ".join(text.split())
        preview = preview if len(preview) <= 40 else preview[:37] + "..."
        raise ConfigError(f"{head}; the file holds {kind}: {preview}")


def rewrite_config_args(args: list[str], cwd: str | os.PathLike | None = None) -> list[str]:
    """``args`` with every ``--config VALUE``, ``--config=VALUE`` and ``-c VALUE`` resolved by
    :func:`resolve_config` and, when it is a file, checked by :func:`check_config_file`; nothing else changes.

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
            out += [arg, _resolve_and_check(args[i + 1], cwd)]
            i += 2
            continue
        if arg.startswith("--config="):
            out.append("--config=" + _resolve_and_check(arg[len("--config="):], cwd))
        else:
            out.append(arg)
        i += 1
    return out


def _resolve_and_check(value: str, cwd: str | os.PathLike | None) -> str:
    """:func:`resolve_config`, then :func:`check_config_file` on the result."""
    resolved = resolve_config(value, cwd)
    check_config_file(value, resolved, cwd)
    return resolved
