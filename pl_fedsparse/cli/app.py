"""The LightningCLI of ``pl-fed fit|validate|test``: :class:`FedCLI`, its parser (parse errors in one line) and the
defaults of a ``model:`` / ``data:`` section that names no class.
"""

from __future__ import annotations

import ast
import importlib
import inspect
import logging
import re
import secrets
import sys
from collections.abc import Mapping
from typing import Any

import jsonargparse
import lightning.pytorch as pl
import yaml
from jsonargparse import Namespace
from lightning.fabric.utilities.seed import max_seed_value, min_seed_value, seed_everything
from lightning.pytorch.cli import LightningArgumentParser, LightningCLI

from pl_fedsparse import shipped
from pl_fedsparse.cli.help import CONFIG_HELP, DESCRIPTION, OWN_SUBCOMMANDS, PROG, SUBCOMMAND_EPILOG, _FedHelpFormatter
from pl_fedsparse.cli.messages import _config_error_in
from pl_fedsparse.cli.overrides import CallbackOverride, apply_callback_overrides, split_callback_overrides
from pl_fedsparse.data import FederatedDataModule
from pl_fedsparse.errors import (
    check,
)
from pl_fedsparse.loop import FederatedLoop
from pl_fedsparse.module import FederatedModule

__all__ = ["DEFAULT_DATA", "DEFAULT_MODEL", "FedCLI"]


#: the ``dump`` keyword that keeps ``None`` values in ``config.yaml``: jsonargparse 4.49 renamed ``skip_none`` to
#: ``skip_unset`` and warns on the old name on every run; older versions (the declared range starts at 4.32) know only
#: the old one
_KEEP_NONE = "skip_unset" if tuple(int(x) for x in re.findall(r"\d+", jsonargparse.__version__)[:2]) >= (4, 49) \
    else "skip_none"


log = logging.getLogger(__name__)

#: jsonargparse's (debug) account of the ``init_args`` it dropped when a later ``class_path`` replaced a class
_DISCARDED = re.compile(r"Due to class_path change from '(?P<old>[^']+)' to '(?P<new>[^']+)', discarding "
                        r"init_args: (?P<args>.*)\.$", re.S)


class _DroppedInitArgs(logging.Handler):
    """The parser's log, of which one kind of line is told (once each) as a warning: the ``init_args`` a class given
    later (``--data.class_path X`` after a config, a second ``--config``) does not take, which jsonargparse drops
    silently — a setting the user made that the run would otherwise ignore without a word."""

    def __init__(self) -> None:
        super().__init__(logging.DEBUG)
        self._told: set[str] = set()

    def reset(self) -> None:
        """Forget what was told (a new command line)."""
        self._told.clear()

    def emit(self, record: logging.LogRecord) -> None:
        found = _DISCARDED.match(record.getMessage())
        if found is None or found.group(0) in self._told:
            return
        self._told.add(found.group(0))
        dropped = _set_by_the_user(found["old"], found["args"])
        if dropped:
            log.warning("%s was replaced by %s (a later class_path), which does not take %s: dropped", found["old"],
                        found["new"], dropped)


#: the parsers' logger (a registered one: jsonargparse deep-copies parsers, and a logger pickles by its name)
_PARSE_LOG = logging.getLogger(f"{__name__}.parse")
_PARSE_LOG.setLevel(logging.DEBUG)
_PARSE_LOG.propagate = False  # (jsonargparse's other debug lines go nowhere)
_DROPPED = _DroppedInitArgs()
_PARSE_LOG.addHandler(_DROPPED)


def _set_by_the_user(class_path: str, args: str) -> str:
    """jsonargparse's dict of dropped arguments (``{'input_size': 16}``) as ``input_size=16``, leaving out those
    whose value is the replaced class's default or ``None`` for a required one (jsonargparse drops those too: nobody
    set them); the text as it is when it is not a dict of literals, or the class cannot be inspected.

    >>> _set_by_the_user("pl_fedsparse.models.MLP", "{'input_size': 16, 'num_classes': 10}")
    'input_size=16'
    >>> _set_by_the_user("no.such.Class", "{'a': Namespace(b=1)}")
    "{'a': Namespace(b=1)}"
    """
    try:
        values = ast.literal_eval(args)
    except (ValueError, SyntaxError, TypeError, MemoryError, RecursionError):
        return args
    if not isinstance(values, dict) or not all(isinstance(k, str) for k in values):
        return args
    params: Mapping[str, inspect.Parameter] = {}
    try:
        module, _, name = class_path.rpartition(".")
        params = inspect.signature(getattr(importlib.import_module(module), name)).parameters
    except (ImportError, AttributeError, ValueError, TypeError):
        pass  # (every argument is told)

    def unset(k: str, v: Any) -> bool:  # the class's default, or None for a required argument nobody gave
        default = params[k].default if k in params else inspect.Parameter.empty
        return k in params and (_equal(default, v) or (default is inspect.Parameter.empty and v is None))

    return ", ".join(f"{k}={v!r}" for k, v in values.items() if not unset(k, v))


