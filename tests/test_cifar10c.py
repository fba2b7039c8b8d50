"""The published CIFAR-10-C arrays as evaluation views (``data.cifar10c_root``) and the generator against references.

A tiny folder in the published layout (``<corruption>.npy`` of shape ``(5·N, H, W, C)`` uint8 and ``labels.npy``),
made here with ``N`` = the tiny base test split: every pixel of row ``r`` of ``<corruption>.npy`` is known, and the base
test image ``t`` carries ``t`` in its first pixel, so each view's images can be traced to the row they were read from.
"""

from __future__ import annotations

import importlib.util
import pickle
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

from pl_fedsparse.data import FederatedDataModule
from pl_fedsparse.data.base import BaseDataset
from pl_fedsparse.data.corruptions import CIFAR10C, CIFAR10C_CORRUPTIONS, CORRUPTIONS, corrupt
from pl_fedsparse.data.shift import label_matched_rows
from pl_fedsparse.errors import ConfigError, DataNotFoundError

REPO = Path(__file__).resolve().parents[1]
N_TRAIN, N_TEST, SIDE, CLASSES = 160, 60, 8, 4


def _test_labels() -> np.ndarray:
    return np.random.default_rng(5).integers(0, CLASSES, N_TEST)  # not sorted: the order is checked


class Tiny(FederatedDataModule):
    """8x8 images; base test image ``t`` has ``t`` in its first pixel, train image ``i`` has 255."""

    def load_base_dataset(self) -> BaseDataset:
        g = torch.Generator().manual_seed(0)
        train_x = torch.randint(0, 256, (N_TRAIN, 3, SIDE, SIDE), generator=g, dtype=torch.uint8)
        train_x[:, 0, 0, 0] = 255
        test_x = torch.randint(0, 256, (N_TEST, 3, SIDE, SIDE), generator=g, dtype=torch.uint8)
        test_x[:, 0, 0, 0] = torch.arange(N_TEST, dtype=torch.uint8)
        train_y = torch.arange(N_TRAIN) % CLASSES
        test_y = torch.from_numpy(_test_labels())
        return BaseDataset("tiny", train_x, train_y, test_x, test_y, num_classes=CLASSES, mean=(0.5,) * 3,
                           std=(0.25,) * 3)


def published_folder(root: Path, extra: tuple[str, ...] = ()) -> dict[str, np.ndarray]:
    """The 15 arrays (and ``extra`` ones) and labels.npy; row ``(s-1)·N + t`` of corruption ``c`` is random with
    its first pixel set to ``(c's number, s, t)``."""
    root.mkdir(parents=True, exist_ok=True)
    arrays = {}
    for ci, name in enumerate(CIFAR10C_CORRUPTIONS + extra):
        arr = np.random.default_rng(ci).integers(0, 256, (5 * N_TEST, SIDE, SIDE, 3), dtype=np.uint8)
        arr[:, 0, 0, 0] = ci
        arr[:, 0, 0, 1] = np.repeat(np.arange(1, 6), N_TEST)
        arr[:, 0, 0, 2] = np.tile(np.arange(N_TEST), 5)
        np.save(root / f"{name}.npy", arr)
        arrays[name] = arr
    np.save(root / "labels.npy", np.tile(_test_labels(), 5).astype(np.int64))
    return arrays


def expected(arrays: dict[str, np.ndarray], name: str, severity: int, rows: np.ndarray) -> torch.Tensor:
    return torch.from_numpy(arrays[name][(severity - 1) * N_TEST + rows].transpose(0, 3, 1, 2).copy())


@pytest.fixture
def folder(tmp_path: Path) -> tuple[Path, dict[str, np.ndarray]]:
    return tmp_path / "CIFAR-10-C", published_folder(tmp_path / "CIFAR-10-C")


