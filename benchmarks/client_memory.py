"""Bytes of client state the driver holds per client for DisPFL on ResNet18-GN at density 0.5.

Feeds ``--clients`` synthetic trained states (the ResNet18-GN state with random values, zero outside a per-client
ERK mask of density 0.5, as a masked fit leaves them) through :class:`pl_fedsparse.callbacks.Gossip`'s own storage
code (``on_before_aggregate``, which keeps each client's last model and mask) and measures

* the store's bytes per client (``ClientStateStore.nbytes``) — now (values at the mask's positions + bit-packed
  mask) and as it was before (the dense model + bit-packed mask), and
* the driver process's resident memory (``/proc/self/status`` VmRSS) before and after storing them,

then extrapolates to 100 and 1,000 clients (the measured per-client bytes times the count: storage is per client,
with nothing shared once a client has trained). The mask callback's current mask (``RandomRegrow`` /
``GradientRegrow`` keep one per client besides Gossip's mask of the last fit) is stored beside them, one more
bit-packed mask per client.

``--codec lossless`` stores them as ``trainer.client_state_codec: lossless`` does (float32 values compressed
without loss, :mod:`pl_fedsparse.functional.floatcodec`), checks that every client's values decode bit for bit and
times the codec per client. ``--clients 1000`` stores all 1,000 clients for real (no extrapolation).

    python benchmarks/client_memory.py --clients 100                      # ~1 min, ~2.5 GB of RAM
    python benchmarks/client_memory.py --clients 1000 --codec lossless    # ~45 min, ~22 GB of RAM

``--ratio-of CKPT`` instead reports what the codec makes of the float32 client state of a real run's checkpoint
(bytes before and after, and that every tensor decodes bit for bit).
"""

from __future__ import annotations

import argparse
import ctypes
import ctypes.util
import gc
import json
import time
import types
from pathlib import Path

import torch

from pl_fedsparse.allocator import tune_malloc
from pl_fedsparse.callbacks import Gossip
from pl_fedsparse.callbacks.masking import top_masks
from pl_fedsparse.client import ClientStateStore, ClientUpdate
from pl_fedsparse.functional.masks import layer_densities
from pl_fedsparse.functional.sparse import pack_masks
from pl_fedsparse.models import ResNet18GN


def rss_bytes() -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
    return 0


def trim() -> None:
    try:
        ctypes.CDLL(ctypes.util.find_library("c")).malloc_trim(0)
    except (OSError, AttributeError):  # not glibc
        pass


