"""Prune-and-regrow on one client: the linear-time selection against the stable sort it replaced.

On a lent H200 a FedSpa round of the paper config (VGG11-GN, 10 clients) spent 13.3 of its 17.2 s in
``torch.sort`` inside ``drop_and_grow`` (``benchmarks/gpu/profile/profile_fedspa_10clients.txt``, written by
``benchmarks/profile_fit.py``): the masks are readjusted on the CPU, and sorting each large layer's scores cost
~140 ms. :func:`pl_fedsparse.functional.masks.stable_top_k` selects the same entries with ``torch.kthvalue`` and
comparisons. This script times one client's readjustment (every weight tensor of FedSpa's VGG11-GN or DisPFL's
ResNet18-GN with more than one dimension, ERK density 0.5, α = 0.5: the first round's rate) both ways, alternating,
and checks that the masks are equal:

    OMP_NUM_THREADS=1 python benchmarks/topk_select.py [--model vgg11gn|resnet18gn] [--pairs 7] [--rate 0.5]

It prints the medians of wall and CPU time and their ratios (sort / selection).
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from pl_fedsparse.functional import drop_and_grow, erk_densities, masks_from_densities, prune_regrow_count
from pl_fedsparse.models import VGG11GN, ResNet18GN

MODELS = {"vgg11gn": VGG11GN, "resnet18gn": ResNet18GN}


def drop_and_grow_by_sort(mask: torch.Tensor, drop_score: torch.Tensor, grow_score: torch.Tensor,
                          k: int) -> torch.Tensor:
    """The selection before: two stable sorts (the reference the new one must equal)."""
    new = mask.reshape(-1).clone()
    active = new.nonzero().squeeze(1)
    k = max(0, min(k, active.numel()))
    if k == 0:
        return new.view(mask.shape)
    ds, gs = drop_score.reshape(-1), grow_score.reshape(-1)
    new[active[torch.sort(ds[active], stable=True).indices[:k]]] = False
    inactive = (~new).nonzero().squeeze(1)
    new[inactive[torch.sort(gs[inactive], descending=True, stable=True).indices[:k]]] = True
    return new.view(mask.shape)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", choices=sorted(MODELS), default="vgg11gn",
                    help="vgg11gn (FedSpa's, the profiled one; default) or resnet18gn (DisPFL's)")
    ap.add_argument("--pairs", type=int, default=7, help="alternating A/B pairs (default 7)")
    ap.add_argument("--rate", type=float, default=0.5, help="prune rate α (default 0.5)")
    args = ap.parse_args()
    if args.pairs < 1:
        ap.error(f"--pairs={args.pairs} is invalid; expected a whole number >= 1")
    if not 0 <= args.rate <= 1:
        ap.error(f"--rate={args.rate} is invalid; expected a number in [0, 1]")
    model = MODELS[args.model](num_classes=10)
    shapes = {n: p.shape for n, p in model.named_parameters() if p.dim() > 1}
    g = torch.Generator().manual_seed(0)
    densities = erk_densities(shapes, 0.5)
    # the tensors the engine masks (and readjusts): those ERK leaves below density 1 (SparseMask)
    masks = masks_from_densities({n: s for n, s in shapes.items() if densities[n] < 1.0}, densities, g)
    drop = {n: p.detach().abs() for n, p in model.named_parameters() if n in masks}
    grow = {n: torch.rand(s, generator=g) for n, s in shapes.items() if n in masks}
    ks = {n: prune_regrow_count(m, args.rate) for n, m in masks.items()}
    entries = sum(m.numel() for m in masks.values())

    def run(fn):
        w, c = time.perf_counter(), time.process_time()
        out = {n: fn(m, drop[n], grow[n], ks[n]) for n, m in masks.items()}
        return out, time.perf_counter() - w, time.process_time() - c

    run(drop_and_grow_by_sort), run(drop_and_grow)  # warm-up
    times: dict[str, list[tuple[float, float]]] = {"sort": [], "select": []}
    for _ in range(args.pairs):
        a, wa, ca = run(drop_and_grow_by_sort)
        b, wb, cb = run(drop_and_grow)
        times["sort"].append((wa, ca))
        times["select"].append((wb, cb))
        for n in masks:
            if not torch.equal(a[n], b[n]):
                raise SystemExit(f"error: the masks of {n} differ between the sort and the selection")
    med = {k: (statistics.median(w for w, _ in v), statistics.median(c for _, c in v)) for k, v in times.items()}
    print(f"{type(model).__name__}: {len(masks)} masked tensors, {entries:,} entries, rate {args.rate}, "
          f"{torch.get_num_threads()} thread(s), {args.pairs} alternating pairs; masks equal in every pair")
    for k, (w, c) in med.items():
        print(f"  {k:7s} wall {1000 * w:8.1f} ms   cpu {1000 * c:8.1f} ms   (median per client readjustment)")
    print(f"  ratio (sort / select): wall {med['sort'][0] / med['select'][0]:.2f}x   "
          f"cpu {med['sort'][1] / med['select'][1]:.2f}x")


if __name__ == "__main__":
    main()
