"""Atomic writes and safe loads of federation checkpoints and run files.

A checkpoint is written to a temporary file in the target directory (``.<name>.<random>.tmp``), flushed to disk,
given the permissions the process umask asks for and renamed over the target (``os.replace`` is atomic on POSIX), so
a crash leaves either the old or the new file, never half of one (and at worst a stale ``.*.tmp`` file, which the
next run in the directory removes). Loading uses ``torch.load(weights_only=True)``: only tensors and plain
containers are unpickled, never arbitrary objects.
"""

from __future__ import annotations

import json
import pickle
import random
import re
import warnings
import zipfile
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np
import torch

from pl_fedsparse.errors import CheckpointError, user_code
from pl_fedsparse.run.atomic import _atomic, dumps_json

if TYPE_CHECKING:
    from pl_fedsparse.view import FederationView

__all__ = ['FORMAT', 'federation_state', 'fingerprint', 'load_checkpoint', 'restore_federation', 'save_checkpoint']


FORMAT = "pl_fedsparse.checkpoint/2"  # 2: accounting in one entry, every client state created at start


def save_checkpoint(path: str | Path, state: dict[str, Any]) -> None:
    """Save a checkpoint dict atomically (``state`` must hold only tensors and plain containers)."""
    _atomic(Path(path), lambda f: torch.save({"format": FORMAT, **state}, f))


def load_checkpoint(path: str | Path, param: str = "ckpt_path") -> dict[str, Any]:
    """Load a checkpoint written by :func:`save_checkpoint`, without executing code.

    The returned state also holds ``loaded_from`` (:data:`LOADED_FROM`): the path it was read from.

    Raises:
        CheckpointError: one line naming ``param`` and the path, when the file is missing, corrupted, not a
            pl_fedsparse checkpoint, or holds objects other than tensors and plain containers.
    """
    p = Path(path)
    if not p.is_file():
        raise CheckpointError(f"{param}={str(path)!r} is invalid: expected an existing checkpoint file")
    damaged = _damaged_member(p, param)
    if damaged:
        raise CheckpointError(f"{param}={str(path)!r} is invalid: expected a readable pl_fedsparse checkpoint "
                              f"(the file is corrupted: {damaged}); resume from an earlier one "
                              "(checkpoints/round-*.ckpt)")
    try:
        with warnings.catch_warnings():  # (torch warns about a foreign pickle protocol: the one line says it all)
            warnings.simplefilter("ignore")
            state = torch.load(p, map_location="cpu", weights_only=True)
    except (RuntimeError, EOFError, pickle.UnpicklingError, zipfile.BadZipFile, ValueError, OSError, KeyError,
            IndexError, TypeError, AttributeError, UnicodeDecodeError) as e:  # (a file that is no checkpoint)
        unsafe = _unsafe_content(e)
        if unsafe is not None:
            raise CheckpointError(
                f"{param}={str(path)!r} is invalid: expected a pl_fedsparse checkpoint of tensors and plain "
                f"containers, found {unsafe}; pl_fedsparse never executes code from a checkpoint, so this file "
                f"cannot be loaded (it was not written by pl_fedsparse, or was altered)"
            ) from None
        raise CheckpointError(
            f"{param}={str(path)!r} is invalid: expected a readable pl_fedsparse checkpoint "
            f"(the file is corrupted: {_failure(e)})"
        ) from None
    if not isinstance(state, dict) or state.get("format") != FORMAT:
        found = state.get("format") if isinstance(state, dict) else type(state).__name__
        raise CheckpointError(
            f"{param}={str(path)!r} is invalid: expected a {FORMAT} checkpoint, found {found!r}"
        )
    state[LOADED_FROM] = str(path)
    return state