def test_all_15_by_5_views_read_the_published_rows_of_the_clients_test_sets(folder) -> None:
    root, arrays = folder
    dm = Tiny(num_clients=3, partition="iid", test_mode="global", test_per_client=20, cifar10c_root=str(root))
    test_y = torch.from_numpy(_test_labels())
    assert dm.available_corruptions == CIFAR10C_CORRUPTIONS + ("gaussian_blur",)  # the last one generated
    for k in range(3):
        rows = dm.client_indices(k, "test")  # base test rows (global mode)
        for name in CIFAR10C_CORRUPTIONS:
            for s in range(1, 6):
                loader = dm.eval_loader(k, corruption=name, severity=s, seed=3)
                assert torch.equal(loader.images, expected(arrays, name, s, rows)), (k, name, s)
                assert torch.equal(loader.labels, test_y[rows]), (k, name, s)
    # what the loader yields: the same images, normalised as the clean view's
    x, y = next(iter(dm.eval_loader(0, corruption="fog", severity=2, batch_size=1000)))
    ref = expected(arrays, "fog", 2, dm.client_indices(0, "test")).float() / 255
    assert torch.allclose(x, (ref - 0.5) / 0.25, atol=1e-6) and torch.equal(y, test_y[dm.client_indices(0, "test")])


def test_shift_draws_the_same_test_rows_as_the_clean_view(folder) -> None:
    root, arrays = folder
    for mode in ("global", "split"):
        dm = Tiny(num_clients=2, partition="iid", test_mode=mode, test_per_client=25, cifar10c_root=str(root))
        for shift in (0.5, 1.0):
            clean = dm.eval_loader(1, shift=shift, seed=4)
            view = dm.eval_loader(1, shift=shift, seed=4, corruption="motion_blur", severity=4)
            clean_x = clean.images if clean.indices is None else clean.images[clean.indices]
            clean_y = clean.labels if clean.indices is None else clean.labels[clean.indices]
            drawn = clean_x[:, 0, 0, 0] != 255  # base test images (train images carry 255)
            assert torch.equal(view.labels, clean_y), (mode, shift)
            test_rows = clean_x[drawn, 0, 0, 0].long().numpy()
            assert torch.equal(view.images[torch.as_tensor(drawn)], expected(arrays, "motion_blur", 4, test_rows))
            if shift == 1.0:
                assert bool(drawn.all())


def test_split_mode_stands_in_same_label_test_images_the_same_for_every_corruption(folder) -> None:
    root, arrays = folder
    dm = Tiny(num_clients=2, partition="iid", test_mode="split", split_ratios=(0.5, 0.0, 0.5),
              cifar10c_root=str(root))
    test_y = _test_labels()
    own = dm.client_indices(0, "test")  # base *train* rows: not in the published arrays
    clean = dm.eval_loader(0, seed=9)
    first = dm.eval_loader(0, seed=9, corruption="snow", severity=1)
    rows = first.images[:, 2, 0, 0].long().numpy()  # the row the image was read from
    assert torch.equal(first.labels, clean.labels[torch.as_tensor(own)])  # same size, same labels, same order
    assert (test_y[rows] == first.labels.numpy()).all()
    assert len(set(rows.tolist())) == len(rows)  # without replacement (each class has enough test images)
    for name in ("snow", "gaussian_noise", "elastic_transform"):
        for s in (1, 3, 5):
            view = dm.eval_loader(0, seed=9, corruption=name, severity=s)
            assert torch.equal(view.images, expected(arrays, name, s, rows)), (name, s)
    other = dm.eval_loader(0, seed=10, corruption="snow", severity=1).images[:, 2, 0, 0].long().numpy()
    assert not np.array_equal(other, rows)  # another evaluation seed, other stand-ins


def test_pooled_mode_reads_pooled_test_rows_at_their_own_index(folder) -> None:
    root, arrays = folder
    dm = Tiny(num_clients=2, partition="iid", test_mode="pooled", split_ratios=(0.5, 0.0, 0.5),
              cifar10c_root=str(root))
    own = dm.client_indices(1, "test")
    view = dm.eval_loader(1, corruption="frost", severity=5)
    from_test = own >= N_TRAIN
    assert from_test.any() and (~from_test).any()
    got = view.images[torch.as_tensor(from_test), 2, 0, 0].long().numpy()
    assert np.array_equal(got, own[from_test] - N_TRAIN)
    read = view.images[:, 2, 0, 0].long().numpy()
    assert (_test_labels()[read] == view.labels.numpy()).all()
    assert torch.equal(view.images, expected(arrays, "frost", 5, read))


