"""``pl-fed``: the LightningCLI front end.

``pl-fed fit|validate|test --config X.yaml [--section.key value ...]``. Sections: ``trainer`` (the
:class:`~pl_fedsparse.loop.FederatedLoop`, including ``trainer.callbacks`` by ``class_path``), ``model`` (the
:class:`~pl_fedsparse.module.FederatedModule` and its ``backbone``), ``data`` (the
:class:`~pl_fedsparse.data.FederatedDataModule`), plus ``--seed_everything`` and ``--ckpt_path``.

Differences from a stock ``LightningCLI`` (see DESIGN.md §5): the "trainer" is a plain class, so it is registered
with ``add_class_arguments`` and built by :meth:`FedCLI.instantiate_trainer`; the configuration is written to the
run directory by the loop (``config.yaml``) instead of Lightning's ``SaveConfigCallback``; user errors end in one
line, never a traceback:

* a configuration error (:class:`~pl_fedsparse.errors.ConfigError`, or a parse error): ``error: <message>``, exit 2;
* an :class:`OSError` nobody else handled (permission denied, not a directory, disk full, ...):
  ``error: <path>: <problem> (<what to do>)``, exit 2;
* Ctrl-C (also inside a Lightning fit, which Lightning turns into ``sys.exit(1)``): ``interrupted: ...`` with the
  command that resumes the run from ``<run>/checkpoints/last.ckpt``, exit 130.

Configs by name: ``--config NAME.yaml`` (or ``NAME``) that names no file in the working directory is the config of
that name shipped with the package (:mod:`pl_fedsparse.shipped`; a real path always wins; an unknown name is a one-line
error listing close matches); ``pl-fed configs`` lists the shipped configs with their one-line descriptions. The
``--config`` values are resolved before jsonargparse parses the command line, so several ``--config`` flags,
``--print_config`` and resuming behave as with paths.

Seeds: ``--seed_everything N`` with ``0 <= N <= 2**32 - 1`` (the range Lightning's ``seed_everything`` and numpy
accept) seeds the global generators and is the federation seed; ``true`` draws a random seed, which is recorded in
``config.yaml``; ``false`` seeds nothing globally and the federation seed is 0. Any other value (e.g. ``-1``) is
refused with a one-line error rather than silently aliased to another seed.

Classes in the working directory (``class_path: callbacks.my_method.MyMethod`` from the project root): ``pl-fed``
does *not* put the working directory on ``sys.path`` (in front, a ``tensorboard.py`` or ``torch/`` folder there
would replace the installed package for the whole run; at the end, its folders would still join installed namespace
packages and its ``*.dist-info`` would show up in ``importlib.metadata``). Instead, for the duration of
:func:`main`, a finder at the *end* of ``sys.meta_path`` resolves a top-level module or package from the working
directory only when no installed one of that name exists; its submodules then import normally. Installed packages
always win, and nothing changes outside :func:`main`. (A process started with the ``spawn`` method does not inherit
the finder; every client fit runs in this process today.)
"""

from __future__ import annotations

import errno
import importlib
import importlib.abc
import importlib.machinery
import os
import re
import secrets
import signal
import sys
import threading
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path
from types import ModuleType
from typing import Any

import lightning.pytorch as pl
import yaml
from jsonargparse import Namespace
from lightning.fabric.utilities.seed import max_seed_value, min_seed_value, seed_everything
from lightning.pytorch.cli import LightningArgumentParser, LightningCLI

from pl_fedsparse import shipped
from pl_fedsparse.data import FederatedDataModule
from pl_fedsparse.errors import ConfigError, check
from pl_fedsparse.loop import FederatedLoop
from pl_fedsparse.module import FederatedModule

__all__ = ["FedCLI", "main", "DEFAULT_MODEL", "DEFAULT_DATA"]

#: the ``class_path`` of a ``model:`` / ``data:`` section that names none
DEFAULT_MODEL = f"{FederatedModule.__module__}.{FederatedModule.__qualname__}"
DEFAULT_DATA = "pl_fedsparse.data.FederatedDataModule"

