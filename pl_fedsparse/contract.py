"""The callback contract of ``docs/extending.md``, checked in code (as Lightning checks hook signatures).

Two rules fail silently when broken, so the loop checks them (``trainer.callback_contract``: ``"error"``, the
default, stops the run with one :class:`CallbackContractError` line; ``"warn"`` logs one warning per callback
class and attribute and goes on):

1. **A fit writes only its update and its declared client state** (:class:`FitWatch`). An out-of-process executor
   (Ray workers) runs fits on replicas of the callbacks: an attribute a callback sets on ``self`` during a fit stays
   in the worker, so the run gives other numbers than in process (a user trial: 52.13 % vs 30.27 %).
   ``InProcessExecutor.run_one`` fingerprints every checked callback's instance attributes (``vars(cb)``) before
   ``on_client_fit_start`` and compares after ``on_client_fit_end`` — the span a worker runs. Fingerprints are
   cheap: scalars and strings by value, tensors by (identity, ``_version``, shape) — so an in-place change counts —,
   small numpy arrays by their bytes, lists/tuples/dicts/sets by their contents (recursively, :data:`FIT_DEPTH`
   levels, up to :data:`FIT_ITEMS` items; a larger or deeper one by identity and length), any other object by
   identity (a change *inside* a helper object is not seen). An attribute back to its pre-fit fingerprint at the
   end of the fit passes (device copies made in ``on_train_start`` and dropped in ``on_train_end``). A fit that
   raised (a client fault) is not checked. Cost: 5-55 µs per fit for the library's callbacks (measured on the test
   suite's tiny MLP: ``SparseMask`` 22 µs, ``DualMask`` + ``AdaptiveInference`` + ``ShiftEvaluation`` 54 µs,
   ``PFedGate`` 55 µs, ``Ditto`` 8 µs); the checkpoint check well under a millisecond.
2. **State that changes across rounds is saved** (:class:`ResumeCheck`). A resumed run rebuilds each callback
   from its constructor and ``setup_federation``, then loads its ``state_dict()``; what is neither is lost (a user
   trial: 44.87 % instead of 52.13 % after a resume). Right after ``setup_federation`` (in a resumed run too, before
   the checkpoint is restored: what a later resume rebuilds) the loop keeps a copy of every checked callback — so a
   value derived from the configuration belongs in ``setup_federation``, not ``on_federation_start``; at every
   checkpoint it loads the callback's ``state_dict()`` (the one being saved) into a
   fresh copy of that version and compares the plain attributes — numbers, strings, ``None``, tensors, numpy arrays
   and lists/tuples/dicts/sets/deques of them, and objects of the user's own classes holding such data (a counter, a
   history) — with the live callback's, by value. Attributes holding other objects (modules, a library's objects:
   messages, contexts, generators) are not compared; an attribute the callback did not have after
   ``setup_federation`` counts unless it is ``None`` or an empty container. The copy shares the loop, its model
   (and its parameters and buffers), its data and the loop's other parts with the live callback instead of
   copying them; an attribute that cannot be deep-copied is shared too.

What is checked: every :class:`~pl_fedsparse.callbacks.base.FederatedCallback` and every plain
``lightning.Callback`` in ``trainer.callbacks`` whose class is not Lightning's own (``lightning.*``,
``pytorch_lightning.*``: they keep internal state by design and are not written against this contract).

Declaring what is allowed: a callback class lists, in ``scratch_attributes``, attributes that hold nothing a later
fit or round needs — state of the current fit (its context, device copies, a value cached in ``on_fit_start``) or
values recomputed before they are read (the last evaluation's figures); both checks skip them, and the resume
check also skips ``driver_only_attributes``.
"""

from __future__ import annotations

import collections
import copy
import enum
import logging
import math
from collections.abc import Iterable, Mapping
from typing import TYPE_CHECKING, Any, Literal

import lightning.pytorch as pl
import numpy as np
import torch
from torch import Tensor

from pl_fedsparse.errors import ConfigError

if TYPE_CHECKING:
    from pl_fedsparse.context import FitContext
    from pl_fedsparse.view import FederationView

__all__ = ["CONTRACT_MODES", "CallbackContract", "CallbackContractError", "FitWatch", "ResumeCheck",
           "checked_callbacks", "fit_fingerprint", "plain_equal", "scratch_attributes"]

