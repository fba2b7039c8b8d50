"""One DisPFL client's gossip message on the host: its own and its neighbours' stored models expanded and averaged.

``Gossip.client_message`` (``pl_fedsparse.callbacks.gossip``) runs once per client per round, in the driver, on the
host: each of the ``k + 1`` models of the client's group is stored sparse (its values at its mask's positions) and
is expanded to dense tensors (:func:`~pl_fedsparse.functional.sparse.expand_values`) before the per-coordinate
average (:func:`~pl_fedsparse.functional.weighted_average`, DisPFL Alg. 1 line 7). This script builds the stored
models as DisPFL's paper config holds them (ResNet18-GN, density 0.5 per masked tensor, 10 neighbours) and times the
message by the callback's own code: the expansion, the average, and the whole message. With ``--compare`` it also
times the expansion by boolean indexing (``dense[mask] = values``, what the callback did before) on the same tensors
and checks that both give the same bits.

With ``--flat`` it compares the message as the callback makes it now — the group's stored models unpacked, expanded
and summed as one flat buffer each (:func:`~pl_fedsparse.functional.sparse.group_average_stored`) — with the
tensor-by-tensor message (each stored tensor unpacked and expanded, then ``weighted_average``; what the callback did
before, and still does where the flat form does not apply): seconds (alternating, wall and CPU time), the
operators each dispatches (``TorchDispatchMode``; on a GPU each is a kernel launch, and a message's launches, not
its arithmetic, set its pace there: counted with the device paths, in a device run simulated on the CPU) and
whether both give the same bits. ``--device cuda`` runs it on a GPU.

    python benchmarks/gossip_message.py                  # seconds per message and per part
    python benchmarks/gossip_message.py --compare        # + the indexing expansion, its ratio, same bits
    python benchmarks/gossip_message.py --flat           # flat vs tensor by tensor: seconds, operators, same bits

Prints medians of ``--repeats`` messages (alternating the two ways with ``--compare`` / ``--flat``), wall and CPU time.
"""

from __future__ import annotations

import argparse
import collections
import contextlib
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from pl_fedsparse.callbacks.gossip import Gossip
from pl_fedsparse.functional.aggregation import weighted_average
from pl_fedsparse.functional.sparse import group_average_stored, pack_masks, unpack_masks
from pl_fedsparse.models import ResNet18GN
from pl_fedsparse.testing import simulated_device

sys.path.insert(0, str(Path(__file__).resolve().parent))
from stacked_ops import OpCounter  # (the kernel-launch rule)


def _stored_group(neighbours: int, density: float, seed: int) -> tuple[dict, list[tuple[dict, dict]]]:
    """Shapes and ``neighbours + 1`` stored models (sparse values, packed masks) with ResNet18-GN's tensors; the
    multi-dimensional weights are masked, as the mask callbacks mask them (biases and norms stay dense)."""
    g = torch.Generator().manual_seed(seed)
    state = {k: v.detach().clone() for k, v in ResNet18GN().state_dict().items() if v.is_floating_point()}
    shapes = {k: tuple(v.shape) for k, v in state.items()}
    group = []
    for _ in range(neighbours + 1):
        masks = {k: torch.rand(v.shape, generator=g) < density for k, v in state.items() if v.dim() > 1}
        weights = {k: (torch.randn(v.shape, generator=g)[masks[k]] if k in masks else torch.randn(v.shape, generator=g))
                   for k, v in state.items()}
        group.append((weights, pack_masks(masks)))
    return shapes, group


def _expand_by_indexing(weights: dict, masks: dict, shapes: dict) -> dict:
    out = {}
    for name, v in weights.items():
        m = masks.get(name)
        if m is not None and tuple(v.shape) != shapes[name]:
            dense = torch.zeros(shapes[name], dtype=v.dtype)
            dense[m] = v
            v = dense
        out[name] = v
    return out


def _timed(fn, device=None):
    if device is not None and device.type == "cuda":
        torch.cuda.synchronize(device)
    w, c = time.perf_counter(), time.process_time()
    out = fn()
    if device is not None and device.type == "cuda":
        torch.cuda.synchronize(device)
    return out, time.perf_counter() - w, time.process_time() - c


class _Ops(TorchDispatchMode):
    """Counts the operators dispatched (views included: they cost host time, not a kernel)."""

    def __init__(self) -> None:
        super().__init__()
        self.count: collections.Counter[str] = collections.Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.count[str(func.overloadpacket.__name__)] += 1
        return func(*args, **(kwargs or {}))