def test_gaussian_blur_comes_from_its_file_when_the_folder_has_one(tmp_path: Path) -> None:
    arrays = published_folder(tmp_path / "c", extra=("gaussian_blur",))
    dm = Tiny(num_clients=2, partition="iid", test_mode="global", test_per_client=10, cifar10c_root=str(tmp_path / "c"))
    rows = dm.client_indices(0, "test")
    assert torch.equal(dm.eval_loader(0, corruption="gaussian_blur", severity=2).images,
                       expected(arrays, "gaussian_blur", 2, rows))
    # without a file it is generated (and the seven published-only corruptions need the folder)
    plain = Tiny(num_clients=2, partition="iid", test_mode="global", test_per_client=10)
    assert plain.available_corruptions == CORRUPTIONS
    assert plain.eval_loader(0, corruption="gaussian_blur", severity=2).images.shape[0] == len(rows)
    with pytest.raises(ConfigError, match=r"corruption='motion_blur' is invalid: .*data\.cifar10c_root"):
        plain.eval_loader(0, corruption="motion_blur", severity=1)


def _one_line(exc: pytest.ExceptionInfo) -> str:
    text = str(exc.value)
    assert "\n" not in text
    return text


def test_missing_files_are_one_line_naming_the_folder_the_files_and_the_shape(folder) -> None:
    root, _ = folder
    (root / "fog.npy").unlink()
    (root / "labels.npy").unlink()
    with pytest.raises(DataNotFoundError) as e:
        Tiny(num_clients=2, partition="iid", test_mode="global", cifar10c_root=str(root)).setup()
    text = _one_line(e)
    assert text.startswith(f"data.cifar10c_root={str(root)!r} is invalid: missing fog.npy, labels.npy; expected")
    assert f"({5 * N_TEST}, {SIDE}, {SIDE}, 3) uint8" in text and f"labels.npy of shape ({5 * N_TEST},)" in text
    with pytest.raises(DataNotFoundError, match="no such folder") as e:
        Tiny(num_clients=2, partition="iid", cifar10c_root=str(root / "nope")).setup()
    _one_line(e)


@pytest.mark.parametrize("damage, message", [
    ("shape", r"zoom_blur\.npy has shape \(300, 8, 8, 1\) uint8; expected"),
    ("dtype", r"zoom_blur\.npy has shape \(300, 8, 8, 3\) float32; expected"),
    ("garbage", r"zoom_blur\.npy is not a readable \.npy array"),
    ("labels_length", r"labels\.npy has shape \(299,\) int64; expected"),
    ("labels_order", r"labels\.npy differs from the base test labels at \d+ of 60 positions"),
    ("other_size", r"labels\.npy has 250 rows \(50 per severity\) but the base test split has 60 images"),
])
def test_malformed_files_are_one_line(folder, damage: str, message: str) -> None:
    root, arrays = folder
    labels = np.tile(_test_labels(), 5)
    if damage == "shape":
        np.save(root / "zoom_blur.npy", arrays["zoom_blur"][..., :1])
    elif damage == "dtype":
        np.save(root / "zoom_blur.npy", arrays["zoom_blur"].astype(np.float32))
    elif damage == "garbage":
        (root / "zoom_blur.npy").write_bytes(b"not an array")
    elif damage == "labels_length":
        np.save(root / "labels.npy", labels[:-1])
    elif damage == "labels_order":  # e.g. an ImageFolder copy's test split, sorted by class
        np.save(root / "labels.npy", np.tile(np.sort(_test_labels()), 5))
    elif damage == "other_size":
        np.save(root / "labels.npy", labels[:250])
    with pytest.raises(ConfigError, match=message) as e:
        Tiny(num_clients=2, partition="iid", test_mode="global", cifar10c_root=str(root)).setup()
    assert _one_line(e).startswith(f"data.cifar10c_root={str(root)!r} is invalid: ")


