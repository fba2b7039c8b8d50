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
* an :class:`OSError` nobody else handled (permission denied, not a directory, ...):
  ``error: <path>: <problem> (<what to do>)``, exit 2;
* a storage failure (disk full, quota, I/O error, read-only file system; :class:`~pl_fedsparse.errors.StorageError`)
  anywhere in a run: ``error: <file>: <what> failed: <problem> (<what to do>; <the intact checkpoint and the resume
  command>)``, exit 74 (``EX_IOERR``), the lock released;
* SIGTERM (a scheduler's preemption) or Ctrl-C at any moment (also inside a Lightning fit, which Lightning turns into
  ``sys.exit(1)``; :mod:`pl_fedsparse.signals`): ``terminated (SIGTERM)`` / ``interrupted`` with the round the last
  checkpoint holds and the command that resumes the run from ``<run>/checkpoints/last.ckpt``, exit 143 / 130.

Configs by name: ``--config NAME.yaml`` (or ``NAME``) that names no file in the working directory is the config of
that name shipped with the package (:mod:`pl_fedsparse.shipped`; a real path always wins; an unknown name is a one-line
error listing close matches); ``pl-fed configs`` lists the shipped configs with their descriptions. The
``--config`` values are resolved before jsonargparse parses the command line, so several ``--config`` flags,
``--print_config`` and resuming behave as with paths.

Help: ``pl-fed`` (or ``pl-fed --help``) lists every subcommand (``fit``, ``validate``, ``test``, ``configs``,
``report``); ``pl-fed fit --help`` lists every option, with the classes a class-typed option accepts summarised
(the shipped ones by name, the frameworks' counted; :class:`_FedHelpFormatter`); ``--model.help CLASS``,
``--data.help CLASS``, ``--trainer.callbacks.help CLASS``, ``--model.help FederatedModule --model.backbone.help
CLASS`` show one class's arguments.

One callback's argument from the command line: ``--trainer.callbacks.NAME.ARG VALUE`` (``NAME``: the class name, or
the full class path, of a callback in ``trainer.callbacks``) or ``--trainer.callbacks.INDEX.ARG VALUE`` (0-based
position), also as ``--...ARG=VALUE``; a dotted ``ARG`` (``a.b``) sets a nested key. jsonargparse's own
``--trainer.callbacks.ARG VALUE`` sets the *last* callback's argument and is left as it is. The overrides are taken
out of the command line (:func:`split_callback_overrides`), the rest is parsed, the overrides are applied to the
resulting ``trainer.callbacks`` (values read as YAML; after every other argument, whatever their order) and the list
is appended as one ``--trainer.callbacks=[...]`` and parsed again: jsonargparse checks the new values exactly as
config values, the constructors validate them when the callbacks are built, and ``--print_config`` and
``config.yaml`` show them. An unknown name, an index out of range, a name two callbacks share (give the index), an
argument the class does not take or a value of the wrong type is one ``error: ...`` line naming the option and
listing the configured callbacks.

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

import argparse
import errno
import importlib
import importlib.abc
import importlib.machinery
import os
import re
import secrets
import shlex
import signal
import sys
import textwrap
import traceback
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from copy import deepcopy
from dataclasses import dataclass
from pathlib import Path
from types import ModuleType
from typing import Any

import jsonargparse
import lightning.pytorch as pl
import yaml
from jsonargparse import DefaultHelpFormatter, Namespace
from lightning.fabric.utilities.seed import max_seed_value, min_seed_value, seed_everything
from lightning.pytorch.cli import LightningArgumentParser, LightningCLI

from pl_fedsparse import shipped
from pl_fedsparse.data import FederatedDataModule
from pl_fedsparse.errors import (
    STORAGE_ADVICE,
    STORAGE_ERRNOS,
    ConfigError,
    RunStoppedError,
    StorageError,
    UserCodeError,
    check,
)
from pl_fedsparse.loop import FederatedLoop
from pl_fedsparse.module import FederatedModule
from pl_fedsparse.signals import Terminated, exit_status, interrupt_in, stop_on_signals