def _flat(a: Any, shapes: dict, group: list) -> None:
    """``--flat``: the message by ``group_average_stored`` against tensor by tensor, on ``--device``."""
    device = torch.device(a.device)
    group = [({k: v.to(device) for k, v in w.items()}, {k: p.to(device) for k, p in packed.items()})
             for w, packed in group]
    gossip = Gossip()
    gossip._shapes = shapes

    def ways_on(group: list) -> dict[str, Any]:
        def by_tensor() -> dict:
            masks = [unpack_masks(p, shapes) for _, p in group]
            dense = [gossip._expand(w, m) for (w, _), m in zip(group, masks)]
            return weighted_average(dense, [1.0] * len(dense), masks)

        return {"flat (now)": lambda: group_average_stored(group, shapes), "tensor by tensor (before)": by_tensor}

    ways = ways_on(group)
    times: dict[str, list[tuple[float, float]]] = {k: [] for k in ways}
    results: dict[str, dict] = {}
    for r in range(a.repeats + 1):  # the first message of each way is a warm-up
        for name in (list(ways) if r % 2 == 0 else list(ways)[::-1]):
            results[name], wall, cpu = _timed(ways[name], device)
            if r:
                times[name].append((wall, cpu))
    ops, kernels = {}, {}
    for name, fn in ways.items():
        with _Ops() as counter:
            fn()
        ops[name] = counter.count
        # the kernels a GPU would launch: the device paths (on the CPU, a device run simulated there: no host-side
        # count check in the expansion), views and allocations left out (stacked_ops.py's rule)
        with simulated_device(strict=False) if device.type == "cpu" else contextlib.nullcontext():
            placed = [({k: v.to(device) for k, v in w.items()}, {k: p.to(device) for k, p in pk.items()})
                      for w, pk in group]
            with OpCounter() as launches:
                ways_on(placed)[name]()
        kernels[name] = launches.ops
    params = sum(torch.Size(s).numel() for s in shapes.values())
    masked = len(group[0][1])
    print(f"ResNet18GN ({params:,} params, {len(shapes)} tensors, {masked} masked), density {a.density}, "
          f"{a.neighbours} neighbours + own, device={device}, threads={torch.get_num_threads()}, medians of "
          f"{a.repeats} messages")
    med = {k: (statistics.median(t[0] for t in v), statistics.median(t[1] for t in v)) for k, v in times.items()}
    for name in ways:
        top = ", ".join(f"{op} {c}" for op, c in ops[name].most_common(6))
        print(f"{name:26s} message {med[name][0]:.4f} s wall {med[name][1]:.4f} s CPU | kernels on a device "
              f"{kernels[name]} | operators here {sum(ops[name].values())} ({top})")
    now, before = "flat (now)", "tensor by tensor (before)"
    same = all(torch.equal(results[now][k].view(torch.int32), results[before][k].view(torch.int32)) for k in shapes)
    print(f"ratio before / now: message {med[before][0] / med[now][0]:.2f}x wall, {med[before][1] / med[now][1]:.2f}x "
          f"CPU; kernels {kernels[before] / kernels[now]:.1f}x; same bits: {same}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--neighbours", type=int, default=10)
    ap.add_argument("--density", type=float, default=0.5)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--threads", type=int, default=0, help="torch threads (0: torch's default)")
    ap.add_argument("--compare", action="store_true", help="also the indexing expansion (the callback's before)")
    ap.add_argument("--flat", action="store_true", help="the flat message against tensor by tensor (+ operators)")
    ap.add_argument("--device", default="cpu", help="with --flat: where the message is made (e.g. cuda)")
    a = ap.parse_args()
    if a.threads:
        torch.set_num_threads(a.threads)
    shapes, group = _stored_group(a.neighbours, a.density, 0)
    if a.flat:
        _flat(a, shapes, group)
        return
    gossip = Gossip()
    gossip._shapes = shapes
    ways = {"masked_scatter (now)": gossip._expand}
    if a.compare:
        ways["indexing (before)"] = lambda w, m: _expand_by_indexing(w, m, shapes)
    times: dict[str, dict[str, list[float]]] = {k: {"expand": [], "expand_cpu": [], "average": [], "message": [],
                                                    "message_cpu": []} for k in ways}
    results = {}
    for r in range(a.repeats + 1):  # the first message of each way is a warm-up
        for name in (list(ways) if r % 2 == 0 else list(ways)[::-1]):
            expand = ways[name]
            masks = [unpack_masks(p, shapes) for _, p in group]
            dense, we, ce = _timed(lambda expand=expand, masks=masks: [expand(w, m) for (w, _), m in zip(group, masks)])
            avg, wa, ca = _timed(lambda dense=dense, masks=masks: weighted_average(dense, [1.0] * len(dense), masks))
            results[name] = avg
            if r:
                for part, value in (("expand", we), ("expand_cpu", ce), ("average", wa), ("message", we + wa),
                                    ("message_cpu", ce + ca)):
                    times[name][part].append(value)
    params = sum(torch.Size(s).numel() for s in shapes.values())
    print(f"ResNet18GN ({params:,} params), density {a.density}, {a.neighbours} neighbours + own, "
          f"threads={torch.get_num_threads()}, medians of {a.repeats} messages")
    med = {k: {p: statistics.median(v) for p, v in t.items()} for k, t in times.items()}
    for name, m in med.items():
        print(f"{name:22s} expand {m['expand']:.3f} s wall {m['expand_cpu']:.3f} s CPU | average {m['average']:.3f} s "
              f"| message {m['message']:.3f} s wall {m['message_cpu']:.3f} s CPU")
    if a.compare:
        now, before = med["masked_scatter (now)"], med["indexing (before)"]
        same = all(torch.equal(results["masked_scatter (now)"][k].view(torch.int32),
                               results["indexing (before)"][k].view(torch.int32)) for k in shapes)
        print(f"ratio before / now: expand {before['expand'] / now['expand']:.2f}x wall, "
              f"{before['expand_cpu'] / now['expand_cpu']:.2f}x CPU; message {before['message'] / now['message']:.2f}x "
              f"wall, {before['message_cpu'] / now['message_cpu']:.2f}x CPU; same bits: {same}")


if __name__ == "__main__":
    main()
