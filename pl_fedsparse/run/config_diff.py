"""Comparing a resumed run's configuration with the run's own, as text.

:func:`config_changes` lists the keys that differ; only :data:`RESUME_MAY_CHANGE` keys (and a callback's own
``resume_may_change`` arguments) may. Class paths are compared as strings: a class is looked up only in modules that
are already imported (:func:`_loaded_class`), so nothing named by a checkpoint, ``run.json`` or a resumed
``config.yaml`` is ever imported.
"""

from __future__ import annotations

import json
import sys
from typing import Any

import yaml

__all__ = ["RESUME_MAY_CHANGE", "canonical_config", "config_changes"]


#: configuration keys (dotted, as in ``config.yaml``) a resume may change: none of them changes the rounds already
#: run or the numbers of the rounds still to run (``trainer.num_rounds`` must stay >= the completed rounds, which
#: :func:`~pl_fedsparse.run.checkpoint.restore_federation` checks)
RESUME_MAY_CHANGE = (
    "trainer.num_rounds", "trainer.default_root_dir", "trainer.enable_progress_bar", "trainer.logger",
    "trainer.eval_every", "trainer.eval_metrics", "trainer.checkpoint_every", "trainer.keep_checkpoints", "trainer.overwrite", "ckpt_path",
    "trainer.client_state_codec",  # (lossless: the same numbers; turning it on mid-run is how a run is made to fit)
    "trainer.callback_contract",  # (error or warn: checks, no number changes)
    "data.eval_batch_size",  # (evaluation batches only: a sample's logits move at most in their last bits)
    "trainer.flush_denormal",  # (subnormals as zero: numbers move at most in their last bits; a speed setting)
    "trainer.fit_runner",  # (the same fits, bit for bit on the CPU: tests/test_fit_runner.py; a speed setting)
    "trainer.device_state_budget",  # (device copies of host values: the same numbers; a speed and memory setting)
    "trainer.pin_memory",  # (pinned or pageable staging of the same bytes: a speed setting)
    "trainer.compile",  # (torch.compile: numbers move at most in their last bits, as fused kernels round; a speed setting)
)

#: the attribute by which a callback class lists the ``init_args`` a resume may change (``when`` of an evaluation-only
#: callback, say): ``trainer.callbacks.<i>.init_args.<arg>`` of a callback of the same class in both configurations
CALLBACK_RESUME_ATTR = "resume_may_change"


def _flatten(obj: Any, prefix: str = "") -> dict[str, Any]:
    if isinstance(obj, dict) and obj:
        out: dict[str, Any] = {}
        for k, v in obj.items():
            out.update(_flatten(v, f"{prefix}.{k}" if prefix else str(k)))
        return out
    if isinstance(obj, list) and obj:
        out = {}
        for i, v in enumerate(obj):
            out.update(_flatten(v, f"{prefix}.{i}" if prefix else str(i)))
        return out
    return {prefix: obj}


_ABSENT = object()


def _show(v: Any) -> str:
    return "(absent)" if v is _ABSENT or v == "(absent)" else json.dumps(v, sort_keys=True, default=str)


def _callback_class_path(cfg: Any, index: str) -> str | None:
    try:
        cb = cfg["trainer"]["callbacks"][int(index)]
    except (KeyError, IndexError, TypeError, ValueError):
        return None
    path = cb.get("class_path") if isinstance(cb, dict) else cb
    return str(path) if path is not None else None


def _loaded_class(class_path: str) -> Any:
    """The object ``class_path`` names **if its module is already imported**, else ``None``.

    A configuration read from a checkpoint, ``run.json`` or a resumed ``config.yaml`` may come from elsewhere: it is
    data, and nothing it names is imported (importing runs the module's code). The classes of the configuration the
    user asked to run are imported by the CLI before any comparison, so they resolve here; a class named only by the
    other file does not, and is compared as text. The module's own attribute table is read directly, so not even a
    module-level ``__getattr__`` runs.
    """
    module, _, name = class_path.rpartition(".")
    mod = sys.modules.get(module) if module else None
    if mod is None:
        return None
    try:
        return vars(mod).get(name)
    except TypeError:  # an object in sys.modules without a __dict__
        return None


def _resume_may_change_args(class_path: str) -> tuple[str, ...]:
    """The callback class's :data:`CALLBACK_RESUME_ATTR` (none when its module is not already imported)."""
    cls = _loaded_class(class_path)
    if cls is None:
        return ()
    args = getattr(cls, CALLBACK_RESUME_ATTR, ())
    return tuple(args) if isinstance(args, (tuple, list, set, frozenset)) else ()


