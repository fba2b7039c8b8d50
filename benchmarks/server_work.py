"""The server's work of one round, on the host and on a device: what moving it where the fits run saves.

Between a round's fits the driver aggregates the uploads (FedAvg: the loop's default policy; FedSpa's Eq. 4:
``FedSpaAggregation``, in float64) and, for DisPFL, makes every client's gossip message (its own and its
neighbours' stored models expanded and averaged per coordinate, DisPFL Alg. 1 line 7). Where the fits run on a GPU in
the driver's process the engine now does this work there (``FederatedLoop.aggregation_device``,
``pl_fedsparse.callbacks.base.message_device``) from the copies it keeps on the device; before, it ran on the host.
This script times the library's own code for each piece at the papers' sizes, with its inputs on the host and, with
``--device``, on that device (inputs placed there beforehand, as the kept copies are; the device is synchronised
around each timing):

* ``fedavg``: ``weighted_average`` of 10 VGG11-GN uploads (FedSpa's 10 of 100 clients a round);
* ``fedspa_eq4``: ``FedSpaAggregation.aggregate`` of 10 VGG11-GN updates with their masks (density 0.5);
* ``dmpfl_eq5``: DM-PFL's Eq. 5 (the masked average of 10 VGG11-GN uploads, positions nobody holds keep the
  global value) with its new global mask (the coverage of the uploads' masks and ``select_global_mask``, §3.3.2);
* ``ewa``: FedPSE's EWA (``elementwise_average``, Alg. 2) of 10 VGG11-GN sparse updates (non-zero at the masks);
* ``gossip``: one DisPFL message — 11 ResNet18-GN stored models (density 0.5) unpacked, expanded and averaged,
  ``Gossip.sender_message``'s and ``client_message``'s code (100 of them a round).

    python benchmarks/server_work.py                       # on the host
    python benchmarks/server_work.py --device cuda         # and on the GPU (the suite's ``server`` step)

Prints the median seconds of ``--repeats`` runs (after one warm-up) per piece and place, and the host/device ratio.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from gossip_message import _stored_group

from pl_fedsparse.callbacks.fedspa import FedSpaAggregation
from pl_fedsparse.callbacks.gossip import Gossip
from pl_fedsparse.functional.aggregation import masked_weighted_average, weighted_average
from pl_fedsparse.functional.dual import mask_coverage, select_global_mask
from pl_fedsparse.functional.pse import elementwise_average
from pl_fedsparse.functional.sparse import unpack_masks
from pl_fedsparse.models import VGG11GN


def _updates(clients: int, density: float, device: torch.device) -> tuple[dict[str, torch.Tensor], list[Any]]:
    """VGG11-GN's global state and ``clients`` updates (trained weights, masks on the multi-dimensional tensors)."""
    g = torch.Generator().manual_seed(0)
    glob = {k: v.detach().clone() for k, v in VGG11GN(num_classes=10).state_dict().items()}
    ups = []
    for _ in range(clients):
        masks = {k: torch.rand(v.shape, generator=g) < density for k, v in glob.items() if v.dim() > 1}
        state = {k: v + 0.01 * torch.randn(v.shape, generator=g) if v.is_floating_point() else v
                 for k, v in glob.items()}
        ups.append(SimpleNamespace(n_samples=500, masks={k: m.to(device) for k, m in masks.items()},
                                   state={k: t.to(device) for k, t in state.items()}))
    return {k: v.to(device) for k, v in glob.items()}, ups


def _time(fn: Callable[[], Any], device: torch.device, repeats: int) -> float:
    times = []
    for r in range(repeats + 1):  # (the first is a warm-up)
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        t = time.perf_counter()
        fn()
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        if r:
            times.append(time.perf_counter() - t)
    return statistics.median(times)