def _equal(a: Any, b: Any) -> bool:
    """``a == b`` as a plain truth value, a tuple equal to the list of its items (a config's YAML gives lists); False
    where comparing raises or gives no bool (e.g. arrays)."""
    a, b = (list(x) if isinstance(x, tuple) else x for x in (a, b))
    try:
        return (a == b) is True
    except Exception:  # noqa: BLE001 - a comparison that fails means "not the default"
        return False


#: the ``class_path`` of a ``model:`` / ``data:`` section that names none
DEFAULT_MODEL = f"{FederatedModule.__module__}.{FederatedModule.__qualname__}"

DEFAULT_DATA = "pl_fedsparse.data.FederatedDataModule"

#: ``(subcommand, loop)`` of the run :func:`main` is executing: where an interrupted or failed run writes
_current_run: tuple[str | None, FederatedLoop] | None = None


class _OneLineErrors(LightningArgumentParser):
    """Report parse errors in one line (``error: ...``), exit status 2, no usage dump; help with class lists
    summarised (:class:`_FedHelpFormatter`)."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        kwargs.setdefault("formatter_class", _FedHelpFormatter)
        super().__init__(*args, **kwargs)

    def error(self, message: str, ex: Exception | None = None) -> Any:
        if not self.exit_on_error:
            return super().error(message, ex)
        # jsonargparse nests the useful part last ("Parser key 'x': ... - Expected ..."); the whole of it is kept
        # unless it is a class_path that cannot be used (said in the project's one-line form)
        text = class_path_problem(str(message)) or " ".join(s.strip() for s in str(message).splitlines() if s.strip())
        sys.stderr.write(f"error: {text} (see `{_help_command(self.prog)}`)\n")
        sys.exit(2)


    def dump(self, cfg: Any, *args: Any, **kwargs: Any) -> str:
        """jsonargparse's dump, with ``model:``/``data:`` of the default classes written without ``class_path``
        (:func:`~pl_fedsparse.run.writer.canonical_config`): ``--print_config`` and ``config.yaml`` read like the
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
        from pl_fedsparse.run.config_diff import canonical_config

        return yaml.safe_dump(canonical_config(data), sort_keys=False, default_flow_style=False, allow_unicode=True)


#: what a configured class must be, by the base class jsonargparse names
_BASES = {
    "LightningModule": "a lightning.pytorch.LightningModule subclass (a plain torch.nn.Module goes in as "
                       "model.init_args.backbone of pl_fedsparse.FederatedModule: docs/your-own-model.md)",
    "FederatedDataModule": "a pl_fedsparse.data.FederatedDataModule subclass (docs/your-own-data.md)",
    "Callback": "a lightning.pytorch.Callback subclass (the library's callbacks or your own: docs/extending.md)",
    "Module": "a torch.nn.Module subclass",
}