#: the ``dump`` keyword that keeps ``None`` values in ``config.yaml``: jsonargparse 4.49 renamed ``skip_none`` to
#: ``skip_unset`` and warns on the old name on every run; older versions (the declared range starts at 4.32) know only
#: the old one
_KEEP_NONE = "skip_unset" if tuple(int(x) for x in re.findall(r"\d+", jsonargparse.__version__)[:2]) >= (4, 49) \
    else "skip_none"

__all__ = ["DEFAULT_DATA", "DEFAULT_MODEL", "FedCLI", "main"]

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
#: the exit status of a run stopped by a storage failure (sysexits.h ``EX_IOERR``)
EXIT_STORAGE = 74

#: the subcommands :func:`main` handles itself, before LightningCLI, with their one-line help
OWN_SUBCOMMANDS = {
    "configs": "List the shipped configs with their descriptions (run one with `pl-fed fit --config NAME`).",
    "report": "Compare run directories: a table of their final metrics (markdown + CSV) and figures.",
    "sweep": "Run a campaign (configs x settings x seeds) several runs at a time, resumable, then report it.",
}

#: the end of ``pl-fed fit|validate|test --help``: how to see a class's arguments and address one callback
SUBCOMMAND_EPILOG = f"""\
Class arguments: `model:`, `data:`, `trainer.callbacks`, `trainer.topology`, `trainer.executor` and
`model.backbone` take a class by `class_path` (or its name) with its `init_args`; the help lists the shipped
classes only. Show one class's arguments with `--<option>.help CLASS`, e.g.:

  {PROG} fit --model.help FederatedModule
  {PROG} fit --model.help FederatedModule --model.backbone.help LeNetCIFAR
  {PROG} fit --data.help FederatedDataModule
  {PROG} fit --trainer.callbacks.help DualMask

Override one callback's argument from the command line by class name or position in `trainer.callbacks`
(`--trainer.callbacks.ARG` alone sets the last callback's):

  {PROG} fit --config synthetic_dmpfl --trainer.callbacks.DualMask.iterations 2
  {PROG} fit --config synthetic_dmpfl --trainer.callbacks.0.iterations 2

A small trial: `--trainer.num_rounds 3 --data.max_train_samples 2000`; on a GPU: `--trainer.accelerator gpu`.

`--print_config` shows the resulting configuration; `{PROG} configs` lists the shipped configs."""

#: top-level packages whose classes the help counts instead of listing (torch alone has ~700 ``nn.Module``\ s)
_FRAMEWORKS = ("torch", "torchvision", "torchaudio", "torchmetrics", "torchtext", "lightning", "pytorch_lightning",
               "lightning_fabric", "lightning_utilities")
#: jsonargparse's ``, known subclasses: a.B, c.D)`` at the end of a class-typed option's help
_KNOWN_SUBCLASSES = re.compile(r", known subclasses: ([^()]*)\)\s*$")


def summarize_class_paths(paths: Sequence[str], option: str) -> str:
    """A short text for the classes an option accepts: every class outside the big frameworks listed, grouped by
    module (``pl_fedsparse.models.{LeNetCIFAR, MLP}``), the frameworks' classes counted.

    Example:
        >>> summarize_class_paths(["torch.nn.Linear", "torch.nn.ReLU", "pl_fedsparse.models.MLP",
        ...                        "pl_fedsparse.models.LeNetCIFAR", "my.Net"], "--model.backbone")
        'any subclass by class_path or name; shipped/imported: pl_fedsparse.models.{MLP, LeNetCIFAR}, my.Net; 2 more \
from torch; `--model.backbone.help CLASS` shows its arguments'
    """
    listed: dict[str, list[str]] = {}
    counted: dict[str, int] = {}
    for path in paths:
        top = path.split(".", 1)[0]
        if top in _FRAMEWORKS:
            counted[top] = counted.get(top, 0) + 1
        else:
            module, _, name = path.rpartition(".")
            listed.setdefault(module, []).append(name)
    groups = [(f"{m}." if m else "") + (names[0] if len(names) == 1 else "{" + ", ".join(names) + "}")
              for m, names in listed.items()]
    text = "any subclass by class_path or name"
    if groups:
        text += "; shipped/imported: " + ", ".join(groups)
    if counted:
        total = sum(counted.values())
        text += f"; {total} {'more ' if groups else ''}from " + ", ".join(counted)
    return text + f"; `{option}.help CLASS` shows its arguments"