PROG = "pl-fed"
DESCRIPTION = ("Personalized sparse federated learning with PyTorch Lightning. `pl-fed configs` lists the shipped "
               "configs; run one with `pl-fed fit --config NAME.yaml` from any directory.")
CONFIG_HELP = ("Path to a configuration file in json or yaml format, or the name of a shipped config (`pl-fed "
               "configs` lists them; a file of that name in the working directory wins).")

#: ``(subcommand, loop)`` of the run :func:`main` is executing: where an interrupted or failed run writes
_current_run: tuple[str | None, FederatedLoop] | None = None


class _OneLineErrors(LightningArgumentParser):
    """Report parse errors in one line (``error: ...``), exit status 2, no usage dump."""

    def error(self, message: str, ex: Exception | None = None) -> Any:  # type: ignore[override]
        if not self.exit_on_error:
            return super().error(message, ex)
        # jsonargparse nests the useful part last ("Parser key 'x': ... - Expected ..."); the whole of it is kept
        text = " ".join(s.strip() for s in str(message).splitlines() if s.strip())
        sys.stderr.write(f"error: {text} (see `{_help_command(self.prog)}`)\n")
        sys.exit(2)


    def dump(self, cfg: Any, *args: Any, **kwargs: Any) -> str:  # type: ignore[override]
        """jsonargparse's dump, with ``model:``/``data:`` of the default classes written without ``class_path``
        (:func:`~pl_fedsparse.reporting.canonical_config`): ``--print_config`` and ``config.yaml`` read like the
        shipped configs, and a user class keeps its ``class_path``."""
        text = super().dump(cfg, *args, **kwargs)
        fmt = kwargs.get("format", args[0] if args else "parser_mode")
        if fmt not in ("parser_mode", "yaml"):
            return text
        try:
            data = yaml.safe_load(text)
        except yaml.YAMLError:
            return text
        if not isinstance(data, dict) or not ({"model", "data"} & set(data)):
            return text
        from pl_fedsparse.reporting import canonical_config

        return yaml.safe_dump(canonical_config(data), sort_keys=False, default_flow_style=False, allow_unicode=True)


def _help_command(prog: str) -> str:
    """``pl-fed <subcommand> --help`` for a subcommand's parser (prog ``"<prog> [options] fit"``), else
    ``pl-fed --help``, whatever the program was called (``pl-fed``, ``cli.py``, ``-c``, ...)."""
    words = str(prog or "").split()
    sub = words[-1] if len(words) > 1 and words[-1] in FedCLI.subcommands() else None
    return f"{PROG} {sub} --help" if sub else f"{PROG} --help"


