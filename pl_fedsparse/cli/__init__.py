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

Start-up: ``console_main`` (the console script, :mod:`pl_fedsparse.cli.entry`) is importable without torch or
Lightning, and every other name here is imported on first use (PEP 562 ``__getattr__``), so the command handles
SIGINT, SIGTERM and SIGHUP before the seconds it takes to import them.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from pl_fedsparse._moved import lazy_exports

if TYPE_CHECKING:
    from pl_fedsparse.cli.app import DEFAULT_DATA, DEFAULT_MODEL, FedCLI
    from pl_fedsparse.cli.commands import check_entry, main
    from pl_fedsparse.cli.entry import console_main

#: each public name -> the module that defines it (imported when the name is first read)
_PUBLIC: dict[str, str] = {
    **dict.fromkeys(("DEFAULT_DATA", "DEFAULT_MODEL", "FedCLI"), "pl_fedsparse.cli.app"),
    **dict.fromkeys(("check_entry", "main"), "pl_fedsparse.cli.commands"),
    "console_main": "pl_fedsparse.cli.entry",
}

__all__ = ["DEFAULT_DATA", "DEFAULT_MODEL", "FedCLI", "check_entry", "console_main", "main"]

__getattr__ = lazy_exports(__name__, _PUBLIC)