def _aggregations(clients: int, density: float, device: torch.device, repeats: int) -> dict[str, float]:
    glob, ups = _updates(clients, density, device)
    loop = SimpleNamespace(global_state=glob)
    deltas = [{n: (u.state[n] - w) * u.masks[n] if n in u.masks else u.state[n] - w
               for n, w in glob.items() if w.is_floating_point()} for u in ups]  # (what TopKUpload sends)
    return {"fedavg": _time(lambda: weighted_average([u.state for u in ups], [u.n_samples for u in ups]), device,
                            repeats),
            "fedspa_eq4": _time(lambda: FedSpaAggregation().aggregate(loop, ups), device, repeats),  # type: ignore[arg-type]
            "dmpfl_eq5": _time(lambda: _dmpfl_eq5(glob, ups, density), device, repeats),
            "ewa": _time(lambda: _ewa(deltas, ups), device, repeats)}


def _dmpfl_eq5(glob: dict[str, torch.Tensor], ups: list[Any], density: float) -> dict[str, torch.Tensor]:
    """``DualMask.aggregate``'s arithmetic in its mask phase: Eq. 5 per masked tensor, then the new ``m_g``."""
    weights = [float(u.n_samples) for u in ups]
    new = {n: masked_weighted_average([u.state[n] for u in ups], weights, [u.masks.get(n) for u in ups], fallback=w)
           for n, w in glob.items() if w.is_floating_point()}
    names = list(ups[0].masks)
    coverage = {n: mask_coverage([u.masks[n] for u in ups]) for n in names}
    counts = {n: round(density * glob[n].numel()) for n in names}
    return select_global_mask({n: new[n] for n in names}, coverage, len(ups), counts)


def _ewa(deltas: list[dict[str, torch.Tensor]], ups: list[Any]) -> dict[str, torch.Tensor]:
    """``ElementwiseAggregation.aggregate``'s arithmetic: EWA of the sparse updates, per tensor."""
    weights = [float(u.n_samples) for u in ups]
    return {n: elementwise_average([d[n] for d in deltas], weights) for n in deltas[0]}


def measure(device: torch.device, clients: int, neighbours: int, density: float, repeats: int) -> dict[str, float]:
    """Median seconds of each piece with its inputs on ``device``."""
    out = _aggregations(clients, density, device, repeats)  # (its tensors freed before the gossip's are made)
    shapes, group = _stored_group(neighbours, density, 0)
    group = [({k: v.to(device) for k, v in w.items()}, {k: p.to(device) for k, p in packed.items()})
             for w, packed in group]
    gossip = Gossip()
    gossip._shapes = shapes

    def message() -> Any:
        masks = [unpack_masks(p, shapes) for _, p in group]
        dense = [gossip._expand(w, m) for (w, _), m in zip(group, masks)]
        return weighted_average(dense, [1.0] * len(dense), masks)

    out["gossip"] = _time(message, device, repeats)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--device", default=None, help="also time the pieces there (e.g. cuda)")
    ap.add_argument("--clients", type=int, default=10, help="uploads aggregated a round (FedSpa: 10)")
    ap.add_argument("--neighbours", type=int, default=10, help="DisPFL's neighbours per client")
    ap.add_argument("--density", type=float, default=0.5)
    ap.add_argument("--repeats", type=int, default=5)
    a = ap.parse_args()
    places = [torch.device("cpu")] + ([torch.device(a.device)] if a.device else [])
    results = {str(p): measure(p, a.clients, a.neighbours, a.density, a.repeats) for p in places}
    print(f"# torch {torch.__version__}, threads={torch.get_num_threads()}, {a.clients} uploads, {a.neighbours} "
          f"neighbours, density {a.density}, medians of {a.repeats}"
          + (f", device {torch.cuda.get_device_name(places[1])}" if a.device and places[1].type == "cuda" else ""))
    print("| work | " + " | ".join(f"{p} s" for p in results) + (" | host / device |" if a.device else " |"))
    print("|---|" + "---|" * (len(results) + (1 if a.device else 0)))
    for work in results["cpu"]:
        row = [f"{results[p][work]:.4f}" for p in results]
        if a.device:
            row.append(f"{results['cpu'][work] / results[str(places[1])][work]:.1f}")
        print(f"| {work} | " + " | ".join(row) + " |")


if __name__ == "__main__":
    main()