_RST_ROLE = re.compile(r":[a-z]+:`~?([^`]*?)`")
_SENTENCE_END = re.compile(r"(?<=[a-z0-9)\]'\"])\.\s+(?=[A-Z(])")


def _short_help(text: str, action: argparse.Action) -> str:
    """An option's help for the terminal: reST markup removed (``x`` → x, :class:`~a.B` → B), only the first
    sentence of the argument's description (the whole of it is in the class docstring and the docs), the type left
    out where the choices already show it, and one line for the ``--X.help CLASS`` options.

    Example:
        >>> _short_help("what it does. More. (type: int, default: 1)", argparse.Action(["--a"], "a"))
        'what it does. (type: int, default: 1)'
    """
    if text.startswith("Show the help for the given subclass of"):
        return "its arguments (CLASS: a class path or name)"
    text = _RST_ROLE.sub(lambda m: m.group(1).rsplit(".", 1)[-1], text).replace("``", "")
    m = re.search(r"\s\((required, )?type: ", text)
    body, sep, tail = (text[:m.start()], f" ({m.group(1) or ''}type: ", text[m.end():]) if m else (text, "", "")
    first = _SENTENCE_END.split(body, maxsplit=1)
    if len(first) > 1:
        body = first[0] + "."
    if tail and str(getattr(action, "metavar", "") or "").startswith("{"):  # {skip,raise} already says it
        tail = tail.replace("%(type)s, ", "", 1)
        sep = sep.replace("type: ", "") if tail.startswith("default: ") else sep
    return body + (sep + tail if sep else "")


class _FedHelpFormatter(DefaultHelpFormatter):
    """jsonargparse's help formatter with the "known subclasses" of a class-typed option summarised
    (:func:`summarize_class_paths`) and with paragraphs (blank-line separated; indented lines kept as they are) in
    descriptions and epilogs.

    jsonargparse's ``--X.help CLASS`` builds its parser with ``type(parser)(...)`` and so with this formatter too.
    """

    def _get_help_string(self, action: argparse.Action) -> str:
        text = _short_help(super()._get_help_string(action) or "", action)
        m = _KNOWN_SUBCLASSES.search(text)
        if m is None or not action.option_strings:
            return text
        paths = [p.strip() for p in m.group(1).split(",") if p.strip()]
        return text[:m.start()] + ", " + summarize_class_paths(paths, action.option_strings[0]) + ")"

    def _fill_text(self, text: str, width: int, indent: str) -> str:
        out = []
        for para in re.split(r"\n\s*\n", text.strip("\n")):
            if all(line.startswith("  ") for line in para.splitlines()):
                out.append("\n".join(indent + line for line in para.splitlines()))
            else:
                out.append(textwrap.fill(" ".join(para.split()), width, initial_indent=indent,
                                         subsequent_indent=indent))
        return "\n\n".join(out)


