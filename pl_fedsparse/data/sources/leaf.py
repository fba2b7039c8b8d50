"""``data.name: leaf``: LEAF's per-user JSON files, one natural client per user."""

from __future__ import annotations

import json
import os
from pathlib import Path

import numpy as np
import torch

from pl_fedsparse.data.base import BaseDataset
from pl_fedsparse.data.cache import _cached
from pl_fedsparse.errors import ConfigError, DataNotFoundError, check

__all__ = ["LEAF_LETTERS"]


#: LEAF's Shakespeare alphabet (``models/utils/language_utils.py``): a character's id is its index here
LEAF_LETTERS = "\n !\"&'(),-.0123456789:;>?ABCDEFGHIJKLMNOPQRSTUVWXYZ[]abcdefghijklmnopqrstuvwxyz}"


# ----------------------------------------------------------------------------------------------- LEAF
def _leaf_ids(values: list, root: str, what: str) -> np.ndarray:
    ids = [LEAF_LETTERS.find(c) for c in "".join(values)]
    if min(ids, default=0) < 0:
        bad = next(c for c in "".join(values) if LEAF_LETTERS.find(c) < 0)
        raise ConfigError(f"data.root={root!r} is invalid: {what} has the character {bad!r}; expected characters of "
                          f"LEAF's alphabet {LEAF_LETTERS!r}")
    return np.asarray(ids, dtype=np.int64)


def _leaf_arrays(xs: list, ys: list, root: str) -> tuple[torch.Tensor, torch.Tensor]:
    if xs and isinstance(xs[0], str):  # Shakespeare: one string of characters per sample
        lengths = {len(s) for s in xs}
        check(len(lengths) == 1, "data.root", root, f"LEAF x strings of one length (got {sorted(lengths)[:3]})")
        x = torch.from_numpy(_leaf_ids(xs, root, "an x string").reshape(len(xs), -1))
    else:
        try:
            arr = np.asarray(xs)
        except ValueError:
            arr = np.asarray([], dtype=object)
        check(arr.dtype != object and (np.issubdtype(arr.dtype, np.number) or len(xs) == 0), "data.root", root,
              "LEAF x values that are numbers, equally long lists of numbers, or strings of one length")
        x = torch.from_numpy(arr.astype(np.float32) if np.issubdtype(arr.dtype, np.floating)
                             else arr.astype(np.int64))
    if ys and isinstance(ys[0], str):
        y = torch.from_numpy(_leaf_ids(ys, root, "a y label"))
    else:
        y = torch.as_tensor(np.asarray(ys, dtype=np.int64))
    return x, y


def _load_leaf(root: str | None) -> BaseDataset:
    layout = "root/train/*.json and root/test/*.json (LEAF's preprocess.sh output, e.g. leaf/data/femnist/data)"
    check(root is not None, "data.root", root, f"the LEAF data folder for data.name='leaf' ({layout})")
    assert root is not None
    files = {s: sorted(str(p) for p in Path(root, s).glob("*.json")) for s in ("train", "test")}
    if not files["train"] or not files["test"]:
        raise DataNotFoundError(f"data.root={root!r} has no LEAF data: expected {layout}")

    def build() -> dict[str, torch.Tensor]:
        users: dict[str, int] = {}
        out: dict[str, torch.Tensor] = {}
        for split in ("train", "test"):
            xs: list = []
            ys: list = []
            owners: list[int] = []
            for path in files[split]:
                try:
                    with open(path, encoding="utf-8") as f:
                        data = json.load(f)
                    order = list(data["users"])
                    user_data = data["user_data"]
                except (OSError, ValueError, KeyError, TypeError) as exc:
                    why = " ".join(str(exc).split())[:120] or type(exc).__name__
                    raise ConfigError(f"data.root={root!r} is invalid: {path} is not a LEAF file ({why}); expected "
                                      f"{{\"users\": [...], \"user_data\": {{user: {{\"x\": [...], \"y\": [...]}}}}}}"
                                      ) from None
                for user in order:
                    if split == "train":
                        users.setdefault(user, len(users))
                    elif user not in users:
                        raise ConfigError(f"data.root={root!r} is invalid: test user {user!r} ({path}) has no "
                                          f"training data; expected every test user among the train users")
                    ux, uy = user_data[user]["x"], user_data[user]["y"]
                    check(len(ux) == len(uy), "data.root", root, f"x and y of one length for user {user!r} in {path}")
                    xs += ux
                    ys += uy
                    owners += [users[user]] * len(ux)
            x, y = _leaf_arrays(xs, ys, root)
            out["chars"] = torch.tensor(bool(ys) and isinstance(ys[0], str))
            out.update({f"{split}_x": x, f"{split}_y": y, f"{split}_client": torch.tensor(owners, dtype=torch.int64)})
        return out

    blob = _cached("leaf", os.path.abspath(root), files["train"] + files["test"], build)
    chars = bool(blob.get("chars", torch.tensor(False)))
    labels = torch.cat([blob["train_y"], blob["test_y"]])
    num_classes = len(LEAF_LETTERS) if chars else (int(labels.max()) + 1 if labels.numel() else 0)
    return BaseDataset("leaf", blob["train_x"], blob["train_y"], blob["test_x"], blob["test_y"], num_classes,
                       train_client=blob["train_client"], test_client=blob["test_client"])