def _damaged_member(path: Path, param: str) -> str:
    """Why ``path`` is not an intact checkpoint archive, or ``""``: :func:`torch.save` writes a zip archive with a
    CRC-32 of every member, which ``torch.load`` does not verify — a flipped byte in the weights would load as other
    weights and resume another run. Checked here: the archive, then every member against its CRC (one read)."""
    try:
        if not zipfile.is_zipfile(path):
            return "not a zip archive, as pl-fed fit writes its checkpoints"
        with zipfile.ZipFile(path) as archive:
            bad = archive.testzip()
    except (zipfile.BadZipFile, zipfile.LargeZipFile, EOFError, ValueError, NotImplementedError) as e:
        return f"{type(e).__name__}: {_first_line(e)}"
    except OSError as e:  # (unreadable: permissions, I/O error)
        raise CheckpointError(f"{param}={str(path)!r} is invalid: expected a readable checkpoint file "
                              f"({e.strerror or e})") from None
    return f"archive member {bad!r} fails its CRC check" if bad else ""


#: key :func:`load_checkpoint` adds to the state it returns: the path it was read from (never saved)
LOADED_FROM = "loaded_from"


def _unsafe_content(e: BaseException) -> str | None:
    """What a ``weights_only`` load refused (``"a pickled Python object (posix.system)"``), or ``None`` when ``e``
    names no Python object (a corrupted or truncated file). torch's own advice (load with ``weights_only=False``,
    allowlist the global) is left out: it would execute the file's code."""
    found = re.search(r"\bGLOBAL ([\w.]+)", _plain(e))  # "Unsupported global: GLOBAL x", "unsupported GLOBAL x .."
    return f"a pickled Python object ({found.group(1)})" if found else None


def _failure(e: BaseException) -> str:
    """Why a load failed, in a few words: torch's own reason for a refused ``weights_only`` load (``Unsupported
    operand 110`` for bytes that are no pickle), without its advice to load unsafely; else the first line."""
    text = _plain(e)
    if "Weights only load failed" not in text and "WeightsUnpickler error" not in text:
        return _first_line(e)
    detail = text.split("WeightsUnpickler error:", 1)[1] if "WeightsUnpickler error:" in text else ""
    lines = [x.strip() for x in detail.splitlines() if x.strip() and not x.startswith("Check the documentation")]
    return lines[0].split(" Please use ")[0].rstrip(".") if lines else "not a plain pickle of tensors"


def _plain(e: BaseException) -> str:
    """``e``'s message without terminal colour codes."""
    return re.sub(r"\x1b\[[0-9;]*m", "", str(e))


def _first_line(e: BaseException) -> str:
    """The whole first non-empty line of an exception's message (or its type)."""
    lines = [x.strip() for x in str(e).splitlines() if x.strip()]
    return lines[0] if lines else type(e).__name__


# ---------------------------------------------------------------------------------------------- federation state
def fingerprint(loop: FederationView) -> dict[str, Any]:
    """What a checkpoint must agree with to be resumed by this configuration."""
    assert loop.model is not None
    return {
        "data": loop.datamodule.fingerprint(),
        "model": type(getattr(loop.model, "backbone", loop.model)).__name__,
        "shapes": {k: list(v.shape) for k, v in loop.initial_state.items()},
        "callbacks": [type(c).__name__ for c in loop.fed_callbacks],
        "topology": type(loop.topology).__name__,
        "seed": loop.seed,
    }


def federation_state(loop: FederationView) -> dict[str, Any]:
    """Everything needed to continue the federation: round, global state, every client's declared state, callback
    state, accounting, history and the global RNG states (tensors and plain containers only); and what makes it
    *this run*: the run id, the run directory, the resolved configuration and the resumes so far."""
    reporter = loop.reporter
    callbacks = {}
    for cb in loop.callbacks:  # the user's code: what a state_dict raises is one line naming it
        with user_code(cb, "state_dict", f"saving the checkpoint after {loop.round_idx} round(s)"):
            callbacks[cb.state_key] = cb.state_dict()
    return {
        "run_id": reporter.run_id,
        "run_dir": str(reporter.run_dir) if reporter.run_dir is not None else None,
        "config": loop.config_text,
        "resumes": dumps_json(reporter.resumes),
        "round": loop.round_idx,
        "fingerprint": dumps_json(fingerprint(loop)),
        "global_state": loop.global_state,
        "client_store": loop.client_store.state_dict(),
        "callbacks": callbacks,
        "accounting": loop.accounting.state_dict(),
        "time_cum": loop.time_cum,
        "history": dumps_json(loop.history),
        "last_client_acc": list(loop.last_client_acc),
        "rng": _global_rng_state(),
    }