def _may_change(key: str, old_cfg: Any, new_cfg: Any) -> bool:
    if key in RESUME_MAY_CHANGE:
        return True
    parts = key.split(".")
    if len(parts) == 5 and parts[:2] == ["trainer", "callbacks"] and parts[3] == "init_args":
        path = _callback_class_path(old_cfg, parts[2])
        return path is not None and path == _callback_class_path(new_cfg, parts[2]) \
            and parts[4] in _resume_may_change_args(path)
    return False


#: the class a ``model:`` / ``data:`` section without ``class_path`` configures (``pl-fed``'s defaults)
DEFAULT_SECTION_CLASSES = {"model": "pl_fedsparse.FederatedModule", "data": "pl_fedsparse.data.FederatedDataModule"}


def _class_key(path: Any) -> Any:
    """One spelling per class: ``pl_fedsparse.module.FederatedModule`` and ``pl_fedsparse.FederatedModule`` name the
    same class (jsonargparse writes the shortest importable path). Resolved only through modules already imported
    (:func:`_loaded_class`): nothing a file from elsewhere names is imported."""
    if not isinstance(path, str) or "." not in path:
        return path
    cls = _loaded_class(path)
    if cls is None:
        return path
    module, _, name = path.rpartition(".")
    return f"{getattr(cls, '__module__', module)}.{getattr(cls, '__qualname__', name)}"


def canonical_config(cfg: Any) -> Any:
    """``cfg`` with its ``model:`` and ``data:`` sections in one layout: the default class's arguments written
    directly (``model: {lr: 0.1}``, as every shipped config writes them), any other class as ``{class_path,
    init_args}`` — so that configurations written either way compare equal and keep their keys (``model.lr``).

    Example:
        >>> canonical_config({"model": {"class_path": "pl_fedsparse.module.FederatedModule", "init_args": {"lr": 0.1}}})
        {'model': {'lr': 0.1}}
        >>> canonical_config({"model": {"class_path": "mypkg.Net", "init_args": {"width": 8}}})["model"]["class_path"]
        'mypkg.Net'
    """
    if not isinstance(cfg, dict):
        return cfg
    out = dict(cfg)
    for section, default in DEFAULT_SECTION_CLASSES.items():
        value = out.get(section)
        if not isinstance(value, dict) or "class_path" not in value:
            continue
        args = value.get("init_args") or {}
        path = value["class_path"]
        if _class_key(path) == _class_key(default):
            out[section] = dict(args)
        else:
            out[section] = {"class_path": path, "init_args": dict(args)}
    return out


def config_changes(old_text: str | None, new_text: str | None) -> tuple[dict[str, list[Any]], dict[str, list[Any]]]:
    """Compare two resolved configurations (YAML) key by key: ``(allowed, refused)`` differences, each
    ``{dotted key: [old, new]}`` (a missing key is ``"(absent)"``); both empty when either text is ``None``.

    Example:
        >>> config_changes("trainer: {num_rounds: 2}\\nmodel: {lr: 0.1}", "trainer: {num_rounds: 4}\\nmodel: {lr: 0.5}")
        ({'trainer.num_rounds': [2, 4]}, {'model.lr': [0.1, 0.5]})

        An option the older configuration does not have, set to null (unset) in the newer one, is no change (a
        checkpoint written before the option existed resumes):

        >>> config_changes("data: {alpha: 0.5}", "data: {alpha: 0.5, cifar10c_root: null}")
        ({}, {})
    """
    if old_text is None or new_text is None:
        return {}, {}
    old_cfg, new_cfg = canonical_config(yaml.safe_load(old_text) or {}), canonical_config(yaml.safe_load(new_text) or {})
    old, new = _flatten(old_cfg), _flatten(new_cfg)
    allowed: dict[str, list[Any]] = {}
    refused: dict[str, list[Any]] = {}
    for key in sorted(set(old) | set(new)):
        a, b = old.get(key, _ABSENT), new.get(key, _ABSENT)
        if a is not _ABSENT and b is not _ABSENT and a == b and isinstance(a, bool) == isinstance(b, bool):
            continue
        if {id(a), id(b)} == {id(_ABSENT), id(None)}:  # an option added since, left unset (null): no change
            continue
        pair = [a if a is not _ABSENT else "(absent)", b if b is not _ABSENT else "(absent)"]
        (allowed if _may_change(key, old_cfg, new_cfg) else refused)[key] = pair
    return allowed, refused