log = logging.getLogger(__name__)

ContractMode = Literal["error", "warn"]
CONTRACT_MODES: tuple[str, ...] = ("error", "warn")
#: how deep a fit fingerprint looks into nested containers, and how many items of one it reads
FIT_DEPTH, FIT_ITEMS = 3, 256
#: numpy arrays up to this many bytes are fingerprinted by content, larger ones by identity and shape
_ARRAY_BYTES = 512
_SCALARS = (int, float, complex, str, bytes, bool, type(None))
_OWN_MODULES = ("lightning.", "pytorch_lightning.", "lightning_fabric.")
#: attributes Lightning itself sets on every callback of a Trainer (the module's logging methods)
_FRAMEWORK_ATTRIBUTES = frozenset({"log", "log_dict"})


class CallbackContractError(ConfigError):
    """A callback broke a rule of the callback contract (``trainer.callback_contract: error``)."""


# ---------------------------------------------------------------------------------------------------- which, what
def checked_callbacks(callbacks: Iterable[pl.Callback]) -> list[pl.Callback]:
    """The callbacks the contract checks: federated ones, and plain Lightning callbacks not from Lightning itself."""
    from pl_fedsparse.callbacks.base import FederatedCallback

    out = []
    for cb in callbacks:
        if isinstance(cb, FederatedCallback) or not type(cb).__module__.startswith(_OWN_MODULES):
            out.append(cb)
    return out


def scratch_attributes(callback: Any) -> frozenset[str]:
    """The attributes ``callback``'s class declares as scratch (``scratch_attributes``, over the whole MRO), and
    those Lightning sets on every callback (``log``, ``log_dict``)."""
    names: set[str] = set(_FRAMEWORK_ATTRIBUTES)
    for klass in type(callback).__mro__:
        names.update(vars(klass).get("scratch_attributes", ()))
    return frozenset(names)


# ---------------------------------------------------------------------------------------------------- rule 1: fits
def fit_fingerprint(value: Any, keep: list[Any], depth: int = FIT_DEPTH) -> Any:
    """A cheap, comparable fingerprint of ``value`` (see the module docstring); objects it names by identity are
    appended to ``keep``, which the caller holds so that their ids cannot be reused meanwhile.

    Example:
        >>> keep = []
        >>> t = torch.zeros(2)
        >>> a = fit_fingerprint({"n": 1, "t": t, "xs": [1.5, "a"]}, keep)
        >>> _ = t.add_(1)  # in place: a new version
        >>> a == fit_fingerprint({"n": 1, "t": t, "xs": [1.5, "a"]}, keep)
        False
    """
    kind = type(value)
    if kind in _SCALARS:
        return "nan" if kind is float and math.isnan(value) else value
    if isinstance(value, Tensor):
        keep.append(value)
        return ("t", id(value), value._version, tuple(value.shape))
    if isinstance(value, (dict, list, tuple, set, frozenset)):
        if depth <= 0 or len(value) > FIT_ITEMS:
            keep.append(value)
            return ("c", id(value), len(value))
        if isinstance(value, dict):
            return ("d", tuple((k if type(k) in _SCALARS else id(k), fit_fingerprint(v, keep, depth - 1))
                               for k, v in value.items()))
        if isinstance(value, (set, frozenset)):
            return ("s", frozenset(fit_fingerprint(v, keep, 0) for v in value))
        return ("l", tuple(fit_fingerprint(v, keep, depth - 1) for v in value))
    if isinstance(value, np.ndarray):
        keep.append(value)
        small = value.nbytes <= _ARRAY_BYTES and value.dtype != object
        return ("a", id(value), value.shape, value.tobytes() if small else None)
    if isinstance(value, (np.generic, enum.Enum)):
        return ("v", value)
    keep.append(value)
    return ("o", id(value))


def _pin(tree: Mapping[str, Any], prefix: str = "") -> list[tuple[str, Tensor, int]]:
    """Every tensor of a client-state tree with its version counter (bumped by each in-place write)."""
    out: list[tuple[str, Tensor, int]] = []
    for key, value in tree.items():
        if isinstance(value, Tensor):
            out.append((prefix + str(key), value, value._version))
        elif isinstance(value, Mapping):
            out.extend(_pin(value, f"{prefix}{key}/"))
    return out