def test_bad_option_values_and_inputs_that_are_not_images(folder) -> None:
    root, _ = folder
    with pytest.raises(ConfigError, match=r"data\.cifar10c_root=3 is invalid"):
        FederatedDataModule(cifar10c_root=3)  # type: ignore[arg-type]

    class Features(FederatedDataModule):
        def load_base_dataset(self) -> BaseDataset:
            x, y = torch.randn(100, 20, generator=torch.Generator().manual_seed(0)), torch.arange(100) % 3
            return BaseDataset("mine", x[:80], y[:80], x[80:], y[80:], num_classes=3)

    with pytest.raises(ConfigError, match=r"data\.cifar10c_root=.* is invalid: expected null for data=Features "
                                          r"\(features inputs of shape \(20,\) are not images\)") as e:
        Features(num_clients=2, partition="iid", cifar10c_root=str(root)).setup()
    _one_line(e)


def test_the_published_10000_per_severity_layout_is_read(tmp_path: Path) -> None:
    """The real arrays' shape, (50000, 32, 32, 3), as sparse files: N = 10000 rows per severity."""
    n = 10000
    labels = np.arange(n) % 10
    for name in CIFAR10C_CORRUPTIONS:
        arr = np.lib.format.open_memmap(tmp_path / f"{name}.npy", mode="w+", dtype=np.uint8, shape=(5 * n, 32, 32, 3))
        arr[3 * n + 9999] = 7  # severity 4, last test image
        del arr
    np.save(tmp_path / "labels.npy", np.tile(labels, 5))
    reader = CIFAR10C(tmp_path, labels, (3, 32, 32))
    assert reader.rows_per_severity == n and reader.names == CIFAR10C_CORRUPTIONS
    assert int(reader.images("brightness", 4, [9999, 0]).sum()) == 7 * 3 * 32 * 32
    assert int(reader.images("brightness", 5, [9999]).sum()) == 0
    restored = pickle.loads(pickle.dumps(reader))  # carries the folder, not the arrays
    assert len(pickle.dumps(reader)) < 10_000
    assert torch.equal(restored.images("brightness", 4, [9999]), reader.images("brightness", 4, [9999]))


def test_label_matched_rows() -> None:
    pool = np.array([0, 1, 0, 1, 1, 2])
    rows = label_matched_rows(np.array([1, 1, 0, 1]), pool, seed=0)
    assert (pool[rows] == [1, 1, 0, 1]).all()
    assert len(set(rows[[0, 1, 3]].tolist())) == 3  # three of class 1 in a pool of three: all distinct
    assert np.array_equal(rows, label_matched_rows(np.array([1, 1, 0, 1]), pool, seed=0))
    more = label_matched_rows(np.array([0, 0, 0]), pool, seed=0)  # more than the pool's two: with replacement
    assert (pool[more] == 0).all()
    with pytest.raises(ConfigError, match="label=3 is invalid"):
        label_matched_rows(np.array([3]), pool, seed=0)


# ---- the generator against references ---------------------------------------------------------------------------
def _images(n: int = 16) -> torch.Tensor:
    g = torch.Generator().manual_seed(0)
    coarse = torch.rand(n, 3, 4, 4, generator=g)
    smooth = torch.nn.functional.interpolate(coarse, size=(32, 32), mode="bilinear", align_corners=False)
    return ((smooth + 0.05 * torch.randn(n, 3, 32, 32, generator=g)).clamp(0, 1) * 255).round().to(torch.uint8)


def test_pixelate_is_pils_box_then_nearest_at_cifar10c_severities() -> None:
    """CIFAR-10-C's pixelate: PIL's BOX down-sampling to ``int(32·c)``, then back to 32 by NEAREST."""
    from PIL import Image

    imgs = _images()
    for s in range(1, 6):
        c = (0.95, 0.9, 0.85, 0.75, 0.65)[s - 1]
        ours = corrupt(imgs, "pixelate", s).permute(0, 2, 3, 1).numpy().astype(int)
        m = int(32 * c)
        ref = np.stack([np.asarray(Image.fromarray(im).resize((m, m), Image.BOX).resize((32, 32), Image.NEAREST))
                        for im in imgs.permute(0, 2, 3, 1).numpy()]).astype(int)
        assert np.abs(ours - ref).max() <= 1, s  # PIL rounds in integers, the generator in floats


