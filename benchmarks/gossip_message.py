"""One DisPFL client's gossip message on the host: its own and its neighbours' stored models expanded and averaged.

``Gossip.client_message`` (``pl_fedsparse.callbacks.gossip``) runs once per client per round, in the driver, on the
host: each of the ``k + 1`` models of the client's group is stored sparse (its values at its mask's positions) and
is expanded to dense tensors (:func:`~pl_fedsparse.functional.sparse.expand_values`) before the per-coordinate
average (:func:`~pl_fedsparse.functional.weighted_average`, DisPFL Alg. 1 line 7). This script builds the stored
models as DisPFL's paper config holds them (ResNet18-GN, density 0.5 per masked tensor, 10 neighbours) and times the
message by the callback's own code: the expansion, the average, and the whole message. With ``--compare`` it also
times the expansion by boolean indexing (``dense[mask] = values``, what the callback did before) on the same tensors
and checks that both give the same bits.

    python benchmarks/gossip_message.py                  # seconds per message and per part
    python benchmarks/gossip_message.py --compare        # + the indexing expansion, its ratio, same bits

Prints medians of ``--repeats`` messages (alternating the two expansions with ``--compare``), wall and CPU time.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from pl_fedsparse.callbacks.gossip import Gossip
from pl_fedsparse.functional.aggregation import weighted_average
from pl_fedsparse.functional.sparse import pack_masks, unpack_masks
from pl_fedsparse.models import ResNet18GN


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


def _timed(fn):  # noqa: ANN001, ANN202
    w, c = time.perf_counter(), time.process_time()
    out = fn()
    return out, time.perf_counter() - w, time.process_time() - c


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--neighbours", type=int, default=10)
    ap.add_argument("--density", type=float, default=0.5)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--threads", type=int, default=0, help="torch threads (0: torch's default)")
    ap.add_argument("--compare", action="store_true", help="also the indexing expansion (the callback's before)")
    a = ap.parse_args()
    if a.threads:
        torch.set_num_threads(a.threads)
    shapes, group = _stored_group(a.neighbours, a.density, 0)
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
