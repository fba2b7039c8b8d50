"""``data.name: tensors``: a ``.pt`` or ``.npz`` file of tensors (any input shape, optional per-sample client ids)."""

from __future__ import annotations

import logging
import os
import pickle
import warnings
import zipfile
from typing import Any

import numpy as np
import torch

from pl_fedsparse.data.base import BaseDataset, channel_stats, input_kind
from pl_fedsparse.data.sources._common import held_out_split
from pl_fedsparse.errors import ConfigError, DataNotFoundError, check

__all__ = ["TENSOR_KEYS"]

log = logging.getLogger(__name__)


#: the keys a ``tensors`` file may hold
TENSOR_KEYS = ("train_x", "train_y", "test_x", "test_y", "x", "y", "train_client", "test_client", "client",
               "num_classes", "mean", "std")


# ----------------------------------------------------------------------------------------------- tensors
def _read_tensor_file(path: str) -> dict[str, Any]:
    suffix = os.path.splitext(path)[1].lower()
    expected = ("a .pt file saved with torch.save({'train_x': ..., 'train_y': ..., 'test_x': ..., 'test_y': ...}) "
                "(tensors only) or an .npz file with those arrays")
    check(suffix in (".pt", ".pth", ".npz"), "data.root", path, f"{expected} for data.name='tensors'")
    try:
        if suffix == ".npz":
            with np.load(path, allow_pickle=False) as npz:
                blob: Any = {k: npz[k] for k in npz.files}
        else:
            if zipfile.is_zipfile(path):  # (torch.load does not check the members' CRCs: a damaged byte loads)
                with zipfile.ZipFile(path) as archive:
                    damaged = archive.testzip()
                if damaged is not None:
                    raise ValueError(f"its member {damaged!r} fails its CRC check: the file is damaged")
            with warnings.catch_warnings():  # (torch warns about a foreign pickle protocol: the error says it)
                warnings.simplefilter("ignore")
                blob = torch.load(path, map_location="cpu", weights_only=True)
    except (OSError, ValueError, RuntimeError, EOFError, pickle.UnpicklingError, zipfile.BadZipFile) as exc:
        why = " ".join(str(exc).split())[:200] or type(exc).__name__
        if "allow_pickle" in why:  # (numpy's hint to unpickle it would run the file's code: never taken)
            why = "not an archive of arrays: numpy would have to unpickle it, which pl_fedsparse never does"
        raise ConfigError(f"data.root={path!r} is invalid: cannot read it ({why}); expected {expected}") from None
    check(isinstance(blob, dict), "data.root", path, f"{expected} (it holds a {type(blob).__name__}, not a dict)")
    for key in blob:
        check(key in TENSOR_KEYS, "data.root", path, f"keys among {', '.join(TENSOR_KEYS)} (it has {key!r})")
    return blob


def _as_tensor(value: Any, key: str, path: str) -> torch.Tensor:
    """The file's array ``key`` as a tensor; one line naming it when it holds no numbers (e.g. strings), or is a
    tensor without values here (sparse, quantised, on the ``meta`` device)."""
    if isinstance(value, torch.Tensor):
        if value.layout != torch.strided or value.is_meta or value.is_quantized:
            kind = "meta" if value.is_meta else "quantized" if value.is_quantized else str(value.layout).split(".")[-1]
            raise ConfigError(f"data.root={path!r} is invalid: its {key} is a {kind} tensor; expected dense tensors "
                              "with their values (save x.to_dense(), or the tensor itself, not a meta copy)")
        return value
    arr = np.asarray(value)
    try:
        return torch.as_tensor(arr)
    except (TypeError, ValueError, RuntimeError):
        raise ConfigError(f"data.root={path!r} is invalid: its {key} holds {arr.dtype} values; expected numbers "
                          "(integer labels and client ids, float features, uint8 images or integer token ids)"
                          ) from None


def _load_tensors(root: str | None, test_fraction: float, seed: int) -> BaseDataset:
    check(root is not None, "data.root", root, "the .pt or .npz file for data.name='tensors'")
    assert root is not None
    if not os.path.isfile(root):
        raise DataNotFoundError(f"data.root={root!r} is invalid: expected an existing .pt or .npz file for "
                                f"data.name='tensors'")
    blob = {k: (v if k == "num_classes" else _as_tensor(v, k, root)) for k, v in _read_tensor_file(root).items()}
    if "x" in blob or "y" in blob:
        check("x" in blob and "y" in blob and not {"train_x", "train_y", "test_x", "test_y"} & set(blob),
              "data.root", root, "either x and y (split by data.test_fraction) or train_x, train_y, test_x and test_y")
        check(len(blob["x"]) == len(blob["y"]), "data.root", root,
              f"x and y of one length (got {len(blob['x'])} and {len(blob['y'])})")
        client = blob.pop("client", None)
        check(client is None or len(client) == len(blob["x"]), "data.root", root,
              f"one client id per sample: client of length {len(client) if client is not None else 0} and x, y "
              f"of length {len(blob['x'])}")
        groups = (client if client is not None else blob["y"]).numpy()
        train, test = held_out_split(groups, test_fraction, seed)
        x, y = blob.pop("x"), blob.pop("y")
        tr, te = torch.from_numpy(train), torch.from_numpy(test)
        blob.update(train_x=x[tr], train_y=y[tr], test_x=x[te], test_y=y[te])
        if client is not None:
            blob.update(train_client=client[tr], test_client=client[te])
    else:
        missing = [k for k in ("train_x", "train_y", "test_x", "test_y") if k not in blob]
        check(not missing and "client" not in blob, "data.root", root,
              f"train_x, train_y, test_x and test_y (or x and y) with train_client/test_client ids (missing "
              f"{', '.join(missing) or 'nothing'}{'; client needs x and y' if 'client' in blob else ''})")
    labels = torch.cat([blob["train_y"].reshape(-1), blob["test_y"].reshape(-1)])
    num_classes: Any = blob.get("num_classes")
    if num_classes is None:  # float labels are refused by the validation, with a better message
        num_classes = int(labels.max()) + 1 if labels.numel() and not labels.is_floating_point() else 1
        if labels.numel() and not labels.is_floating_point() and int(labels.min()) > 0:
            log.warning("data.root=%r: its labels start at %d, so class 0 has no sample and num_classes is taken as "
                        "%d (the largest label + 1); relabel from 0, or give num_classes in the file",
                        root, int(labels.min()), num_classes)
    else:
        arr = np.asarray(num_classes)
        num_classes = int(arr) if arr.size == 1 and np.issubdtype(arr.dtype, np.integer) else num_classes
    mean = tuple(float(v) for v in blob["mean"].reshape(-1)) if "mean" in blob else None
    std = tuple(float(v) for v in blob["std"].reshape(-1)) if "std" in blob else None
    x_train = blob["train_x"]
    if mean is None and std is None and input_kind(x_train) == "image":
        mean, std = channel_stats(x_train)
    return BaseDataset("tensors", x_train, blob["train_y"], blob["test_x"], blob["test_y"], num_classes, mean, std,
                       blob.get("train_client"), blob.get("test_client"))
