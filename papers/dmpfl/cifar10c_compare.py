"""How close the corruption generator (:mod:`pl_fedsparse.data.corruptions`) is to a reference implementation of
Hendrycks & Dietterich's corruptions (ICLR 2019, "Benchmarking Neural Network Robustness to Common Corruptions and
Perturbations", §3 and App. A): the ``imagecorruptions`` package (version 1.1.2).

The reference ships ImageNet-C's severity parameters, not CIFAR-10-C's, and takes only a severity. So every row runs
both implementations with the *reference's* parameter of that severity (the generator's corruption function is
called with the same parameter): what is measured is the implementation; the generator's CIFAR-10-C parameters
(:data:`~pl_fedsparse.data.corruptions.SEVERITY_PARAMS`) enter the same code. Per corruption and severity, on one
fixed batch of images:

* deterministic corruptions: mean and largest absolute difference in grey levels (0-255), the share of equal values,
  and the mean difference (generator minus reference: the reference truncates to ``uint8``, the generator rounds);
* noise (different random streams): the standard deviation of ``corrupted - clean`` in grey levels for each, and for
  impulse noise the share of values changed.

imagecorruptions 1.1.2 imports ``pkg_resources`` only to find its frost images; setuptools 81 and later no longer
ship that module, so the package does not import as installed. This script then stands in a one-function
``pkg_resources`` (``resource_filename``: a file beside the package) and says so in the record. Its
``gaussian_blur`` calls scikit-image's ``gaussian`` with ``multichannel=True``, an argument scikit-image 0.19 removed;
where it raises, that row compares with ``skimage.filters.gaussian(..., channel_axis=-1)``, the call it means.

    pip install imagecorruptions
    mkdir -p data/cifar10 && tar -xzf ../shared/data/cifar10-jpg.tar.gz -C data/cifar10
    OMP_NUM_THREADS=1 python papers/dmpfl/cifar10c_compare.py --data-root data/cifar10 \\
        --out papers/dmpfl/records/cifar10c_generator_vs_reference.txt
"""

from __future__ import annotations

import argparse
import importlib
import importlib.util
import os
import subprocess
import sys
import types
from pathlib import Path
from typing import Any

import numpy as np
import torch

ROOT = Path(__file__).resolve().parents[2]  # the repository (papers/<paper>/<script>)
sys.path.insert(0, str(ROOT))

from pl_fedsparse.data import corruptions as gen

#: the reference's severity parameters (ImageNet-C's, as imagecorruptions 1.1.2 uses them), for the generator's
#: corruptions; defocus_blur is (radius, alias blur)
REFERENCE_PARAMS: dict[str, tuple] = {
    "gaussian_noise": (0.08, 0.12, 0.18, 0.26, 0.38),
    "shot_noise": (60, 25, 12, 5, 3),
    "impulse_noise": (0.03, 0.06, 0.09, 0.17, 0.27),
    "gaussian_blur": (1, 2, 3, 4, 6),
    "defocus_blur": ((3, 0.1), (4, 0.5), (6, 0.5), (8, 0.5), (10, 0.5)),
    "contrast": (0.4, 0.3, 0.2, 0.1, 0.05),
    "brightness": (0.1, 0.2, 0.3, 0.4, 0.5),
    "pixelate": (0.6, 0.5, 0.4, 0.3, 0.25),
    "jpeg_compression": (25, 18, 15, 10, 7),
}
NOISE = ("gaussian_noise", "shot_noise", "impulse_noise")


def import_reference() -> tuple[Any, str]:
    """``imagecorruptions`` and a note on how it was imported; ``ImportError`` when it is not installed."""
    if importlib.util.find_spec("imagecorruptions") is None:
        raise ImportError("imagecorruptions is not installed (pip install imagecorruptions)")
    note = "imported as installed"
    try:
        import pkg_resources  # noqa: F401
    except ImportError:  # setuptools >= 81: the one function the package uses, beside the package
        shim = types.ModuleType("pkg_resources")

        def resource_filename(package: str, name: str) -> str:
            spec = importlib.util.find_spec(package)
            assert spec is not None and spec.origin is not None
            return os.path.join(os.path.dirname(spec.origin), name)

        shim.resource_filename = resource_filename  # type: ignore[attr-defined]
        sys.modules["pkg_resources"] = shim
        note = "imported with a stand-in pkg_resources.resource_filename (setuptools >= 81 has no pkg_resources)"
        try:
            module = importlib.import_module("imagecorruptions")
        finally:  # the stand-in must not outlive the import: other code checks sys.modules for pkg_resources
            if sys.modules.get("pkg_resources") is shim:
                del sys.modules["pkg_resources"]
    else:
        module = importlib.import_module("imagecorruptions")
    from importlib.metadata import PackageNotFoundError, version

    try:
        installed = version("imagecorruptions")
    except PackageNotFoundError:  # importable without package metadata (e.g. a source folder on the path)
        installed = "(no package metadata)"
    return module, f"imagecorruptions {installed}, {note}"