class FitWatch:
    """The instance attributes of ``callbacks`` before a fit (:meth:`changed` compares them after it), and the
    version counters of the client's stored state tensors (:meth:`written_in_place`)."""

    __slots__ = ("_before", "_keep", "_pinned")

    def __init__(self, callbacks: Iterable[pl.Callback], client_state: Mapping[str, Any] | None = None) -> None:
        self._keep: list[Any] = []
        self._before = [(cb, self._prints(cb)) for cb in callbacks]
        self._pinned = _pin(client_state or {})

    def written_in_place(self) -> list[str]:
        """Client-state entries whose stored tensors were written in place since the watch began (a fit reads
        private copies and replaces entries with ``set_client_state``: the stored objects never change)."""
        return [name for name, t, version in self._pinned if t._version != version]

    def _prints(self, callback: Any) -> dict[str, Any]:
        skip, keep = scratch_attributes(callback), self._keep
        attrs = getattr(callback, "__dict__", {})
        return {k: fit_fingerprint(v, keep) for k, v in attrs.items() if k not in skip}

    def changed(self) -> list[tuple[Any, str]]:
        """``(callback, attribute)`` for every attribute set, changed or deleted since the watch began."""
        out = []
        for cb, before in self._before:
            after = self._prints(cb)
            if after != before:
                out += [(cb, k) for k in sorted(set(before) | set(after)) if before.get(k, _MISSING) !=
                        after.get(k, _MISSING)]
        self._keep = []
        return out


class _Missing:
    def __repr__(self) -> str:
        return "<missing>"


_MISSING: Any = _Missing()


# ---------------------------------------------------------------------------------------------------- rule 2: resume
def _plain(value: Any, depth: int = 8) -> bool:
    """Whether ``value`` is plain data the resume check compares (scalars, tensors, arrays, containers of them)."""
    if type(value) in _SCALARS or isinstance(value, (Tensor, np.ndarray, np.generic, enum.Enum)):
        return not (isinstance(value, np.ndarray) and value.dtype == object)
    if depth <= 0:
        return False
    if isinstance(value, dict):
        return all(type(k) in _SCALARS for k in value) and all(_plain(v, depth - 1) for v in value.values())
    if isinstance(value, (list, tuple, set, frozenset, collections.deque)):
        return all(_plain(v, depth - 1) for v in value)
    return _record_object(value) and _plain(vars(value), depth - 1)


#: packages whose objects are the engine's or a library's (modules, messages, contexts, generators): not compared
_FOREIGN_PACKAGES = ("pl_fedsparse", "torch", "lightning", "pytorch_lightning", "lightning_fabric", "numpy",
                     "builtins", "collections", "typing", "functools", "threading", "logging", "ray")


def _record_object(value: Any) -> bool:
    """An instance of the user's own class holding data in its ``__dict__`` (a small helper object: a counter, a
    history), compared by its class and attributes; not a class, function or module, not a library's object."""
    cls = type(value)
    return (hasattr(value, "__dict__") and not isinstance(value, (type, torch.nn.Module)) and not callable(value)
            and cls.__module__.split(".")[0] not in _FOREIGN_PACKAGES and not hasattr(cls, "__slots__"))


def _empty(value: Any) -> bool:
    return value is None or (isinstance(value, (dict, list, tuple, set, frozenset, collections.deque))
                             and len(value) == 0)


