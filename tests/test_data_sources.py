"""Your own data: ``load_base_dataset`` subclasses, image folders with any classes, tensor files, torchvision by
name, LEAF JSON, natural partitions, non-image inputs and the ``Dataset`` path (all on tiny files in ``tmp_path``)."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path
from typing import ClassVar

import numpy as np
import pytest
import torch
from test_data import isolated_cache  # noqa: F401  (autouse: every test gets its own decode cache)
from torchvision.io import write_png

import pl_fedsparse.data.datasets as ds
from pl_fedsparse.data import BaseDataset, FederatedDataModule, TensorBatchLoader, load_dataset, normalize
from pl_fedsparse.errors import ConfigError, DataNotFoundError


def one_line(err: pytest.ExceptionInfo) -> str:
    msg = str(err.value)
    assert "\n" not in msg
    return msg


# ------------------------------------------------------------------------------------------- the image path is unchanged
def _digest(t: torch.Tensor) -> str:
    return hashlib.sha256(t.detach().cpu().contiguous().numpy().tobytes()).hexdigest()[:16]


# computed with the code before this change (pl_fedsparse/data at the commit before "your own data")
BEFORE = {"split": "a6442797907d37b7", "global": "098d81602df02b5f", "partition": "d329da99407f223a",
          "pooled": "392006bb9089fefa"}


@pytest.mark.parametrize("mode", sorted(BEFORE))
def test_image_batches_bit_identical_to_before(mode: str) -> None:
    kw = {"partition": "fedem_dirichlet"} if mode == "pooled" else {}
    dm = FederatedDataModule("synthetic", num_clients=4, test_mode=mode, batch_size=16, eval_batch_size=32,
                             augment=True, synthetic={"num_train": 200, "num_test": 80, "size": 8, "num_classes": 4},
                             seed=3, **kw)
    dm.setup()
    hs = []
    for k in range(4):
        for x, y in dm.train_loader(k, seed=11):
            hs += [_digest(x), _digest(y)]
        for x, y in dm.eval_loader(k, "test", shift=0.5, seed=5):
            hs += [_digest(x), _digest(y)]
        for x, y in dm.eval_loader(k, "test", seed=5, corruption="gaussian_noise", severity=3):
            hs += [_digest(x), _digest(y)]
        hs.append(_digest(torch.from_numpy(np.array(dm.client_indices(k, "train")))))
    hs.append(_digest(dm.example_input(3)))
    assert hashlib.sha256("".join(hs).encode()).hexdigest()[:16] == BEFORE[mode]
    assert dm.supports_corruptions and dm.input_kind == "image" and dm.input_shape == (3, 8, 8)


def test_old_fingerprints_unchanged() -> None:
    fp = FederatedDataModule(synthetic={"num_classes": 4}, partition="iid").fingerprint()
    assert fp == {"version": 1, "name": "synthetic", "num_clients": 10, "partition": "iid", "test_mode": "split",
                  "split_ratios": [0.75, 0.0, 0.25], "max_train_samples": None, "seed": 0,
                  "synthetic": dict(sorted({**ds.SYNTHETIC_DEFAULTS, "num_classes": 4}.items()))}


# ------------------------------------------------------------------------------------------- image folders
def write_folder(root: Path, classes: int = 3, per_class: int = 6, size: int = 8, sizes: tuple = ()) -> None:
    gen = torch.Generator().manual_seed(0)
    for c in range(classes):
        (root / f"class_{c}").mkdir(parents=True, exist_ok=True)
        for i in range(per_class):
            s = sizes[i % len(sizes)] if sizes else size
            img = torch.randint(0, 256, (3, s, s), dtype=torch.uint8, generator=gen)
            img[0] = 40 * c  # the label is readable from the red channel
            write_png(img, str(root / f"class_{c}" / f"{i:03d}.png"))


@pytest.mark.parametrize("layout", ["train_test", "single"])
def test_image_folder_three_classes_dirichlet(tmp_path: Path, layout: str) -> None:
    root = tmp_path / "imgs"
    if layout == "train_test":
        write_folder(root / "train", per_class=12)
        write_folder(root / "test", per_class=4)
    else:
        write_folder(root, per_class=16)
    dm = FederatedDataModule("image_folder", root=str(root), num_clients=3, partition="dirichlet", alpha=0.5,
                             batch_size=8, test_fraction=0.25)
    dm.setup()
    base = dm.base
    assert dm.num_classes == 3 and dm.input_shape == (3, 8, 8) and dm.supports_corruptions
    assert len(base.train_y) == 36 and len(base.test_y) == 12  # single layout: 4 of 16 per class held out
    assert torch.equal(base.train_x[:, 0, 0, 0].long(), 40 * base.train_y)  # labels are the sorted class folders
    assert base.mean == pytest.approx(ds.channel_stats(base.train_x)[0])
    for k in range(3):
        assert set(dm.client_label_counts(k).nonzero()[0]) <= {0, 1, 2}
        xb, yb = next(iter(dm.train_loader(k, seed=0)))
        assert xb.dtype == torch.float32 and xb.shape[1:] == (3, 8, 8) and set(yb.tolist()) <= {0, 1, 2}
        rows = torch.as_tensor(np.array(dm.client_indices(k, "train")))
        expected = normalize(base.train_x[rows], base.mean, base.std)
        got = torch.cat([x for x, _ in dm.eval_loader(k, "train")])
        torch.testing.assert_close(got, expected)
    alltrain = normalize(base.train_x, base.mean, base.std)
    assert alltrain.mean(dim=(0, 2, 3)).abs().max() < 1e-4  # normalised by the training images' statistics


def test_image_folder_single_split_is_seeded(tmp_path: Path) -> None:
    write_folder(tmp_path / "imgs", per_class=10)
    a = load_dataset("image_folder", str(tmp_path / "imgs"), seed=0)
    b = load_dataset("image_folder", str(tmp_path / "imgs"), seed=1)
    assert a.test_y.bincount().tolist() == [2, 2, 2] and not torch.equal(a.test_x, b.test_x)
    assert torch.equal(load_dataset("image_folder", str(tmp_path / "imgs"), seed=0).test_x, a.test_x)


def test_image_folder_sizes(tmp_path: Path) -> None:
    write_folder(tmp_path / "imgs", per_class=4, sizes=(8, 10))
    with pytest.raises(ConfigError, match=r"^data\.root=.* has shape .*one size \(or set data\.image_size") as err:
        load_dataset("image_folder", str(tmp_path / "imgs"))
    one_line(err)
    d = load_dataset("image_folder", str(tmp_path / "imgs"), image_size=6)
    assert d.train_x.shape[1:] == (3, 6, 6)
    with pytest.raises(ConfigError, match=r"^data\.image_size=0 is invalid"):
        FederatedDataModule("image_folder", root=str(tmp_path), image_size=0)
    with pytest.raises(ConfigError, match=r"^data\.image_size=8 is invalid: expected None unless"):
        FederatedDataModule("synthetic", image_size=8)
    with pytest.raises(DataNotFoundError, match=r"^data\.root='.*nowhere' is invalid: expected an existing image"):
        load_dataset("image_folder", str(tmp_path / "nowhere"))


# ------------------------------------------------------------------------------------------- tensor files
def tabular(n: int = 120, clients: int = 4, seed: int = 0) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(seed)
    return {"x": rng.standard_normal((n, 20)).astype(np.float64), "y": rng.integers(0, 3, n),
            "client": 100 + (np.arange(n) % clients) * 7}  # ids need not be 0..K-1


@pytest.mark.parametrize("fmt", ["pt", "npz"])
def test_tensors_file_natural_clients(tmp_path: Path, fmt: str) -> None:
    t = tabular()
    tr, te = np.arange(0, 90), np.arange(90, 120)
    blob = {"train_x": t["x"][tr], "train_y": t["y"][tr], "test_x": t["x"][te], "test_y": t["y"][te],
            "train_client": t["client"][tr], "test_client": t["client"][te]}
    path = tmp_path / f"data.{fmt}"
    if fmt == "pt":
        torch.save({k: torch.from_numpy(v) for k, v in blob.items()}, path)
    else:
        np.savez(path, **blob)
    dm = FederatedDataModule("tensors", root=str(path), partition="natural", num_clients=None, test_mode="partition",
                             split_ratios=(1.0, 0.0, 0.0), batch_size=7)
    assert dm.num_clients == 4 and dm.input_shape == (20,) and dm.input_kind == "features"
    assert not dm.supports_corruptions and dm.base.train_x.dtype == torch.float32
    for k, cid in enumerate([100, 107, 114, 121]):
        assert dm.client_indices(k, "train").tolist() == np.flatnonzero(blob["train_client"] == cid).tolist()
        assert dm.client_indices(k, "test").tolist() == np.flatnonzero(blob["test_client"] == cid).tolist()
        xs, _ = zip(*dm.eval_loader(k, "test"))
        expected = torch.from_numpy(blob["test_x"][blob["test_client"] == cid]).float()
        assert torch.equal(torch.cat(xs), expected)  # passed through, not normalised
        xb, _ = next(iter(dm.train_loader(k, seed=0)))
        assert xb.dtype == torch.float32 and xb.shape == (7, 20)
    assert dm.example_input(2).shape == (2, 20)
    with pytest.raises(ConfigError, match=r"^data\.num_clients=5 is invalid: expected 4 \(the number of distinct "
                                          r"client ids of data\.name='tensors'\) or null") as err:
        FederatedDataModule("tensors", root=str(path), partition="natural", num_clients=5).setup()
    one_line(err)


def test_tensors_x_y_split_per_client_and_normalised(tmp_path: Path) -> None:
    t = tabular()
    path = tmp_path / "xy.npz"
    np.savez(path, **t, mean=np.zeros(20), std=np.full(20, 2.0))
    dm = FederatedDataModule("tensors", root=str(path), partition="natural", num_clients=4, test_mode="partition",
                             test_fraction=0.25, split_ratios=(1.0, 0.0, 0.0))
    dm.setup()
    assert len(dm.base.train_y) == 88 and len(dm.base.test_y) == 32  # 30 per client: round(7.5) = 8 held out each
    for k in range(4):
        assert set(dm.base.test_client[dm.client_indices(k, "test")].tolist()) == {100 + 7 * k}
    x0 = dm.base.train_x[:3]
    torch.testing.assert_close(dm.example_input(3), x0 / 2.0)
    plain = FederatedDataModule("tensors", root=str(path), partition="iid", num_clients=2)
    assert plain.fingerprint() != FederatedDataModule("tensors", root=str(path), partition="iid", num_clients=2,
                                                      test_fraction=0.3).fingerprint()


def test_token_ids_stay_int64(tmp_path: Path) -> None:
    rng = np.random.default_rng(0)
    path = tmp_path / "tok.pt"
    torch.save({"x": torch.from_numpy(rng.integers(0, 80, (60, 12)).astype(np.int32)),
                "y": torch.from_numpy(rng.integers(0, 5, 60)), "num_classes": torch.tensor(5)}, path)
    dm = FederatedDataModule("tensors", root=str(path), num_clients=3, partition="iid", batch_size=4)
    dm.setup()
    assert dm.num_classes == 5 and dm.input_kind == "tokens" and dm.input_shape == (12,)
    xb, _ = next(iter(dm.train_loader(0, seed=0)))
    assert xb.dtype == torch.int64 and xb.shape == (4, 12) and int(xb.max()) < 80
    rows = torch.as_tensor(np.array(dm.client_indices(1, "test")))
    assert torch.equal(torch.cat([x for x, _ in dm.eval_loader(1, "test")]), dm.base.train_x[rows])
    shifted = torch.cat([x for x, _ in dm.eval_loader(1, "test", shift=1.0, seed=0)])
    assert shifted.dtype == torch.int64 and len(shifted) == len(rows)  # shift evaluation works for any input
    assert dm.example_input(2).dtype == torch.int64


def test_non_images_refuse_augment_and_corruptions(tmp_path: Path) -> None:
    path = tmp_path / "tab.npz"
    np.savez(path, **tabular())
    with pytest.raises(ConfigError, match=r"^data\.augment=True is invalid: expected false for data\.name='tensors' "
                                          r"\(features inputs of shape \(20,\) are not images\)$") as err:
        FederatedDataModule("tensors", root=str(path), augment=True, num_clients=2).setup()
    one_line(err)
    dm = FederatedDataModule("tensors", root=str(path), num_clients=2, partition="iid")
    with pytest.raises(ConfigError, match=r"^corruption='contrast' is invalid: expected None for data\.name='tensors'"
                                          r" \(features inputs of shape \(20,\) are not images\)$"):
        dm.eval_loader(0, corruption="contrast", severity=1)
    with pytest.raises(ConfigError, match=r"^augment=True is invalid: expected False for inputs of shape \(20,\)"):
        TensorBatchLoader(torch.zeros(4, 20), torch.zeros(4), 2, shuffle=True, generator_seed=0, augment=True)


def test_bad_tensor_files(tmp_path: Path) -> None:
    (tmp_path / "bad.pt").write_bytes(b"not a torch file")
    with pytest.raises(ConfigError, match=r"^data\.root='.*bad\.pt' is invalid: cannot read it") as err:
        load_dataset("tensors", str(tmp_path / "bad.pt"))
    one_line(err)
    np.savez(tmp_path / "typo.npz", trainx=np.zeros((2, 2)))
    with pytest.raises(ConfigError, match=r"is invalid: expected keys among .*\(it has 'trainx'\)"):
        load_dataset("tensors", str(tmp_path / "typo.npz"))
    np.savez(tmp_path / "range.npz", x=np.zeros((10, 3), np.float32), y=np.arange(10) % 2, num_classes=1)
    with pytest.raises(ConfigError, match=r"^data\.name='tensors' returned train_y with a label 1: expected labels "
                                          r"in \[0, 1\)"):
        load_dataset("tensors", str(tmp_path / "range.npz"))
    with pytest.raises(DataNotFoundError, match=r"expected an existing \.pt or \.npz file"):
        load_dataset("tensors", str(tmp_path / "missing.npz"))
    (tmp_path / "text.npz").write_text("not numpy at all")
    with pytest.raises(ConfigError, match=r"cannot read it \(not an archive of arrays: numpy would have to unpickle "
                                          r"it, which pl_fedsparse never does\)") as err:
        load_dataset("tensors", str(tmp_path / "text.npz"))
    assert "allow_pickle" not in str(err.value)
    x, y = torch.eye(6), torch.arange(6) % 2
    for kind, tensor in (("sparse_coo", x.to_sparse()), ("sparse_csr", x.to_sparse_csr()), ("meta", x.to("meta"))):
        torch.save({"x": tensor, "y": y}, tmp_path / f"{kind}.pt")
        with pytest.raises(ConfigError, match=rf"^data\.root='.*{kind}\.pt' is invalid: its x is a {kind} tensor; "
                                              r"expected dense tensors"):
            load_dataset("tensors", str(tmp_path / f"{kind}.pt"))


@pytest.mark.parametrize("suffix", [".pt", ".npz"])
def test_a_damaged_byte_in_a_tensor_file_is_refused_not_loaded(tmp_path: Path, suffix: str) -> None:
    """One flipped byte inside a stored array: torch.load does not check the archive's CRCs and would load other
    numbers (numpy's reader checks them); both are refused in one line naming the file."""
    x = torch.zeros(4096, 4)
    path = tmp_path / f"data{suffix}"
    if suffix == ".pt":
        torch.save({"x": x, "y": torch.arange(4096) % 2}, path)
    else:
        np.savez(path, x=x.numpy(), y=np.arange(4096) % 2)
    data = bytearray(path.read_bytes())
    data[data.index(bytes(4096)) + 2048] ^= 0x40  # (inside x's zeros)
    path.write_bytes(bytes(data))
    expected = rf"^data\.root='.*data\{suffix}' is invalid: cannot read it \(.*(CRC|crc)"
    with pytest.raises(ConfigError, match=expected) as err:
        load_dataset("tensors", str(path))
    one_line(err)


def test_labels_from_one_are_named_when_num_classes_is_inferred(tmp_path: Path,
                                                                 caplog: pytest.LogCaptureFixture) -> None:
    """Labels 1..3 without num_classes: class 0 is empty and the classes are 4 — said once, naming the file."""
    torch.save({"x": torch.randn(30, 5), "y": torch.arange(30) % 3 + 1}, tmp_path / "one.pt")
    with caplog.at_level("WARNING"):
        base = load_dataset("tensors", str(tmp_path / "one.pt"))
    assert base.num_classes == 4
    assert any("its labels start at 1, so class 0 has no sample and num_classes is taken as 4" in r.getMessage()
               for r in caplog.records)
    caplog.clear()
    torch.save({"x": torch.randn(30, 5), "y": torch.arange(30) % 3}, tmp_path / "zero.pt")
    with caplog.at_level("WARNING"):
        load_dataset("tensors", str(tmp_path / "zero.pt"))
    assert not any("labels start at" in r.getMessage() for r in caplog.records)


def test_natural_needs_client_ids() -> None:
    with pytest.raises(ConfigError, match=r"^data\.partition='natural' is invalid: expected per-sample client ids"):
        FederatedDataModule(partition="natural", synthetic={"num_train": 40, "num_test": 10}).setup()
    with pytest.raises(ConfigError, match=r"^data\.num_clients=None is invalid"):
        FederatedDataModule(num_clients=None)


# ------------------------------------------------------------------------------------------- user subclasses
class ThreeBlobs(FederatedDataModule):
    """A user's data module: overrides only ``load_base_dataset``."""

    def load_base_dataset(self) -> BaseDataset:
        gen = torch.Generator().manual_seed(0)
        y = torch.arange(90) % 3
        x = torch.randn(90, 5, generator=gen) + y[:, None].float()
        return BaseDataset("blobs", x[:60], y[:60], x[60:], y[60:], num_classes=3,
                           train_client=torch.arange(60) % 2, test_client=torch.arange(30) % 2)


class Broken(FederatedDataModule):
    returned: ClassVar[object] = None

    def load_base_dataset(self) -> BaseDataset:
        return type(self).returned  # type: ignore[return-value]


def test_subclass_overriding_load_base_dataset() -> None:
    dm = ThreeBlobs(partition="dirichlet", num_clients=3, alpha=1.0, batch_size=10)
    dm.setup()
    assert dm.num_classes == 3 and dm.input_shape == (5,) and sum(dm.num_samples(k, s) for k in range(3)
                                                                  for s in ("train", "val", "test")) == 60
    assert next(iter(dm.train_loader(0, seed=1)))[0].shape == (10, 5)
    fp = dm.fingerprint()
    assert fp["source"].endswith("test_data_sources.ThreeBlobs")
    nat = ThreeBlobs(partition="natural", num_clients=None, test_mode="partition")
    assert nat.num_clients == 2 and nat.client_indices(1, "test").tolist() == list(range(1, 30, 2))


@pytest.mark.parametrize("returned,match", [
    ({"x": 1}, r"returned a dict: expected a pl_fedsparse\.data\.BaseDataset"),
    (BaseDataset("b", torch.zeros(4, 2), torch.tensor([0, 1, 5, 0]), torch.zeros(2, 2), torch.tensor([0, 1]), 2),
     r"returned train_y with a label 5: expected labels in \[0, 2\)"),
    (BaseDataset("b", torch.zeros(4, 2), torch.tensor([0, 1, 1]), torch.zeros(2, 2), torch.tensor([0, 1]), 2),
     r"returned train_x of length 4 and train_y of length 3: expected one label per input"),
    (BaseDataset("b", torch.zeros(4, 2), torch.tensor([0, 1, 1, 0]), torch.zeros(0, 2), torch.zeros(0), 2),
     r"returned no test split \(0 samples\)"),
    (BaseDataset("b", torch.zeros(4, 2, dtype=torch.uint8), torch.tensor([0, 1, 1, 0]),
                 torch.zeros(2, 2, dtype=torch.uint8), torch.tensor([0, 1]), 2),
     r"returned train_x as a uint8 tensor of shape \(4, 2\): expected uint8 images \[N, C, H, W\]"),
    (BaseDataset("b", torch.zeros(4, 3, 2, 2, dtype=torch.uint8), torch.tensor([0, 1, 1, 0]),
                 torch.zeros(2, 3, 2, 2, dtype=torch.uint8), torch.tensor([0, 1]), 2),
     r"returned mean=None, std=None: expected 3 per-channel values"),
])
def test_bad_return_of_load_base_dataset_is_one_line(returned: object, match: str) -> None:
    Broken.returned = returned
    with pytest.raises(ConfigError, match=r"^Broken\.load_base_dataset\(\) " + match) as err:
        Broken(num_clients=2, partition="iid").setup()
    one_line(err)


# ------------------------------------------------------------------------------------------- torchvision by name
class FakeSVHN(torch.utils.data.Dataset):
    """Like torchvision's SVHN: ``split=``, NCHW ``data``, ``labels``; "downloads" unless offline."""

    offline = False
    built: ClassVar[int] = 0

    def __init__(self, root: str, split: str = "train", download: bool = False) -> None:
        folder = Path(root) / "svhn"
        if download and not folder.is_dir():
            if type(self).offline:
                import urllib.error

                raise urllib.error.URLError("[Errno -2] Name or service not known")
            folder.mkdir(parents=True)
            (folder / "train.mat").write_bytes(b"fake")
        if not folder.is_dir():
            raise RuntimeError("Dataset not found or corrupted. You can use download=True to download it")
        type(self).built += 1
        n = 12 if split == "train" else 6
        rng = np.random.default_rng(0 if split == "train" else 1)
        self.data = rng.integers(0, 256, (n, 3, 5, 5), dtype=np.uint8)
        self.labels = np.arange(n) % 4

    def __len__(self) -> int:
        return len(self.data)

    def __getitem__(self, i: int) -> tuple:
        return self.data[i], int(self.labels[i])


def test_torchvision_by_name(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    import torchvision

    fake = type("SVHN", (FakeSVHN,), {"offline": False, "built": 0})
    monkeypatch.setattr(torchvision.datasets, "SVHN", fake)
    dm = FederatedDataModule("torchvision", torchvision_class="SVHN", root=str(tmp_path / "svhn"), num_clients=2,
                             partition="iid", augment=True, batch_size=4)
    dm.setup()
    assert dm.num_classes == 4 and dm.input_shape == (3, 5, 5) and dm.supports_corruptions and fake.built == 2
    assert torch.equal(dm.base.train_x, torch.from_numpy(FakeSVHN(str(tmp_path / "svhn")).data))
    assert next(iter(dm.train_loader(0, seed=0)))[0].shape == (4, 3, 5, 5)
    ds.clear_memo()
    fake.built = 0
    again = load_dataset("torchvision", str(tmp_path / "svhn"), torchvision_class="SVHN")
    assert fake.built == 0 and torch.equal(again.train_x, dm.base.train_x)  # converted once, then cached
    fp = dm.fingerprint()
    assert fp["torchvision_class"] == "SVHN" and fp != FederatedDataModule(
        "torchvision", torchvision_class="SVHN", image_size=4).fingerprint()


def test_torchvision_dotted_path_offline_and_bad_names(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(FakeSVHN, "offline", True)
    with pytest.raises(DataNotFoundError, match=r"^data\.root='.*' has no test_data_sources\."
                                                r"FakeSVHN \(.*Name or service not known.*\): the download into .* "
                                                r"failed \(it needs network\)") as err:
        load_dataset("torchvision", str(tmp_path / "x"), torchvision_class="test_data_sources.FakeSVHN")
    one_line(err)
    with pytest.raises(DataNotFoundError, match=r"pass --data\.download true"):
        load_dataset("torchvision", str(tmp_path / "x"), download=False,
                     torchvision_class="test_data_sources.FakeSVHN")
    with pytest.raises(ConfigError, match=r"^data\.torchvision_class='NoSuchSet' is invalid: expected a class of "
                                          r"torchvision\.datasets"):
        FederatedDataModule("torchvision", torchvision_class="NoSuchSet")
    with pytest.raises(ConfigError, match=r"^data\.torchvision_class='SVHN' is invalid: expected None unless"):
        FederatedDataModule("synthetic", torchvision_class="SVHN")


# ------------------------------------------------------------------------------------------- LEAF
def write_leaf(root: Path, users: dict[str, tuple[list, list]], split: str, files: int = 2) -> None:
    (root / split).mkdir(parents=True, exist_ok=True)
    names = list(users)
    for f in range(files):
        part = names[f::files]
        data = {"users": part, "num_samples": [len(users[u][1]) for u in part],
                "user_data": {u: {"x": users[u][0], "y": users[u][1]} for u in part}}
        (root / split / f"all_data_{f}.json").write_text(json.dumps(data))


def test_leaf_users_are_natural_clients(tmp_path: Path) -> None:
    rng = np.random.default_rng(0)

    def user(n: int) -> tuple[list, list]:
        return rng.random((n, 16)).round(3).tolist(), rng.integers(0, 62, n).tolist()

    train = {f"f{i:04d}": user(5 + i) for i in range(3)}
    test = {u: user(2) for u in train}
    write_leaf(tmp_path / "femnist", train, "train")
    write_leaf(tmp_path / "femnist", test, "test")
    dm = FederatedDataModule("leaf", root=str(tmp_path / "femnist"), partition="natural", num_clients=None,
                             test_mode="partition", split_ratios=(1.0, 0.0, 0.0))
    assert dm.num_clients == 3 and dm.input_shape == (16,) and dm.input_kind == "features"
    # users in order of first appearance in the sorted train files: f0000, f0002 (file 0), f0001 (file 1)
    for k, u in enumerate(["f0000", "f0002", "f0001"]):
        got = torch.cat([x for x, _ in dm.eval_loader(k, "train")])
        torch.testing.assert_close(got, torch.tensor(train[u][0], dtype=torch.float32))
        assert torch.cat([y for _, y in dm.eval_loader(k, "test")]).tolist() == test[u][1]


def test_leaf_shakespeare_strings_become_char_ids(tmp_path: Path) -> None:
    from pl_fedsparse.data.sources.leaf import LEAF_LETTERS

    train = {"A": (["to be or", "not to b"], ["e", " "]), "B": (["Hello wo"], ["r"])}
    test = {"A": (["e that i"], ["s"])}
    write_leaf(tmp_path / "sh", train, "train", files=1)
    write_leaf(tmp_path / "sh", test, "test", files=1)
    d = load_dataset("leaf", str(tmp_path / "sh"))
    assert d.kind == "tokens" and d.train_x.shape == (3, 8) and d.num_classes == len(LEAF_LETTERS) == 80
    assert "".join(LEAF_LETTERS[i] for i in d.train_x[2].tolist()) == "Hello wo"
    assert d.train_client.tolist() == [0, 0, 1] and d.test_client.tolist() == [0]
    (tmp_path / "none").mkdir()
    with pytest.raises(DataNotFoundError, match=r"^data\.root='.*none' has no LEAF data: expected root/train/\*\.json"):
        load_dataset("leaf", str(tmp_path / "none"))


# ------------------------------------------------------------------------------------------- Dataset objects
class NoPeeking(torch.utils.data.Dataset):
    """A map-style dataset that counts reads (the partition must not read inputs)."""

    def __init__(self, n: int, offset: int = 0) -> None:
        self.n, self.offset, self.reads = n, offset, 0

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int) -> tuple[torch.Tensor, int]:
        if not 0 <= i < self.n:
            raise IndexError(i)
        self.reads += 1
        return torch.full((4,), float(i + self.offset)), -1  # the label here is ignored (labels come from train_y)


class OutOfMemory(FederatedDataModule):
    def load_base_dataset(self) -> BaseDataset:
        if not hasattr(self, "_data"):
            self._data = BaseDataset("big", NoPeeking(80), torch.arange(80) % 4, NoPeeking(20, 1000),
                                     torch.arange(20) % 4, num_classes=4)
        return self._data


def test_dataset_objects_use_a_seeded_dataloader() -> None:
    dm = OutOfMemory(num_clients=4, partition="dirichlet", alpha=1.0, batch_size=5)
    dm.setup()
    assert dm.base.train_x.reads == 0  # partitioning read labels only
    assert dm.input_kind == "dataset" and dm.input_shape == (4,) and not dm.supports_corruptions
    loader = dm.train_loader(1, seed=3)
    assert isinstance(loader, torch.utils.data.DataLoader)
    a = [(x.clone(), y.clone()) for x, y in loader]
    b = list(dm.train_loader(1, seed=3))
    c = list(dm.train_loader(1, seed=4))
    assert all(torch.equal(xa, xb) and torch.equal(ya, yb) for (xa, ya), (xb, yb) in zip(a, b))
    assert any(not torch.equal(xa, xc) for (xa, _), (xc, _) in zip(a, c))
    xs = torch.cat([x for x, _ in a])
    ys = torch.cat([y for _, y in a])
    assert sorted(xs[:, 0].long().tolist()) == dm.client_indices(1, "train").tolist()
    assert torch.equal(ys, xs[:, 0].long() % 4)
    shifted = torch.cat([x for x, _ in dm.eval_loader(1, "test", shift=1.0, seed=0)])
    assert len(shifted) == dm.num_samples(1, "test") and bool((shifted[:, 0] >= 1000).all())
    assert dm.example_input(3)[:, 0].tolist() == [0.0, 1.0, 2.0]
    with pytest.raises(ConfigError, match=r"^data\.augment=True is invalid: .*dataset items are not images"):
        OutOfMemory(augment=True, num_clients=2).setup()