class _OneLineErrors(LightningArgumentParser):
    """Report parse errors in one line (``error: ...``), exit status 2, no usage dump; help with class lists
    summarised (:class:`_FedHelpFormatter`)."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        kwargs.setdefault("formatter_class", _FedHelpFormatter)
        super().__init__(*args, **kwargs)

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
        if _KEEP_NONE != "skip_none" and "skip_none" in kwargs:  # Lightning's callers and ours use the old name
            kwargs[_KEEP_NONE] = kwargs.pop("skip_none")
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
        """Parse the command line after resolving every ``--config`` value (a path, or a shipped config's name)
        and applying the per-callback overrides (``--trainer.callbacks.NAME_OR_INDEX.ARG VALUE``, see
        :func:`split_callback_overrides`)."""
        if args is None:
            words = sys.argv[1:]
            resolved = shipped.rewrite_config_args(words)
        elif isinstance(args, (list, tuple)):
            words = [str(a) for a in args]
            resolved = shipped.rewrite_config_args(words)
        else:
            super().parse_arguments(parser, args)
            return
        rest, overrides = split_callback_overrides(resolved)
        if overrides:
            resolved = rest + [f"--trainer.callbacks={self._overridden_callbacks(parser, rest, overrides)}"]
        if args is None and resolved == words:
            super().parse_arguments(parser, None)
        else:
            # what LightningCLI does with a list, without its warning about passing args *and* sys.argv
            self.config = parser.parse_args(resolved)

    @staticmethod
    def _overridden_callbacks(parser: LightningArgumentParser, args: list[str],
                              overrides: list[CallbackOverride]) -> str:
        """``trainer.callbacks`` as ``args`` configure it, with ``overrides`` applied, as a JSON list: appended to
        the command line and parsed again, so jsonargparse checks the new values exactly as config values."""
        import json

        # a first parse, only to learn the configured callbacks (--print_config would print and exit)
        first = parser.parse_args([a for a in args if a != "--print_config" and not a.startswith("--print_config=")])
        sub = first.get("subcommand")
        callbacks = (first[sub] if sub else first).get("trainer.callbacks")
        entries = [cb.as_dict() if isinstance(cb, Namespace) else dict(cb) for cb in callbacks or []]
        return json.dumps(apply_callback_overrides(entries, overrides), default=str)

    def _add_subcommands(self, parser: LightningArgumentParser, **kwargs: Any) -> None:
        """LightningCLI's subcommands, and in ``pl-fed --help`` also the ones :func:`main` handles itself."""
        super()._add_subcommands(parser, **kwargs)
        action = parser._subcommands_action
        if action is None:  # pragma: no cover - LightningCLI always adds them
            return
        for name, text in OWN_SUBCOMMANDS.items():  # listed only: main() runs them before LightningCLI
            action._choices_actions.append(action._ChoicesPseudoAction(name, [], text))  # type: ignore[attr-defined]
        action.metavar = "{" + ",".join([*self.subcommands(), *OWN_SUBCOMMANDS]) + "}"

    def _prepare_subcommand_parser(self, klass: type, subcommand: str, **kwargs: Any) -> LightningArgumentParser:
        """LightningCLI's subcommand parser, with readable section titles and an epilog on class arguments."""
        parser = super()._prepare_subcommand_parser(klass, subcommand, **kwargs)
        parser.epilog = SUBCOMMAND_EPILOG
        titles = {"model": f"Model (`model:`): any LightningModule by class_path, default {DEFAULT_MODEL}",
                  "data": f"Data (`data:`): any FederatedDataModule by class_path, default {DEFAULT_DATA}"}
        for group in parser._action_groups:
            dests = {a.dest for a in group._group_actions}
            for dest, title in titles.items():
                if dest in dests:
                    group.title = title
        return parser

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
        text = parser.dump(cfg, skip_none=False, skip_link_targets=False)  # (dump gives it the installed name)
        data = yaml.safe_load(text)
        header = "# written by pl-fed; reproduce with: pl-fed fit --config config.yaml\n"
        return header + yaml.safe_dump(data, sort_keys=False)


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
    # a class of the user's whose __init__ raised: jsonargparse lists the message among the union's errors and names
    # the class in the value it was given
    text = str(exc)
    path = re.search(r"class_path='([^']+)'", text)
    errors = re.search(r"\nErrors:\n\s*- (.+)", text)
    if path and errors and not errors.group(1).startswith(("Expected a", "Not a valid", "Import path", "Problem with")):
        err = UserCodeError(f"{path.group(1)}.__init__ raised: {' '.join(errors.group(1).split())} (while building "
                            "the configured classes)")
        err.__cause__ = exc  # (PL_FED_DEBUG=1: jsonargparse's account, which lists every type it tried)
        return err
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
def _as_received(e: KeyboardInterrupt, received: list[int]) -> KeyboardInterrupt:
    """The interrupt as the signal that started it: code that catches an interrupt and raises a new plain
    ``KeyboardInterrupt`` (``ray.get`` does) must not turn a SIGTERM (exit 143) into a Ctrl-C (exit 130)."""
    if received and received[0] == signal.SIGTERM and not isinstance(e, Terminated):
        return Terminated(signal.SIGTERM)
    return e


def _interrupted_message(run: tuple[str | None, FederatedLoop] | None,
                         interrupt: KeyboardInterrupt | None = None) -> str:
    """What an interrupted run left behind and how to continue it."""
    word = "terminated (SIGTERM)" if isinstance(interrupt, Terminated) else "interrupted"
    subcommand, loop = run if run is not None else (None, None)
    if subcommand != "fit" or loop is None:
        return word
    if loop.run_dir is None:
        return f"{word} before the run directory was opened: nothing was written, run the command again"
    rd = Path(loop.run_dir)
    ckpt = rd / "checkpoints" / "last.ckpt"
    if not ckpt.is_file():
        return f"{word}: no checkpoint was written in {rd} (trainer.checkpoint_every=" \
               f"{loop.checkpoint_every}), the run cannot be resumed"
    done = loop.reporter.directory.checkpoint_round
    held = "round 0" if done == 1 else f"rounds 0 to {done - 1}"  # metrics.jsonl's round numbers (from 0)
    at = f" (it continues at round {done}; the checkpoint holds {held})" if done else \
        " (no round had completed)" if done == 0 else ""
    q = shlex.quote  # a path with a space or a quote still makes a command the shell runs as printed
    config = f"--config {q(str(rd / 'config.yaml'))} " if (rd / "config.yaml").is_file() else ""
    return f"{word}: resume with `{PROG} fit {config}--trainer.default_root_dir {q(str(rd))} " \
           f"--ckpt_path {q(str(ckpt))}`{at}"


_OS_HINTS = {
    errno.ENOTDIR: "a component of the path is a file, not a directory",
    errno.EACCES: "this user may not access it: fix the permissions or choose another path",
    errno.EPERM: "this user may not access it: fix the permissions or choose another path",
    errno.EEXIST: "it already exists: remove it or choose another path",
    errno.EISDIR: "it is a directory, a file was expected",
    errno.ENAMETOOLONG: "choose a shorter path",
    **STORAGE_ADVICE,  # full disk, quota, I/O error, read-only: one wording with StorageError's
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


CONFIGS_USAGE = f"""usage: {PROG} configs

List the configs shipped with pl_fedsparse: the name, then the description (the file's leading comment lines,
without its example command), wrapped to the terminal's width. Run one by name from any directory:
`{PROG} fit --config NAME.yaml` (or NAME); a file of that name in the working directory wins over the shipped one.
The shipped files are in: {{folder}}
"""


def list_configs(args: Sequence[str]) -> int:
    """``pl-fed configs``: print the shipped configs with their descriptions.

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
    if not words:  # `pl-fed` alone: the help, which lists every subcommand
        words = ["--help"]
        argv = words
    elif not words[0].startswith("-") and words[0] not in [*FedCLI.subcommands(), *OWN_SUBCOMMANDS]:
        sys.stderr.write(f"error: unknown subcommand {words[0]!r}: expected one of "
                         f"{', '.join([*FedCLI.subcommands(), *OWN_SUBCOMMANDS])} (see `{PROG} --help`)\n")
        return 2
    if words[:1] == ["configs"]:
        return list_configs(words[1:])
    if words[:1] == ["report"]:  # compare run directories (pl_fedsparse.report)
        from pl_fedsparse.report import main as report_main

        return report_main(words[1:])
    if words[:1] == ["sweep"]:  # a campaign of runs (pl_fedsparse.sweep)
        from pl_fedsparse.sweep import main as sweep_main

        return sweep_main(words[1:])
    _current_run = None
    from pl_fedsparse.allocator import tune_malloc

    tune_malloc()  # glibc: keep freed fit buffers in the heap (PL_FEDSPARSE_MALLOC_TUNING=0 opts out)
    received: list[int] = []
    try:
        with stop_on_signals() as received, _working_dir_importable(os.getcwd()):
            FedCLI(args=argv)
    except ConfigError as e:
        sys.stderr.write(f"error: {e}\n")
        return 2
    except KeyboardInterrupt as e:  # Ctrl-C or SIGTERM (Terminated)
        e = _as_received(e, received)
        sys.stderr.write(_interrupted_message(_current_run, e) + "\n")
        return exit_status(e)
    except SystemExit as e:
        interrupt = interrupt_in(e) if e.code == 1 else None  # Lightning's shutdown of an interrupted fit
        if interrupt is None:
            raise
        interrupt = _as_received(interrupt, received)
        sys.stderr.write(_interrupted_message(_current_run, interrupt) + "\n")
        return exit_status(interrupt)
    except RunStoppedError as e:  # the federation cannot go on (its last checkpoint is intact)
        sys.stderr.write(f"error: {e}\n")
        return 1
    except UserCodeError as e:  # the user's code raised: one line; its traceback on PL_FED_DEBUG=1
        if os.environ.get("PL_FED_DEBUG", "") not in ("", "0"):
            traceback.print_exception(e.__cause__ or e)
        sys.stderr.write(f"error: {e} (PL_FED_DEBUG=1 prints its traceback)\n")
        return 1
    except StorageError as e:
        sys.stderr.write(f"error: {e}\n")
        return EXIT_STORAGE
    except OSError as e:
        sys.stderr.write(f"error: {_os_error_message(e, _current_run)}\n")
        return EXIT_STORAGE if e.errno in STORAGE_ERRNOS else 2
    finally:
        _current_run = None
    return 0


def check_entry(args: Sequence[str]) -> int:
    """Build a ``pl-fed fit`` configuration's classes (model, data module, loop, callbacks: every argument check)
    without running it; 0, or the status of the one line it printed (``pl-fed sweep`` checks its entries so)."""
    try:
        with _working_dir_importable(os.getcwd()):
            FedCLI(args=list(args), run=False)
    except ConfigError as e:
        sys.stderr.write(f"error: {e}\n")
        return 2
    except UserCodeError as e:
        sys.stderr.write(f"error: {e}\n")
        return 1
    return 0


def console_main() -> None:
    """The ``pl-fed`` console script: :func:`main`, with the process's last second covered too.

    :func:`main` handles SIGTERM and SIGINT while it works (:func:`~pl_fedsparse.signals.stop_on_signals`); once it
    has returned, the interpreter still shuts down (threads, caches) for up to a second, where a scheduler's SIGTERM
    used to end the process silently with -15. Here such a signal ends it with one line and ``main``'s own exit
    status: the work was done (a signal before ``main`` got to work ends it with 143 / 130, nothing written).
    """
    done: dict[str, int | None] = {"code": None}

    def late(signum: int, frame: Any) -> None:
        code = done["code"]
        if code is None:
            code = 143 if signum == signal.SIGTERM else 130
        what = "SIGTERM" if signum == signal.SIGTERM else "SIGINT"
        for stream in (sys.stdout, sys.stderr):
            try:
                stream.flush()
            except (OSError, ValueError):
                pass
        state = "finished" if done["code"] is not None else "not started"
        os.write(2, f"{PROG}: {what} while exiting: ignored, the command had {state} (exit status {code})\n".encode())
        os._exit(code)

    for s in (signal.SIGTERM, signal.SIGINT):
        signal.signal(s, late)  # (main's own handlers take over while it runs and give these back when it is done)
    done["code"] = main()
    sys.exit(done["code"])


if __name__ == "__main__":  # pragma: no cover
    console_main()