def plain_equal(a: Any, b: Any) -> bool:
    """Value equality of plain data (NaN equals NaN; tensors and arrays element-wise, with their shape and dtype).

    Example:
        >>> plain_equal({"w": torch.ones(2), "n": [1, float("nan")]}, {"w": torch.ones(2), "n": [1, float("nan")]})
        True
        >>> plain_equal(torch.ones(2), torch.ones(3))
        False
    """
    if isinstance(a, Tensor) or isinstance(b, Tensor):
        if not (isinstance(a, Tensor) and isinstance(b, Tensor)) or a.shape != b.shape or a.dtype != b.dtype:
            return False
        if a is b:
            return True
        a, b = a.detach().cpu(), b.detach().cpu()
        if a.is_floating_point() or a.is_complex():
            return bool(torch.equal(torch.nan_to_num(a, nan=0.0), torch.nan_to_num(b, nan=0.0))
                        and torch.equal(torch.isnan(a), torch.isnan(b)))
        return bool(torch.equal(a, b))
    if isinstance(a, np.ndarray) or isinstance(b, np.ndarray):
        if not (isinstance(a, np.ndarray) and isinstance(b, np.ndarray)) or a.shape != b.shape or a.dtype != b.dtype:
            return False
        return bool(np.array_equal(a, b, equal_nan=a.dtype.kind in "fc"))
    if isinstance(a, dict) or isinstance(b, dict):
        return (isinstance(a, dict) and isinstance(b, dict) and a.keys() == b.keys()
                and all(plain_equal(v, b[k]) for k, v in a.items()))
    if isinstance(a, (list, tuple, collections.deque)) or isinstance(b, (list, tuple, collections.deque)):
        return (isinstance(a, (list, tuple, collections.deque)) and isinstance(b, (list, tuple, collections.deque))
                and len(a) == len(b) and all(plain_equal(x, y) for x, y in zip(a, b)))
    if isinstance(a, (set, frozenset)) or isinstance(b, (set, frozenset)):
        return isinstance(a, (set, frozenset)) and isinstance(b, (set, frozenset)) and a == b
    if isinstance(a, float) and isinstance(b, float) and math.isnan(a) and math.isnan(b):
        return True
    if _record_object(a) or _record_object(b):
        return type(a) is type(b) and plain_equal(vars(a), vars(b))
    try:
        return bool(a == b)
    except Exception:  # noqa: BLE001 - an exotic scalar: count it as changed
        return False


def _shared(loop: FederationView) -> dict[int, Any]:
    """``deepcopy`` memo entries that make a callback's copy share the loop and its big parts with the original."""
    shared: list[Any] = [loop, *vars(loop).values(), *loop.callbacks]
    if loop.model is not None:
        shared += [*loop.model.modules(), *loop.model.parameters(), *loop.model.buffers()]
    for state in (loop.initial_state, loop.global_state or {}):
        shared += list(state.values())
    return {id(x): x for x in shared}


def _copy_callback(callback: Any, shared: Mapping[int, Any]) -> Any:
    memo = dict(shared)
    clone = copy.copy(callback)  # a new instance; its attributes replaced one by one below
    attrs = vars(clone)
    for k, v in vars(callback).items():
        try:
            attrs[k] = copy.deepcopy(v, memo)
        except Exception:  # noqa: BLE001 - cannot be copied (a lock, a generator, ...): shared
            attrs[k] = v
    return clone


class ResumeCheck:
    """The callbacks as ``setup_federation`` left them, and the check that a save → load round trip reproduces them."""

    def __init__(self) -> None:
        self._initial: list[tuple[Any, Any]] = []

    def snapshot(self, loop: FederationView) -> None:
        """Keep a copy of every checked callback (call right after ``setup_federation``)."""
        shared = _shared(loop)
        self._initial = []
        for cb in checked_callbacks(loop.callbacks):
            try:
                self._initial.append((cb, _copy_callback(cb, shared)))
            except Exception as e:  # noqa: BLE001 - a callback that cannot be copied at all is not checked
                log.debug("callback contract: %s cannot be copied (%s); its state is not checked on save",
                          type(cb).__name__, e)

    def unsaved(self, loop: FederationView, states: Mapping[str, Any]) -> list[tuple[Any, str]]:
        """``(callback, attribute)`` for every plain attribute a load of ``states[cb.state_key]`` would not restore."""
        if not self._initial:
            return []
        shared = _shared(loop)
        out = []
        for cb, initial in self._initial:
            if cb.state_key not in states:
                continue
            state = states[cb.state_key]
            if type(cb).load_state_dict is not pl.Callback.load_state_dict:
                try:
                    resumed = _copy_callback(initial, shared)  # load_state_dict may change it in place
                    resumed.load_state_dict(state)
                except Exception as e:  # noqa: BLE001 - not this check's business (the resume will say)
                    log.debug("callback contract: %s.load_state_dict of a copy failed (%s)", type(cb).__name__, e)
                    continue
            else:
                resumed = initial
            skip = scratch_attributes(cb) | set(getattr(cb, "driver_only_attributes", ()))
            theirs = vars(resumed)
            for name, value in vars(cb).items():
                if name in skip or not _plain(value):
                    continue
                before = theirs.get(name, _MISSING)
                if before is _MISSING:
                    if not _empty(value):
                        out.append((cb, name))
                elif _plain(before) and not plain_equal(value, before):
                    out.append((cb, name))
        return out