class FedCLI(LightningCLI):
    """LightningCLI whose trainer is a :class:`~pl_fedsparse.loop.FederatedLoop`."""

    def __init__(self, args: Any = None, run: bool = True, **kwargs: Any) -> None:
        # any LightningModule / any FederatedDataModule by class_path (LightningCLI's subclass mode); a section
        # without class_path configures the defaults, FederatedModule and FederatedDataModule (see add_core_arguments)
        kwargs.setdefault("model_class", pl.LightningModule)
        kwargs.setdefault("subclass_mode_model", True)
        kwargs.setdefault("datamodule_class", FederatedDataModule)
        kwargs.setdefault("subclass_mode_data", True)
        kwargs.setdefault("trainer_class", FederatedLoop)  # type: ignore[arg-type]
        kwargs.setdefault("save_config_callback", None)
        kwargs.setdefault("seed_everything_default", 0)
        kwargs.setdefault("parser_class", _OneLineErrors)
        kwargs.setdefault("parser_kwargs", {"prog": PROG, "description": DESCRIPTION})
        kwargs.setdefault("auto_configure_optimizers", False)
        super().__init__(args=args, run=run, **kwargs)

    def init_parser(self, **kwargs: Any) -> LightningArgumentParser:
        """LightningCLI's parser, with ``--config`` documented to take a shipped config's name too."""
        parser = super().init_parser(**kwargs)
        for action in parser._actions:
            if "--config" in action.option_strings:
                action.help = CONFIG_HELP
        return parser

    def parse_arguments(self, parser: LightningArgumentParser, args: Any) -> None:
        """Parse the command line after resolving every ``--config`` value (a path, or a shipped config's name)."""
        if args is None:
            resolved = shipped.rewrite_config_args(sys.argv[1:])
            if resolved != sys.argv[1:]:
                # what LightningCLI does with a list, without its warning about passing args *and* sys.argv
                self.config = parser.parse_args(resolved)
                return
        elif isinstance(args, (list, tuple)):
            args = shipped.rewrite_config_args([str(a) for a in args])
        super().parse_arguments(parser, args)

    def add_core_arguments_to_parser(self, parser: LightningArgumentParser) -> None:
        parser.add_class_arguments(FederatedLoop, "trainer", instantiate=False, sub_configs=True, skip={"seed"})
        parser.set_defaults({"trainer." + k: v for k, v in self.trainer_defaults.items()})
        parser.add_lightning_class_args(self._model_class, "model", subclass_mode=self.subclass_mode_model)
        parser.add_lightning_class_args(self._datamodule_class, "data", subclass_mode=self.subclass_mode_data)
        defaults = {}
        if self.subclass_mode_model:
            defaults["model"] = {"class_path": DEFAULT_MODEL}
        if self.subclass_mode_data:
            defaults["data"] = {"class_path": DEFAULT_DATA}
        parser.set_defaults(defaults)

    @staticmethod
    def subcommands() -> dict[str, set[str]]:
        return {"fit": {"model", "datamodule"}, "validate": {"model", "datamodule"}, "test": {"model", "datamodule"}}

    def _set_seed(self) -> None:
        """``seed_everything``: an int in Lightning's range, ``true`` (a random seed) or ``false`` (see the module
        docstring); the resolved value is put back into the config (and so into ``config.yaml``)."""
        seed = self._get(self.config, "seed_everything")
        if seed is False:
            return
        drawn = seed is True
        if drawn:
            seed = secrets.randbelow(max_seed_value + 1)
        check(isinstance(seed, int) and min_seed_value <= seed <= max_seed_value, "seed_everything", seed,
              f"an int in [{min_seed_value}, {max_seed_value}], true (a random seed) or false (no global seeding)")
        # "Seed set to N" only for a drawn seed: a given one is known, and the line would precede a one-line error
        seed = seed_everything(seed, workers=True, verbose=drawn)
        if self.subcommand:
            self.config[self.subcommand]["seed_everything"] = seed
        else:
            self.config["seed_everything"] = seed

    def instantiate_classes(self) -> None:
        try:
            super().instantiate_classes()
        except (ValueError, TypeError) as e:
            raise _config_error_in(e) from None

    def _parse_ckpt_path(self) -> None:
        """Our checkpoints carry no Lightning hyper-parameters; the loop loads and validates them itself."""

    def instantiate_trainer(self, **kwargs: Any) -> Any:
        global _current_run
        cfg = self._get(self.config_init, "trainer", default=Namespace())
        cfg = dict(cfg.items()) if isinstance(cfg, Namespace) else dict(cfg)
        cfg = {k: v for k, v in cfg.items() if "." not in k}
        seed = self._get(self.config, "seed_everything")
        cfg["seed"] = int(seed) if isinstance(seed, int) and not isinstance(seed, bool) else 0
        loop = FederatedLoop(**{**cfg, **kwargs})
        loop.config_text = self._config_text()
        _current_run = (self.subcommand, loop)
        return loop

    def _config_text(self) -> str:
        """The full configuration as YAML, with the resolved seed and without ``ckpt_path``."""
        parser = self._parser(self.subcommand)
        cfg = self.config.get(str(self.subcommand), self.config).clone()
        if "ckpt_path" in cfg:
            cfg["ckpt_path"] = None
        text = parser.dump(cfg, skip_none=False, skip_link_targets=False)
        data = yaml.safe_load(text)
        header = "# written by pl-fed; reproduce with: pl-fed fit --config config.yaml\n"
        return header + yaml.safe_dump(data, sort_keys=False)


_OUR_FORMAT = re.compile(r"(\S+=.+ is invalid: expected .+)$")


