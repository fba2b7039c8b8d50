"""A fit's state across the host link, staged in pinned or in pageable host memory (``trainer.pin_memory``): how long
the host is held up by each copy, alternated, for the papers' models.

Each model's state dict crosses as the engine moves it (:func:`pl_fedsparse.functional.transfer.copy_tensors`, one
packed buffer each way):

* **to the device, behind a busy stream** — a fit's start state, sent while the device still runs earlier work
  (``torch.cuda._sleep`` stands in for the previous fit's kernels): the host's time in the call. A pageable copy
  waits for the stream (PyTorch synchronises after a blocking copy), a pinned one is queued behind it;
* **to the device, idle** — the same on an idle device, until the copy is done (the copy's own time);
* **to the host** — a fit's trained state back (tensors of their own, as the client store keeps them).

Pinned and pageable alternate copy by copy (each first in turn); medians of ``--repeats``.

    python benchmarks/host_link.py --repeats 20

Prints per model and direction ``<model> <direction>: pinned <ms> ms, pageable <ms> ms, pageable / pinned <ratio>``.
Needs a CUDA device.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from pl_fedsparse.functional import transfer
from pl_fedsparse.models import VGG11GN, LeNetCIFAR, ResNet18GN

MODELS: dict[str, Callable[[], torch.nn.Module]] = {"LeNet-CIFAR": LeNetCIFAR, "VGG11-GN": VGG11GN,
                                                    "ResNet18-GN": ResNet18GN}
#: ``torch.cuda._sleep`` cycles queued before a copy "behind a busy stream" (a few tens of milliseconds on current GPUs)
BUSY_CYCLES = 50_000_000


def _timed(fn: Callable[[], object], pinned: bool) -> float:
    """Milliseconds the host spends in ``fn()`` with the copies staged ``pinned`` or pageable."""
    with transfer.host_staging(pinned):
        t = time.perf_counter()
        fn()
        return (time.perf_counter() - t) * 1e3


def measure(name: str, repeats: int, device: torch.device) -> list[str]:
    """The three directions' lines for model ``name``."""
    host = [t.detach().clone() for t in MODELS[name]().state_dict().values()]
    on = [t.to(device) for t in host]
    mb = sum(t.numel() * t.element_size() for t in host) / 2**20

    def busy_in() -> None:
        torch.cuda._sleep(BUSY_CYCLES)
        transfer.copy_tensors(host, device, share=True)

    def idle_in() -> None:
        transfer.copy_tensors(host, device, share=True)
        torch.cuda.synchronize(device)

    def out() -> None:
        transfer.copy_tensors(on, "cpu")

    lines = []
    for direction, fn in (("to the device, behind a busy stream", busy_in), ("to the device, idle", idle_in),
                          ("to the host", out)):
        times: dict[bool, list[float]] = {True: [], False: []}
        for r in range(repeats + 1):  # (the first pair warms the allocators up, untimed)
            for pinned in ((True, False) if r % 2 else (False, True)):
                torch.cuda.synchronize(device)
                ms = _timed(fn, pinned)
                torch.cuda.synchronize(device)
                if r:
                    times[pinned].append(ms)
        p, q = statistics.median(times[True]), statistics.median(times[False])
        lines.append(f"{name} ({mb:.1f} MiB) {direction}: pinned {p:.3f} ms, pageable {q:.3f} ms, "
                     f"pageable / pinned {q / p:.2f}")
    return lines


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--models", nargs="+", default=list(MODELS), choices=list(MODELS))
    ap.add_argument("--repeats", type=int, default=20, help="timed copies per staging (medians)")
    args = ap.parse_args(argv)
    if args.repeats < 1:
        ap.error(f"--repeats={args.repeats} is invalid: expected an int >= 1")
    if not torch.cuda.is_available():
        print("error: host_link.py needs a CUDA device (the host link is between the host and a GPU)", file=sys.stderr)
        raise SystemExit(2)
    device = torch.device("cuda", torch.cuda.current_device())
    print(f"# {torch.cuda.get_device_name(device)}, torch {torch.__version__}, repeats={args.repeats}, "
          f"busy stream: torch.cuda._sleep({BUSY_CYCLES})")
    for name in args.models:
        for line in measure(name, args.repeats, device):
            print(line, flush=True)


if __name__ == "__main__":
    main()