def _reference_module():
    spec = importlib.util.spec_from_file_location("cifar10c_compare", REPO / "papers" / "dmpfl" / "cifar10c_compare.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules.setdefault("cifar10c_compare", module)
    spec.loader.exec_module(module)
    return module


def test_generator_matches_imagecorruptions_at_its_parameters() -> None:
    """Every generated corruption, run with the reference's (ImageNet-C) parameters: within one grey level of
    ``imagecorruptions`` (deterministic ones; defocus radius <= 6) or with its noise statistics."""
    compare = _reference_module()
    try:
        ref, _ = compare.import_reference()
    except ImportError as e:
        pytest.skip(f"the reference is not importable: {e}")
    rows = compare.compare(ref, _images(64), severities=(1, 3, 5))
    assert {r["corruption"] for r in rows} == set(CORRUPTIONS)
    for r in rows:
        what = (r["corruption"], r["severity"])
        if r["corruption"] in compare.NOISE:
            assert abs(r["ours_std"] - r["ref_std"]) < 0.03 * r["ref_std"], what
            assert abs(r["ours_changed"] - r["ref_changed"]) < 0.01 + 0.1 * r["ref_changed"], what
        elif "mean_abs" in r:
            assert r["max_abs"] <= 1 and r["mean_abs"] < 0.6, what
        else:
            assert what == ("defocus_blur", 5)  # radius 10: beyond the generator's disk (CIFAR-10-C's <= 1.5)



# ------------------------------------------------------------------------------------ ShiftEvaluation in a run
def _run_with(tmp_path: Path, dm: FederatedDataModule, corruptions: object) -> dict:
    import json

    from pl_fedsparse import FederatedLoop, FederatedModule
    from pl_fedsparse.callbacks import ShiftEvaluation
    from pl_fedsparse.models import MLP

    torch.manual_seed(0)
    module = FederatedModule(MLP(num_classes=CLASSES, in_channels=3, input_size=SIDE, hidden=[8]), lr=0.05)
    cb = ShiftEvaluation(shifts=[0.0], corruptions=corruptions, severities=[2])
    loop = FederatedLoop(num_rounds=1, accelerator="cpu", default_root_dir=str(tmp_path / "run"), logger=False,
                         enable_progress_bar=False, callbacks=[cb])
    loop.fit(module, dm)
    rows = [json.loads(x) for x in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    return {"views": cb.corruptions, "row": rows[-1]}


def test_shift_evaluation_reads_the_published_corruptions_in_a_run(folder, tmp_path: Path) -> None:
    """``corruptions: all`` with ``data.cifar10c_root`` evaluates all 15 published corruptions (and the generator's
    gaussian_blur); a published-only name such as ``fog`` evaluates from the arrays."""
    root, _ = folder
    dm = Tiny(num_clients=2, partition="iid", test_mode="global", test_per_client=20, batch_size=16,
              cifar10c_root=str(root))
    out = _run_with(tmp_path / "all", dm, "all")
    assert out["views"] == list(CIFAR10C_CORRUPTIONS + ("gaussian_blur",))
    for name in out["views"]:
        assert out["row"].get(f"{name}_s2/acc_mean") is not None, name
    fog = _run_with(tmp_path / "fog", Tiny(num_clients=2, partition="iid", test_mode="global", test_per_client=20,
                                           batch_size=16, cifar10c_root=str(root)), ["fog"])
    assert fog["row"].get("fog_s2/acc_mean") is not None


def test_a_published_only_corruption_without_the_arrays_is_one_line(tmp_path: Path) -> None:
    dm = Tiny(num_clients=2, partition="iid", test_mode="global", test_per_client=20, batch_size=16)
    with pytest.raises(ConfigError, match=r"ShiftEvaluation.corruptions=\['fog'\] is invalid: .*data.cifar10c_root"):
        _run_with(tmp_path, dm, ["fog", "contrast"])
    assert not (tmp_path / "run" / "metrics.jsonl").exists()
    out = _run_with(tmp_path / "gen", Tiny(num_clients=2, partition="iid", test_mode="global", test_per_client=20,
                                           batch_size=16), "all")
    assert out["views"] == list(CORRUPTIONS)  # without the arrays, "all" is the generator's nine