def _config_error_in(exc: BaseException) -> BaseException:
    """The :class:`ConfigError` (or :class:`OSError`) behind an exception jsonargparse raised while instantiating a
    class.

    jsonargparse re-raises constructor errors of nested classes (e.g. a callback in ``trainer.callbacks``) as a
    ``ValueError`` listing every type it tried; the user's mistake is the line in our own format.
    """
    seen: BaseException | None = exc
    while seen is not None:
        if isinstance(seen, (ConfigError, OSError)):
            return seen
        seen = seen.__cause__ or seen.__context__
    for line in str(exc).splitlines():
        m = _OUR_FORMAT.search(line.strip().lstrip("- ").strip())
        if m:
            return ConfigError(m.group(1))
    return exc


# ---------------------------------------------------------------------------------------------- working directory
class _WorkingDirFinder(importlib.abc.MetaPathFinder):
    """Finds top-level modules and packages in ``directory`` (appended to ``sys.meta_path``: consulted only for
    names no other finder resolves)."""

    def __init__(self, directory: str) -> None:
        self.directory = directory

    def find_spec(self, fullname: str, path: Sequence[str] | None = None,
                  target: ModuleType | None = None) -> importlib.machinery.ModuleSpec | None:
        if path is not None or "." in fullname:  # submodules are found through their package's __path__
            return None
        return importlib.machinery.PathFinder.find_spec(fullname, [self.directory])


@contextmanager
def _working_dir_importable(directory: str) -> Iterator[None]:
    """Make ``directory``'s top-level modules importable (after every installed one) while the block runs."""
    finder = _WorkingDirFinder(directory)
    importlib.invalidate_caches()  # files written just before (a new callbacks/ folder) must be seen
    sys.meta_path.append(finder)
    try:
        yield
    finally:
        if finder in sys.meta_path:
            sys.meta_path.remove(finder)


# ---------------------------------------------------------------------------------------------- messages
def _interrupted_message(run: tuple[str | None, FederatedLoop] | None) -> str:
    """What an interrupted run left behind and how to continue it."""
    subcommand, loop = run if run is not None else (None, None)
    if subcommand != "fit" or loop is None:
        return "interrupted"
    if loop.run_dir is None:
        return "interrupted before the run directory was opened: nothing was written, run the command again"
    rd = Path(loop.run_dir)
    ckpt = rd / "checkpoints" / "last.ckpt"
    if not ckpt.is_file():
        return f"interrupted: no checkpoint was written in {rd} (trainer.checkpoint_every=" \
               f"{loop.checkpoint_every}), the run cannot be resumed"
    config = f"--config {rd / 'config.yaml'} " if (rd / "config.yaml").is_file() else ""
    return f"interrupted: resume with `{PROG} fit {config}--trainer.default_root_dir {rd} --ckpt_path {ckpt}`"


_OS_HINTS = {
    errno.ENOTDIR: "a component of the path is a file, not a directory",
    errno.EACCES: "this user may not access it: fix the permissions or choose another path",
    errno.EPERM: "this user may not access it: fix the permissions or choose another path",
    errno.EROFS: "the file system is read-only: choose another path",
    errno.ENOSPC: "the disk is full: free some space or choose another path",
    errno.EDQUOT: "the disk quota is exceeded: free some space or choose another path",
    errno.EEXIST: "it already exists: remove it or choose another path",
    errno.EISDIR: "it is a directory, a file was expected",
    errno.ENAMETOOLONG: "choose a shorter path",
}


def _path_text(name: Any) -> str | None:
    if isinstance(name, (str, bytes, os.PathLike)):
        return os.fsdecode(name)
    return None if name is None else str(name)  # e.g. a file descriptor


def _inside(path: str, directory: str) -> bool:
    try:
        a, d = os.path.abspath(path), os.path.abspath(directory)
        return os.path.commonpath([a, d]) == d
    except ValueError:
        return False