def fixed_batch(n: int, data_root: str | None, seed: int = 0) -> tuple[torch.Tensor, str]:
    """``uint8 [n, 3, 32, 32]``: the first test images of each class of an ImageFolder copy of CIFAR-10 (sorted file
    names, classes in turn), else seeded smooth synthetic images."""
    if data_root is not None:
        from PIL import Image

        tops = [Path(data_root) / "test", *sorted(Path(data_root).glob("*/test"))]
        top = next((t for t in tops if t.is_dir()), None)
        if top is None:
            raise SystemExit(f"--data-root={data_root!r} is invalid: expected a folder with test/<class>/*.jpg")
        classes = sorted(p for p in top.iterdir() if p.is_dir())
        files = [sorted(c.glob("*.jpg")) for c in classes]
        picked = [files[i % len(files)][i // len(files)] for i in range(n)]
        arr = np.stack([np.asarray(Image.open(f).convert("RGB")) for f in picked])
        return torch.from_numpy(arr).permute(0, 3, 1, 2).contiguous(), f"{n} CIFAR-10 test images from {top}"
    g = torch.Generator().manual_seed(seed)
    coarse = torch.rand(n, 3, 4, 4, generator=g)
    smooth = torch.nn.functional.interpolate(coarse, size=(32, 32), mode="bilinear", align_corners=False)
    imgs = (smooth + 0.05 * torch.randn(n, 3, 32, 32, generator=g)).clamp(0, 1)
    return (imgs * 255).round().to(torch.uint8), f"{n} seeded synthetic 32x32 images (seed {seed})"


def _ours(images: torch.Tensor, name: str, param: Any, seed: int) -> np.ndarray:
    """The generator's function for ``name`` with parameter ``param``, rounded as :func:`corrupt` does; NHWC."""
    x = images.float() / 255
    y = gen._FUNCS[name](x, param, torch.Generator().manual_seed(seed))
    out = (y * 255).round_().clamp_(0, 255).to(torch.uint8)
    return out.permute(0, 2, 3, 1).numpy()


def _reference(ref: Any, images: torch.Tensor, name: str, severity: int, param: Any, seed: int) -> tuple[np.ndarray,
                                                                                                         str]:
    """The reference's output (NHWC uint8) and a note on how it was made. Its random draws are seeded: numpy's global
    stream, and scikit-image's ``random_noise`` (impulse noise), which it calls without a seed."""
    import skimage.util

    np.random.seed(seed)
    hwc = images.permute(0, 2, 3, 1).numpy()
    random_noise = skimage.util.random_noise
    stream = np.random.default_rng(seed)
    skimage.util.random_noise = lambda *a, **k: random_noise(*a, **{"rng": stream, **k})
    try:
        return np.stack([ref.corrupt(im, corruption_name=name, severity=severity) for im in hwc]), ""
    except TypeError as e:
        if name != "gaussian_blur":
            raise
        from skimage.filters import gaussian

        out = [np.uint8(np.clip(gaussian(im / 255.0, sigma=param, channel_axis=-1), 0, 1) * 255) for im in hwc]
        return np.stack(out), f"reference raised TypeError ({str(e).split(':')[-1].strip()}): its call with channel_axis"
    finally:
        skimage.util.random_noise = random_noise


def compare(ref: Any, images: torch.Tensor, names: tuple[str, ...] = gen.CORRUPTIONS,
            severities: tuple[int, ...] = (1, 2, 3, 4, 5), seed: int = 0) -> list[dict[str, Any]]:
    """One row per corruption and severity (module docstring)."""
    clean = images.permute(0, 2, 3, 1).numpy().astype(np.float64)
    rows = []
    for name in names:
        for s in severities:
            param = REFERENCE_PARAMS[name][s - 1]
            row: dict[str, Any] = {"corruption": name, "severity": s, "param": param, "note": ""}
            if name == "defocus_blur" and param[0] > 8:
                row["note"] = "not compared: the generator's 17x17 disk covers radii <= 8 (CIFAR-10-C's: <= 1.5)"
                rows.append(row)
                continue
            ours = _ours(images, name, param, seed).astype(np.float64)
            theirs, note = _reference(ref, images, name, s, param, seed)
            theirs = theirs.astype(np.float64)
            row["note"] = note
            if name in NOISE:
                row["ours_std"] = float((ours - clean).std())
                row["ref_std"] = float((theirs - clean).std())
                row["ours_changed"] = float((ours != clean).mean())
                row["ref_changed"] = float((theirs != clean).mean())
            else:
                diff = ours - theirs
                row["mean_abs"] = float(np.abs(diff).mean())
                row["max_abs"] = float(np.abs(diff).max())
                row["equal"] = float((diff == 0).mean())
                row["bias"] = float(diff.mean())
            rows.append(row)
    return rows


def table(rows: list[dict[str, Any]]) -> str:
    """The rows as two Markdown tables (deterministic corruptions; noise)."""
    det = [("| corruption | severity | reference parameter | mean abs diff | max abs diff | equal values | mean diff "
            "(ours - ref) | note |"), "|---|---|---|---|---|---|---|---|"]
    noise = [("| corruption | severity | reference parameter | std of noise, ours | std of noise, reference | values "
              "changed, ours | values changed, reference |"), "|---|---|---|---|---|---|---|"]
    for r in rows:
        if r["corruption"] in NOISE:
            noise.append(f"| {r['corruption']} | {r['severity']} | {r['param']} | {r['ours_std']:.2f} | "
                         f"{r['ref_std']:.2f} | {r['ours_changed'] * 100:.1f} % | {r['ref_changed'] * 100:.1f} % |")
        elif "mean_abs" not in r:
            det.append(f"| {r['corruption']} | {r['severity']} | {r['param']} | - | - | - | - | {r['note']} |")
        else:
            det.append(f"| {r['corruption']} | {r['severity']} | {r['param']} | {r['mean_abs']:.2f} | "
                       f"{r['max_abs']:.0f} | {r['equal'] * 100:.1f} % | {r['bias']:+.2f} | {r['note']} |")
    return ("Deterministic corruptions (grey levels, 0-255):\n\n" + "\n".join(det)
            + "\n\nNoise (grey levels; different random streams, so statistics):\n\n" + "\n".join(noise) + "\n")


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--data-root", default=None, help="an ImageFolder copy of CIFAR-10 (test/<class>/*.jpg)")
    ap.add_argument("--n", type=int, default=64, help="images in the fixed batch")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", default=None, help="write the record here (else print)")
    args = ap.parse_args(argv)
    ref, how = import_reference()
    images, what = fixed_batch(args.n, args.data_root, args.seed)
    rows = compare(ref, images, seed=args.seed)
    try:
        commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True, text=True,
                                check=True).stdout.strip()
        dirty = subprocess.run(["git", "status", "--porcelain", "--", "pl_fedsparse/data/corruptions.py"], cwd=ROOT,
                               capture_output=True, text=True, check=True).stdout.strip()
        commit += " (corruptions.py changed since)" if dirty else ""
    except (OSError, subprocess.CalledProcessError):
        commit = "unknown"
    cmd = "OMP_NUM_THREADS=1 python papers/dmpfl/cifar10c_compare.py " + " ".join(argv if argv is not None
                                                                                 else sys.argv[1:])
    import skimage

    text = (f"# command: {cmd.strip()}\n# commit: {commit}\n# reference: {how}; scikit-image {skimage.__version__}\n"
            f"# images: {what}\n# parameters: the reference's (ImageNet-C's) for each severity, given to both; random "
            f"draws seeded with --seed {args.seed} (the reference's: numpy's stream, scikit-image's random_noise)\n\n"
            + table(rows))
    if args.out:
        Path(args.out).write_text(text)
    print(text)


if __name__ == "__main__":
    main()