def class_path_problem(message: str) -> str | None:
    r"""jsonargparse's account of a configured class it could not use — a union of every type it tried, nested
    once for every class holding the next (``model`` → its ``backbone``) — as one line in the project's form naming
    the dotted option, the value or class path and what is allowed; ``None`` for another message.

    Example:
        >>> class_path_problem('Parser key "model":\n  Does not validate against any of the Union subtypes\n'
        ...                    '  Errors:\n    - Problem with given class_path \'mine.Net\':\n'
        ...                    "        No module named 'mine'\n    - Expected a <class 'NoneType'>")
        "model.class_path='mine.Net' is invalid: No module named 'mine' (run pl-fed from the folder that holds the module, or add that folder to PYTHONPATH)"
        >>> class_path_problem('Parser key "data":\n  Errors:\n    - Problem with given class_path \'a.Data\':\n'
        ...                    '        Parser key "batch_size":\n          Expected a <class \'int\'>. Got value: abc')
        "data.batch_size='abc' is invalid: expected an int"
    """
    keys = re.findall(r'Parser key "([^"]+)"', message)
    if not keys:
        return None
    dotted = ".".join(keys)
    paths = re.findall(r"Problem with given class_path '([^']+)'", message)
    path = paths[-1] if paths else None
    where = f"{dotted}.class_path={path!r}"
    missing = re.search(r"No module named '([^']+)'", message)
    if missing and path:
        if missing.group(1) == path.split(".")[0] or path.startswith(missing.group(1) + "."):
            return (f"{where} is invalid: No module named {missing.group(1)!r} (run pl-fed from the folder that "
                    "holds the module, or add that folder to PYTHONPATH)")
        return (f"{where} is invalid: importing it failed: No module named {missing.group(1)!r} (a module it "
                "imports is not installed)")
    required = re.search(r"the following arguments are required: (.+)", message)
    if required and path:
        names = ", ".join(n.strip() for n in required.group(1).split(","))
        first = names.split(",")[0]
        return (f"{where} is invalid: its __init__ requires {names} (give --{dotted}.init_args.{first}, or "
                f"{dotted}.init_args in the config)")
    unknown = re.search(r"Option '([^']+)' is not accepted", message)
    if unknown and path:
        return (f"{dotted}.{unknown.group(1)} is invalid: expected an argument of {path}'s __init__"
                f"{_close(unknown.group(1), path)}")
    wrong = re.search(r"Import path (\S*) ?does not correspond to a subclass of (\w+)", message)
    if wrong:
        allowed = _BASES.get(wrong.group(2), f"a {wrong.group(2)} subclass")
        if wrong.group(1):
            return f"{dotted}.class_path={wrong.group(1)!r} is invalid: expected {allowed}"
        return f"{dotted}={_given(message)!r} is invalid: expected {allowed}"
    typed = re.search(r"Expected a <class '(\w+)'>\. Got value: (.+)", message)
    if typed:
        return f"{dotted}={typed.group(2).strip()!r} is invalid: expected {_KINDS.get(typed.group(1), typed.group(1))}"
    dotpath = re.search(r"Expected a dot import path string: (\S+)", message)
    if dotpath:
        return f"{dotted}={dotpath.group(1)!r} is invalid: expected a class path (package.module.Class)"
    literal = re.search(r"Expected a typing\.Literal\[(.+?)\]\. Got value: (.+)", message)
    if literal:
        return f"{dotted} is invalid: {literal.group(2).strip()!r} is not one of {literal.group(1)}"
    kinds = re.findall(r"Expected a <class '(\w+)'>", message)
    others = re.findall(r"Expected a (?!<class )", message)  # (a type this reading cannot put in words)
    if kinds and not others and "Given value:" in message and not paths:
        allowed = " or ".join(dict.fromkeys(_KINDS.get(k, k) for k in kinds))
        return f"{dotted}={_given(message)!r} is invalid: expected {allowed}"
    return None


#: how a type jsonargparse names reads in a one-line error
_KINDS = {"int": "an int", "float": "a finite number", "bool": "true or false", "str": "a string",
          "NoneType": "null"}


def _given(message: str) -> str:
    """The value jsonargparse says it was given (its ``Given value:`` line)."""
    found = re.search(r"Given value: (.+)", message)
    return found.group(1).strip() if found else "?"


def _close(name: str, path: str) -> str:
    """`` (did you mean x?)`` when ``path``'s ``__init__`` has an argument close to ``name``."""
    import difflib
    import importlib
    import inspect

    try:
        module, _, attr = path.rpartition(".")
        params = list(inspect.signature(getattr(importlib.import_module(module), attr).__init__).parameters)
    except Exception:  # noqa: BLE001 - only a hint
        return ""
    close = difflib.get_close_matches(name, [p for p in params if p not in ("self", "args", "kwargs")], n=1)
    return f" (did you mean {close[0]}?)" if close else ""


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
        kwargs.setdefault("trainer_class", FederatedLoop)
        kwargs.setdefault("save_config_callback", None)
        kwargs.setdefault("seed_everything_default", 0)
        kwargs.setdefault("parser_class", _OneLineErrors)
        kwargs.setdefault("parser_kwargs", {"prog": PROG, "description": DESCRIPTION})
        kwargs.setdefault("auto_configure_optimizers", False)
        super().__init__(args=args, run=run, **kwargs)

    def init_parser(self, **kwargs: Any) -> LightningArgumentParser:
        """LightningCLI's parser, with ``--config`` documented to take a shipped config's name too."""
        kwargs.setdefault("logger", _PARSE_LOG)  # the init_args a later class_path dropped are told
        parser = super().init_parser(**kwargs)
        for action in parser._actions:
            if "--config" in action.option_strings:
                action.help = CONFIG_HELP
        return parser

    def parse_arguments(self, parser: LightningArgumentParser, args: Any) -> None:
        """Parse the command line after resolving every ``--config`` value (a path, or a shipped config's name)
        and applying the per-callback overrides (``--trainer.callbacks.NAME_OR_INDEX.ARG VALUE``, see
        :func:`split_callback_overrides`)."""
        _DROPPED.reset()
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
            action._choices_actions.append(action._ChoicesPseudoAction(name, [], text))
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