def _os_error_message(e: OSError, run: tuple[str | None, FederatedLoop] | None) -> str:
    """``<path>: <problem> (<where>; <what to do>)`` for an :class:`OSError`, in full."""
    problem = e.strerror or str(e) or type(e).__name__
    path, path2 = _path_text(e.filename), _path_text(e.filename2)
    hints = []
    loop = run[1] if run is not None else None
    rd = None if loop is None else (loop.run_dir or loop.default_root_dir)
    if rd is not None and (path is None or _inside(path, str(rd))):
        hints.append(f"trainer.default_root_dir={str(rd)!r}")
    if e.errno in _OS_HINTS:
        hints.append(_OS_HINTS[e.errno])
    text = problem if path is None else f"{path}{' -> ' + path2 if path2 else ''}: {problem}"
    return text + (f" ({'; '.join(hints)})" if hints else "")


def _is_lightning_interrupt(e: SystemExit) -> bool:
    """Lightning's ``_call_and_handle_interrupt`` ends a fit interrupted by Ctrl-C with ``sys.exit(1)`` raised while
    handling the ``KeyboardInterrupt``: that exit is an interrupt; any other exit is left alone."""
    if e.code != 1:
        return False
    seen: BaseException | None = e.__context__
    while seen is not None:
        if isinstance(seen, KeyboardInterrupt):
            return True
        seen = seen.__cause__ or seen.__context__
    return False


CONFIGS_USAGE = f"""usage: {PROG} configs

List the configs shipped with pl_fedsparse, one per line: the name, then the first comment line of the file.
Run one by name from any directory: `{PROG} fit --config NAME.yaml` (or NAME); a file of that name in the working
directory wins over the shipped one. The shipped files are in: {{folder}}
"""


def list_configs(args: Sequence[str]) -> int:
    """``pl-fed configs``: print the shipped configs with their one-line descriptions.

    Args:
        args: the words after ``configs`` (only ``-h``/``--help`` is accepted).

    Returns:
        The exit status: 0, or 2 after a one-line error.
    """
    if list(args) in (["-h"], ["--help"]):
        sys.stdout.write(CONFIGS_USAGE.format(folder=shipped.config_dir()))
        return 0
    if args:
        sys.stderr.write(f"error: unrecognized arguments: {' '.join(args)} (`{PROG} configs` takes none; see "
                         f"`{PROG} configs --help`)\n")
        return 2
    listing = shipped.format_listing()
    if not listing:
        sys.stderr.write(f"error: no shipped configs in {shipped.config_dir()} (the installation is incomplete: "
                         f"reinstall pl_fedsparse)\n")
        return 2
    sys.stdout.write(listing)
    return 0


def main(argv: list[str] | None = None) -> int:
    """Entry point of the ``pl-fed`` console script."""
    global _current_run
    words = sys.argv[1:] if argv is None else list(argv)
    if words[:1] == ["configs"]:
        return list_configs(words[1:])
    if words[:1] == ["report"]:  # compare run directories (pl_fedsparse.report)
        from pl_fedsparse.report import main as report_main

        return report_main(words[1:])
    _current_run = None
    from pl_fedsparse.allocator import tune_malloc

    tune_malloc()  # glibc: keep freed fit buffers in the heap (issue 13; PL_FEDSPARSE_MALLOC_TUNING=0 opts out)
    main_thread = threading.current_thread() is threading.main_thread()
    sigint = signal.getsignal(signal.SIGINT) if main_thread else None
    try:
        with _working_dir_importable(os.getcwd()):
            FedCLI(args=argv)
    except ConfigError as e:
        sys.stderr.write(f"error: {e}\n")
        return 2
    except KeyboardInterrupt:
        sys.stderr.write(_interrupted_message(_current_run) + "\n")
        return 130
    except SystemExit as e:
        if not _is_lightning_interrupt(e):
            raise
        sys.stderr.write(_interrupted_message(_current_run) + "\n")
        return 130
    except OSError as e:
        sys.stderr.write(f"error: {_os_error_message(e, _current_run)}\n")
        return 2
    finally:
        _current_run = None
        # Lightning ignores SIGINT after handling an interrupt: give the caller its handler back
        if main_thread and sigint is not None and signal.getsignal(signal.SIGINT) is not sigint:
            signal.signal(signal.SIGINT, sigint)
    return 0


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