# ---------------------------------------------------------------------------------------------------- the switch
def _fit_message(callback: Any, attr: str, context: FitContext | None) -> str:
    name = type(callback).__name__
    where = (f" (client {context.client_idx}'s {context.kind} fit, round {context.round_idx})"
             if context is not None else "")
    return (f"trainer.callbacks is invalid: {name}.{attr} changed during a fit{where}, and a change made during a fit "
            "never reaches the driver from an out-of-process worker (trainer.executor: RayExecutor); expected "
            "per-client results in client state (add_client_state/set_client_state), values for the server in "
            "update.extras (read in on_before_aggregate), cross-round state changed in driver hooks "
            f"(on_before_aggregate, on_after_aggregate, on_round_end); per-fit scratch goes in {name}."
            "scratch_attributes (trainer.callback_contract: warn only warns)")


def _client_state_message(name: str, context: FitContext) -> str:
    return (f"trainer.callbacks is invalid: client state {name!r} of client {context.client_idx} was changed in place "
            f"during its {context.kind} fit (round {context.round_idx}), so a failed fit could not be rolled back and "
            "an out-of-process worker would not send the change back; expected the value read with "
            "get_client_state (a private copy during a fit) and written with set_client_state")


def _resume_message(callback: Any, attr: str) -> str:
    name = type(callback).__name__
    return (f"trainer.callbacks is invalid: {name}.{attr} changed since setup_federation but {name}.state_dict() "
            "does not restore it, so a resumed run would continue with another value; expected it saved by "
            f"state_dict/load_state_dict, or kept as client state (add_client_state); a value recomputed before "
            f"every use goes in {name}.scratch_attributes (trainer.callback_contract: warn only warns)")


class CallbackContract:
    """The loop's contract checker: the mode, the warnings given, and the callbacks' post-setup copies.

    A worker of an out-of-process executor receives it with the loop (without the copies: only the driver checks
    checkpoints); its fits are checked there and a violation comes back to the driver as the error (under ``warn``,
    each worker logs its own warnings, once per worker process).
    """

    def __init__(self, mode: ContractMode = "error") -> None:
        self.mode = mode
        self.warned: set[tuple[str, str]] = set()
        self.resume = ResumeCheck()

    def __getstate__(self) -> dict[str, Any]:
        return {"mode": self.mode, "warned": set(), "resume": ResumeCheck()}

    def __setstate__(self, state: dict[str, Any]) -> None:
        vars(self).update(state)

    def watch(self, callbacks: Iterable[pl.Callback], client_state: Mapping[str, Any] | None = None) -> FitWatch:
        """Start watching a fit (the callbacks' attributes and the client's stored state)."""
        return FitWatch(checked_callbacks(callbacks), client_state)

    def check_fit(self, watch: FitWatch, context: FitContext | None) -> None:
        """Report the attributes changed since ``watch`` began."""
        self._report([(type(cb).__qualname__, a, _fit_message(cb, a, context)) for cb, a in watch.changed()])

    def check_client_state(self, watch: FitWatch, context: FitContext) -> None:
        """Report stored client state written in place since ``watch`` began (checked after faulted fits too: such
        a write would defeat their rollback)."""
        self._report([("client_state", name, _client_state_message(name, context))
                      for name in watch.written_in_place()])

    def check_checkpoint(self, loop: FederationView, states: Mapping[str, Any]) -> None:
        """Report the plain attributes a resume from ``states`` (the checkpoint's callback states) would not restore."""
        unsaved = self.resume.unsaved(loop, states)
        self._report([(type(cb).__qualname__, a, _resume_message(cb, a)) for cb, a in unsaved])

    def _report(self, found: list[tuple[str, str, str]]) -> None:
        """``(owner, attribute, message)`` each: raise the first (``error``) or warn once per owner and attribute."""
        if not found:
            return
        if self.mode == "error":
            raise CallbackContractError(found[0][2])
        for owner, attr, message in found:
            key = (owner, attr)  # once per attribute, whichever rule (a fit's change is unsaved too)
            if key not in self.warned:
                self.warned.add(key)
                log.warning("%s", message.replace("trainer.callbacks is invalid: ", "callback contract: ", 1))