def _global_rng_state() -> dict[str, Any]:
    """The global generators' states as tensors and plain numbers (a checkpoint loads without executing code):
    torch's CPU generator, Python's Mersenne Twister with its kept normal draw (``random.gauss``'s second of a pair)
    and numpy's legacy generator with its kept normal draw (``has_gauss``, ``cached_gaussian``); without the kept
    draws a resumed run's next normal draw from user code would differ from the uninterrupted run's."""
    _, py_state, py_gauss = random.getstate()
    legacy: Any = np.random.get_state(legacy=True)  # ("MT19937", keys, pos, has_gauss, cached_gaussian)
    _, keys, pos, has_gauss, cached = legacy
    return {"torch": torch.get_rng_state(), "python": py_state, "python_gauss": py_gauss,
            "numpy": torch.from_numpy(keys.astype(np.int64)), "numpy_pos": int(pos),
            "numpy_gauss": [int(has_gauss), float(cached)]}


def _set_global_rng_state(rng: dict[str, Any]) -> None:
    """:func:`_global_rng_state`'s inverse; a checkpoint written before the kept normal draws were saved restores
    none kept."""
    torch.set_rng_state(rng["torch"])
    gauss = rng.get("python_gauss")
    random.setstate((3, tuple(rng["python"]), None if gauss is None else float(gauss)))
    has_gauss, cached = rng.get("numpy_gauss", (0, 0.0))
    np.random.set_state(("MT19937", rng["numpy"].numpy().astype(np.uint32), int(rng["numpy_pos"]), int(has_gauss),
                         float(cached)))


def _first_difference(a: Any, b: Any, path: str = "") -> str:
    if isinstance(a, dict) and isinstance(b, dict):
        for k in sorted(set(a) | set(b)):
            if a.get(k) != b.get(k):
                return _first_difference(a.get(k), b.get(k), f"{path}.{k}" if path else k)
    return f"{path}: {a!r} in the checkpoint vs {b!r} now"


def restore_federation(loop: FederationView, ckpt: dict[str, Any], ckpt_path: str) -> dict[str, Any]:
    """Restore :func:`federation_state` after checking its fingerprint against ``loop``: the state of the loop's
    parts (client store, callbacks, accounting) and the RNG states are loaded here; the federation's own progress is
    returned for the loop to take (``round_idx``, ``global_state``, ``time_cum``, ``history``,
    ``last_client_acc``). One-line errors."""
    try:
        theirs = json.loads(ckpt["fingerprint"])
        mine = json.loads(dumps_json(fingerprint(loop)))
        if theirs != mine:
            raise CheckpointError(
                f"ckpt_path={ckpt_path!r} is invalid: it was written by another configuration "
                f"({_first_difference(theirs, mine)}); expected a checkpoint of this run (resume with the run's "
                "config.yaml)")
        progress: dict[str, Any] = {"round_idx": int(ckpt["round"]), "global_state": ckpt["global_state"]}
        loop.client_store.load_state_dict(ckpt["client_store"])
        for cb in loop.callbacks:
            if cb.state_key in ckpt["callbacks"]:
                cb.load_state_dict(ckpt["callbacks"][cb.state_key])
        loop.accounting.load_state_dict(ckpt["accounting"])
        progress["time_cum"] = float(ckpt["time_cum"])
        progress["history"] = json.loads(ckpt["history"])
        progress["last_client_acc"] = list(ckpt["last_client_acc"])
        _set_global_rng_state(ckpt["rng"])
    except CheckpointError:
        raise
    except (KeyError, TypeError, ValueError, RuntimeError) as e:
        raise CheckpointError(f"ckpt_path={ckpt_path!r} is invalid: expected a complete pl_fedsparse "
                              f"checkpoint ({type(e).__name__}: {_first_line(e)})") from None
    if progress["round_idx"] > loop.num_rounds:
        raise CheckpointError(f"trainer.num_rounds={loop.num_rounds} is invalid: expected >= the checkpoint's "
                              f"completed rounds ({progress['round_idx']})")
    return progress