def ratio_of(path: Path, out: Path | None) -> None:
    from pl_fedsparse.functional import floatcodec

    store = torch.load(path, weights_only=True, map_location="cpu")["client_store"]
    raw = enc = tensors = encoded = 0

    def visit(tree: object) -> None:
        nonlocal raw, enc, tensors, encoded
        if isinstance(tree, dict):
            for v in tree.values():
                visit(v)
        elif isinstance(tree, torch.Tensor) and tree.dtype == torch.float32:
            e = floatcodec.encode(tree)
            tensors += 1
            raw += tree.numel() * 4
            if floatcodec.is_encoded(e):
                encoded += 1
                enc += floatcodec.encoded_nbytes(e)
                assert torch.equal(floatcodec.decode(e).view(torch.int32), tree.view(torch.int32))
            else:
                enc += tree.numel() * 4

    visit(store)
    res = {"checkpoint": str(path), "clients": len(store), "float32_tensors": tensors, "encoded": encoded,
           "bytes_raw": raw, "bytes_encoded": enc, "ratio": enc / raw, "bytes_per_value": 4 * enc / raw}
    print(f"{path}: {len(store)} clients, {tensors} float32 tensors ({encoded} encoded, all bit-exact): "
          f"{raw / 1e6:.2f} MB -> {enc / 1e6:.2f} MB ({enc / raw:.3f}, {4 * enc / raw:.2f} bytes per value)")
    if out:
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(json.dumps(res, indent=1) + "\n")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--clients", type=int, default=100)
    ap.add_argument("--density", type=float, default=0.5)
    ap.add_argument("--codec", choices=["none", "lossless"], default="none", help="trainer.client_state_codec")
    ap.add_argument("--out", type=Path, default=None, help="write the figures as JSON here")
    ap.add_argument("--ratio-of", type=Path, default=None, help="a checkpoint: the codec's ratio on its client state")
    args = ap.parse_args()
    if args.ratio_of:
        ratio_of(args.ratio_of, args.out)
        return
    tuned = tune_malloc()  # as every pl-fed run does at start-up
    torch.manual_seed(0)
    init = {k: v.detach().clone() for k, v in ResNet18GN(num_classes=10).state_dict().items()}
    shapes = {k: tuple(v.shape) for k, v in init.items() if v.is_floating_point()}
    masked_shapes = {k: s for k, s in shapes.items() if len(s) > 1}  # conv/linear weights (dense_1d)
    densities = layer_densities(masked_shapes, args.density, "erk")
    params = sum(v.numel() for v in init.values())

    store = ClientStateStore(args.codec)
    loop = types.SimpleNamespace(client_store=store, initial_state=init, client_masks=lambda k: None,
                                 topology=types.SimpleNamespace(has_server=False))
    gossip = Gossip()
    gossip.setup_federation(loop)  # type: ignore[arg-type]
    store.declare("mask_callback/mask", lambda k: {})  # the mask callback's current mask
    store.materialize(range(args.clients))
    gc.collect()
    trim()
    before, dense_bytes, kept, encode_s, decode_s = rss_bytes(), 0, 0, 0.0, 0.0
    t_start = time.perf_counter()
    for k in range(args.clients):
        g = torch.Generator().manual_seed(k)
        masks = top_masks({n: torch.rand(s, generator=g) for n, s in masked_shapes.items()}, densities)
        state = {n: (torch.randn(v.shape, generator=g) * masks[n] if n in masks else v.clone())
                 for n, v in init.items()}
        dense_bytes += sum(v.numel() * v.element_size() for v in state.values()) + sum(
            p.numel() for p in pack_masks(masks).values())
        if k == 0:  # (the same count for every client: top-k of fixed sizes)
            kept = sum(int(m.sum()) for m in masks.values())
        t0 = time.perf_counter()
        gossip.on_before_aggregate(loop, [ClientUpdate(k, 0, 1, state, masks=masks)])  # type: ignore[arg-type]
        encode_s += time.perf_counter() - t0
        nxt = top_masks({n: torch.rand(s, generator=g) for n, s in masked_shapes.items()}, densities)
        store.set(k, "mask_callback/mask", pack_masks(nxt))
        if k < 20 or k == args.clients - 1:  # the values come back bit for bit (a sample: decoding costs time)
            t0 = time.perf_counter()
            back = gossip.personal_state(loop, k)  # type: ignore[arg-type]
            decode_s += time.perf_counter() - t0
            for n, v in state.items():  # bit for bit at the kept positions (outside them: zeros, -0.0 read as 0.0)
                at = masks.get(n, torch.ones_like(v, dtype=torch.bool))
                assert torch.equal(back[n][at].view(torch.int32), v[at].view(torch.int32)) and torch.equal(back[n], v), n
        del state, masks, nxt
        if (k + 1) % 100 == 0:
            print(f"  {k + 1} clients stored, RSS {rss_bytes() / 1e9:.2f} GB, {time.perf_counter() - t_start:.0f} s",
                  flush=True)
    gc.collect()
    trim()  # hand freed heap pages back, so that RSS counts what is held, not what the allocator keeps cached
    after = rss_bytes()
    total = store.nbytes() / args.clients
    mask_cb = sum(p.numel() for p in store.get(0, "mask_callback/mask").values())
    per_client = total - mask_cb  # Gossip's values and mask
    decoded_clients = min(args.clients, 21)
    out = {
        "model": "ResNet18GN(num_classes=10)", "params": params, "density": args.density, "codec": args.codec,
        "masked_params_kept": kept, "clients_measured": args.clients,
        "bytes_per_client_sparse": per_client, "bytes_per_client_dense_before": dense_bytes / args.clients,
        "rss_before_gb": before / 1e9, "rss_after_gb": after / 1e9,
        "rss_growth_per_client": (after - before) / args.clients,
        "gb_100_clients_sparse": per_client * 100 / 1e9, "gb_100_clients_dense_before": dense_bytes / args.clients * 100 / 1e9,
        "gb_1000_clients_sparse": per_client * 1000 / 1e9,
        "gb_1000_clients_dense_before": dense_bytes / args.clients * 1000 / 1e9,
        "bytes_per_client_mask_callback": mask_cb, "bytes_per_client_total": total,
        "gb_1000_clients_total": total * 1000 / 1e9, "gib_1000_clients_total": total * 1000 / 2**30,
        "gb_1000_clients_total_before": (dense_bytes / args.clients + mask_cb) * 1000 / 1e9,
        "store_seconds_per_client": encode_s / args.clients, "read_seconds_per_client": decode_s / decoded_clients,
        "torch_threads": torch.get_num_threads(), "tune_malloc": tuned,
        "release_every_bytes": store.release_every,
    }
    print(f"ResNet18-GN, {params:,} parameters, ERK density {args.density}, codec {args.codec}: "
          f"{args.clients} clients stored")
    print(f"  per client, before (dense model + packed mask): {out['bytes_per_client_dense_before'] / 1e6:8.2f} MB")
    print(f"  per client, now (values at the mask + mask):    {per_client / 1e6:8.2f} MB")
    print(f"  + the mask callback's current mask ({mask_cb / 1e6:.2f} MB): {total / 1e6:.2f} MB per client "
          f"(the process's RSS grew {out['rss_growth_per_client'] / 1e6:.2f} MB per client, "
          f"{before / 1e9:.2f} -> {after / 1e9:.2f} GB)")
    print(f"  100 clients:   {out['gb_100_clients_dense_before']:6.2f} GB before -> {out['gb_100_clients_sparse']:6.2f} GB")
    print(f"  1000 clients:  {out['gb_1000_clients_total']:.2f} GB = {out['gib_1000_clients_total']:.2f} GiB "
          f"(before: {out['gb_1000_clients_total_before']:.2f} GB)")
    print(f"  storing a client's trained state: {out['store_seconds_per_client'] * 1e3:.1f} ms; reading it back: "
          f"{out['read_seconds_per_client'] * 1e3:.1f} ms ({torch.get_num_threads()} torch threads)")
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(out, indent=1) + "\n")


if __name__ == "__main__":
    main()
