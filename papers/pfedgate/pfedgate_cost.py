"""pFedGate's Table 2 question: time and peak memory per training batch at s = 1 / 0.5 / 0.3 vs a plain FedAvg batch.

Chen et al., "Efficient Personalized Federated Learning via Sparse Model-Adaptation", ICML 2023,
Table 2, reports, for LeNet-CIFAR at bz = 128, 27.1 MB / 3.89 ms
(FedAvg) against 27.9 / 4.09 (s = 1), 22.2 / 3.21 (s = 0.5) and 18.0 / 2.81 (s = 0.3). The authors' code masks
densely, so the masked forward cannot be cheaper than FedAvg;
``compute: sliced`` (:mod:`pl_fedsparse.functional.gate_sliced`) runs the conv/linear layers on the output rows the
sparse model keeps.

One training batch of each variant, as :class:`pl_fedsparse.callbacks.PFedGate` runs it (Alg. 1 lines 3-7): the
gate's forward (``G, M``), the code's greedy knapsack (``I*``), the straight-through ``M'``, ``θ' = θ ⊙ expand(M')``,
the functional forward, cross-entropy, one backward, the gate's gradient clip (10) and SGD step (momentum 0.9,
weight decay 5e-4), θ's gradient clip (10, Lightning's ``gradient_clip_val``) and SGD step (momentum 0.9, weight
decay 5e-4); the FedAvg batch is the same model, dense, with the same optimiser and clip, and no gate. Variants:

* ``fedavg``; ``masked s=1/0.5/0.3`` (``compute: masked``, the default, paper estimator); ``sliced s=0.5/0.3``
  (``compute: sliced``, paper estimator: the dropped rows' weight gradient is still computed where it is not 0);
  ``sliced+code-STE s=0.5/0.3`` (``straight_through: code``: the dropped rows cost nothing in the backward).
  At s = 1 no block is dropped and ``sliced`` runs exactly the masked path, so it is not listed.

LeNet-CIFAR (256,830 parameters), batch 128 of random 3×32×32 inputs (the cost does not depend on pixel values; which
blocks the knapsack keeps depends on G, but at these budgets the knapsack's capacities fix how many of conv2's and
fc1's blocks fit, which is what the cost depends on), two-path gate (the callback's default).

**Time**: the variants run interleaved in rounds (A B C … A B C …), one batch each per round, after ``--warmup``
discarded rounds; the table gives the median over ``--rounds`` rounds and the ratio of medians to FedAvg.
**Peak memory**: on CPU, torch.profiler's memory timeline (``profile_memory``/``export_memory_timeline``: every
tensor allocation and free of PyTorch's CPU allocator, in order) over one batch, after warm-up: ``Δpeak`` is the
largest amount allocated above what was live when the batch started (activations, gradients, temporaries); ``peak``
adds the tensors the batch touched that existed before (parameters, optimiser state, the input). It does not see
memory allocated outside PyTorch's allocator (oneDNN's scratch buffers). On CUDA: ``torch.cuda.max_memory_allocated``
after ``reset_peak_memory_stats`` (Δpeak: minus ``memory_allocated`` at the batch start). **FLOPs**: what
``torch.utils.flop_counter.FlopCounterMode`` counts for one batch (matmuls and convolutions, forward and backward;
the gate included). **Where the time goes** (CPU, ``--breakdown``): self CPU time per kind of op from torch.profiler,
median over more interleaved rounds.

    OMP_NUM_THREADS=1 python papers/pfedgate/pfedgate_cost.py                       # CPU, 1 thread, 30 rounds
    python papers/pfedgate/pfedgate_cost.py --device cuda --rounds 200               # GPU, if there is one
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import tempfile
import time
import warnings
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Literal

import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torch.utils.flop_counter import FlopCounterMode

from pl_fedsparse.functional.gate import BlockTable, adapt_gated_weights, block_table, code_s_min, personalized_params
from pl_fedsparse.functional.gate_sliced import active_rows, sliceable_layers, sliced_forward
from pl_fedsparse.models import LeNetCIFAR
from pl_fedsparse.models.gate import GatingLayer, adapted_forward

#: the paper's Table 2, bz = 128 (MB, ms)
PAPER_BZ128 = {"fedavg": (27.1, 3.89), "s=1": (27.9, 4.09), "s=0.5": (22.2, 3.21), "s=0.3": (18.0, 2.81)}


@dataclass
class Variant:
    """One benchmarked training step and its state."""

    name: str
    density: float | None = None  # None: FedAvg, no gate
    compute: str = "masked"
    straight_through: str = "paper"
    model: nn.Module = field(default_factory=nn.Module)
    gate: GatingLayer | None = None
    opt_model: torch.optim.Optimizer | None = None
    opt_gate: torch.optim.Optimizer | None = None
    times: list[float] = field(default_factory=list)
    rows: dict[str, int] = field(default_factory=dict)


def make_variants(device: torch.device, table: BlockTable, seed: int, lr: float, gate_lr: float) -> list[Variant]:
    """The benchmarked variants, every one from the same initial model and gate."""
    specs = [("fedavg", None, "masked", "paper"),
             ("masked s=1", 1.0, "masked", "paper"),
             ("masked s=0.5", 0.5, "masked", "paper"),
             ("masked s=0.3", 0.3, "masked", "paper"),
             ("sliced s=0.5", 0.5, "sliced", "paper"),
             ("sliced s=0.3", 0.3, "sliced", "paper"),
             ("sliced+code-STE s=0.5", 0.5, "sliced", "code"),
             ("sliced+code-STE s=0.3", 0.3, "sliced", "code")]
    out = []
    for name, density, compute, st in specs:
        torch.manual_seed(seed)
        model = LeNetCIFAR().to(device)
        torch.manual_seed(seed + 1)
        gate = GatingLayer(table.num_blocks, 3, 32).to(device) if density is not None else None
        v = Variant(name, density, compute, st, model, gate)
        v.opt_model = torch.optim.SGD(model.parameters(), lr=lr, momentum=0.9, weight_decay=5e-4)
        if gate is not None:
            v.opt_gate = torch.optim.SGD(gate.parameters(), lr=gate_lr, momentum=0.9, weight_decay=5e-4)
        out.append(v)
    return out


def make_step(v: Variant, table: BlockTable, x: Tensor, y: Tensor) -> Callable[[], None]:
    """One training batch of variant ``v`` (see the module docstring)."""
    layers = sliceable_layers(v.model, table)
    opt_model = v.opt_model
    assert opt_model is not None

    def fedavg() -> None:
        opt_model.zero_grad(set_to_none=True)
        F.cross_entropy(v.model(x), y).backward()
        torch.nn.utils.clip_grad_norm_(v.model.parameters(), 10.0)
        opt_model.step()

    def gated() -> None:
        assert v.gate is not None and v.opt_gate is not None and v.density is not None
        opt_model.zero_grad(set_to_none=True)
        v.opt_gate.zero_grad(set_to_none=True)
        importance, weights = v.gate(x, s_min=code_s_min(table.num_splits, v.density))
        variant: Literal["paper", "code"] = "code" if v.straight_through == "code" else "paper"
        m_sparse, keep = adapt_gated_weights(importance, weights, table, v.density, variant=variant)
        theta = personalized_params(dict(v.model.named_parameters()), m_sparse, table)
        if v.compute == "sliced":
            out = sliced_forward(v.model, theta, x, keep, table, dropped_grad=v.straight_through == "paper",
                                 layers=layers)
        else:
            out = adapted_forward(v.model, theta, x)
        v.rows = {n.split(".")[0]: int(r.sum()) for n, r in active_rows(keep, table, list(layers.values())).items()}
        F.cross_entropy(out, y).backward()
        torch.nn.utils.clip_grad_norm_(v.gate.parameters(), 10.0)
        v.opt_gate.step()
        torch.nn.utils.clip_grad_norm_(v.model.parameters(), 10.0)
        opt_model.step()

    return fedavg if v.density is None else gated


def peak_memory_cpu(step: Callable[[], None]) -> tuple[float, float, str]:
    """``(Δpeak, peak, where)`` of one call of ``step`` from torch.profiler's memory timeline (CPU allocator): MiB,
    and the innermost op running at the peak with its first input's shape (``"?"`` if the profiler cannot tell)."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU], profile_memory=True, record_shapes=True, with_stack=True) as prof:
        step()
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "timeline.json"
        prof.export_memory_timeline(str(path), device="cpu")
        times, sizes = json.loads(path.read_text())
    totals = [sum(s) for s in sizes]
    at = max(range(len(totals)), key=totals.__getitem__)
    where = "?"
    try:  # timeline times are absolute µs, the events' relative to the trace start
        t = times[at] - prof.profiler.kineto_results.trace_start_ns() / 1e3  # type: ignore[union-attr]
        ops = [e for e in prof.events() if e.name.startswith("aten::") and e.time_range.start <= t <= e.time_range.end]
        if ops:
            e = min(ops, key=lambda e: e.time_range.elapsed_us())
            shape = next((list(sh) for sh in e.input_shapes if isinstance(sh, (list, tuple)) and sh), None)
            where = f"{e.name.removeprefix('aten::')} {shape}" if shape else e.name.removeprefix("aten::")
    except (AttributeError, TypeError):
        pass
    return (max(totals) - totals[0]) / 2**20, max(totals) / 2**20, where


def peak_memory_cuda(step: Callable[[], None], device: torch.device) -> tuple[float, float, str]:
    """``(Δpeak, peak, "?")`` in MiB of one call of ``step`` by ``torch.cuda.max_memory_allocated``."""
    torch.cuda.synchronize(device)
    torch.cuda.reset_peak_memory_stats(device)
    start = torch.cuda.memory_allocated(device)
    step()
    torch.cuda.synchronize(device)
    peak = torch.cuda.max_memory_allocated(device)
    return (peak - start) / 2**20, peak / 2**20, "?"


def flops(step: Callable[[], None]) -> float:
    """GFLOP of one call of ``step`` as FlopCounterMode counts them."""
    with FlopCounterMode(display=False) as counter:
        step()
    return counter.get_total_flops() / 1e9


def _category(name: str, shapes: list[list[int]]) -> str:
    if "convolution" in name:
        return "conv1" if any(len(sh) == 4 and sh[-1] in (32, 28) for sh in shapes) else "conv2"
    if name in ("aten::mm", "aten::addmm", "aten::bmm"):
        return "linear"
    if "max_pool2d" in name or name in ("aten::relu", "aten::clamp_min", "aten::threshold_backward"):
        return "pool+relu"
    return "rest"


BREAKDOWN = ("conv1", "conv2", "linear", "pool+relu", "rest")


def breakdown(step: Callable[[], None]) -> dict[str, float]:
    """Self CPU ms of one batch by kind of op: ``conv1`` / ``conv2`` (forward and backward convolutions, told apart
    by their input shapes), ``linear`` (matmuls: the model's fc layers and the gate's FC), ``pool+relu`` (max-pooling
    and ReLU, forward and backward: full-sized activations in every variant), ``rest`` (the gate's normalisations,
    θ' = θ ⊙ expand(M'), the sliced layers' gathers and scatters, the optimisers, autograd's own work)."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU], record_shapes=True) as prof:
        step()
    out = dict.fromkeys(BREAKDOWN, 0.0)
    for e in prof.key_averages(group_by_input_shape=True):
        shapes = [list(sh) for sh in e.input_shapes if isinstance(sh, (list, tuple))]
        out[_category(e.key, shapes)] += e.self_cpu_time_total / 1e3
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rounds", type=int, default=30, help="timed rounds (one batch per variant per round)")
    ap.add_argument("--warmup", type=int, default=3, help="discarded rounds before timing")
    ap.add_argument("--batch", type=int, default=128)
    ap.add_argument("--device", default="cpu", help="cpu or cuda (skipped with a note when CUDA is unavailable)")
    ap.add_argument("--threads", type=int, default=1, help="torch.set_num_threads on CPU")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--lr", type=float, default=0.05, help="θ's learning rate (the cost does not depend on it)")
    ap.add_argument("--gate-lr", type=float, default=0.1, help="the gate's learning rate")
    ap.add_argument("--breakdown", type=int, default=10,
                    help="CPU: profile this many more interleaved rounds and print self time by kind of op (0: off)")
    args = ap.parse_args()
    warnings.filterwarnings("ignore", message=".*export_memory_timeline.*")  # deprecated, still the CPU timeline
    warnings.filterwarnings("ignore", message=".*\\.grad attribute of a Tensor that is not a leaf.*")  # profiler
    if args.device.startswith("cuda") and not torch.cuda.is_available():
        print("CUDA is not available: skipped (run with --device cpu)")
        return
    device = torch.device(args.device)
    if device.type == "cpu":
        torch.set_num_threads(args.threads)
    torch.manual_seed(args.seed)
    with torch.device("meta"):
        table = block_table(LeNetCIFAR())
    x = torch.randn(args.batch, 3, 32, 32, device=device)
    y = torch.randint(0, 10, (args.batch,), device=device)
    variants = make_variants(device, table, args.seed, args.lr, args.gate_lr)
    steps = [make_step(v, table, x, y) for v in variants]

    def timed(step: Callable[[], None]) -> float:
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        t0 = time.perf_counter()
        step()
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        return time.perf_counter() - t0

    for r in range(args.warmup + args.rounds):
        for v, step in zip(variants, steps):
            t = timed(step)
            if r >= args.warmup:
                v.times.append(t)
    memory = [peak_memory_cuda(s, device) if device.type == "cuda" else peak_memory_cpu(s) for s in steps]
    gflops = [flops(s) for s in steps]

    load = os.getloadavg() if hasattr(os, "getloadavg") else (float("nan"),) * 3
    print(f"pFedGate cost per training batch: LeNet-CIFAR, batch {args.batch}, device {device}"
          + (f", {torch.get_num_threads()} thread(s)" if device.type == "cpu" else f" ({torch.cuda.get_device_name(device)})")
          + f", torch {torch.__version__}")
    print(f"time: median over {args.rounds} interleaved rounds (after {args.warmup} warm-up rounds), one batch per "
          f"variant per round; load average at the end {load[0]:.2f} / {load[1]:.2f} / {load[2]:.2f}"
          + (" — the CPU is shared with other processes, so absolute times are noisy; compare the ratios"
             if device.type == "cpu" else ""))
    print("memory: " + ("torch.profiler memory timeline (PyTorch CPU allocator; not oneDNN scratch)"
                        if device.type == "cpu" else "torch.cuda.max_memory_allocated")
          + "; Δpeak = above what was live at the batch start, peak = including the parameters, optimiser state "
            "and input the batch used")
    print()
    base_t = statistics.median(variants[0].times)
    base_m = memory[0][0]
    base_f = gflops[0]
    header = ("| variant | ms / batch (median) | IQR ms | × FedAvg time | Δpeak MiB | × FedAvg Δpeak | peak MiB "
              "| peak during | GFLOP / batch | × FedAvg FLOPs | active rows conv1/conv2/fc1/fc2/fc3 |")
    print(header)
    print("|---" * (header.count("|") - 1) + "|")
    for v, (dm, pm, where), gf in zip(variants, memory, gflops):
        med = statistics.median(v.times)
        q = statistics.quantiles(v.times, n=4) if len(v.times) >= 2 else [med, med, med]
        rows = "/".join(str(v.rows.get(k, "-")) for k in ("conv1", "conv2", "fc1", "fc2", "fc3")) if v.rows else \
            "32/64/120/84/10 (dense)"
        print(f"| {v.name} | {1e3 * med:.1f} | {1e3 * q[0]:.1f}–{1e3 * q[2]:.1f} | {med / base_t:.2f} | {dm:.1f} | "
              f"{dm / base_m:.2f} | {pm:.1f} | {where} | {gf:.3f} | {gf / base_f:.2f} | {rows} |")
    if args.breakdown and device.type == "cpu":
        parts: list[list[dict[str, float]]] = [[] for _ in variants]
        for _ in range(args.breakdown):  # interleaved too, one profiled batch per variant per round
            for i, step in enumerate(steps):
                parts[i].append(breakdown(step))
        print()
        print(f"self CPU time by kind of op, ms per batch: torch.profiler, median over {args.breakdown} more "
              "interleaved rounds (profiling adds overhead; the columns do not add up to the medians above):")
        print()
        print("| variant | " + " | ".join(BREAKDOWN) + " | total |")
        print("|---" * (len(BREAKDOWN) + 2) + "|")
        for v, runs in zip(variants, parts):
            typical = {k: statistics.median(r[k] for r in runs) for k in BREAKDOWN}
            total = statistics.median(sum(r.values()) for r in runs)
            print(f"| {v.name} | " + " | ".join(f"{typical[k]:.1f}" for k in BREAKDOWN) + f" | {total:.1f} |")
    print()
    print("paper Table 2, bz = 128 (MB / ms, × FedAvg): " + "; ".join(
        f"{k} {m} / {t} ({m / PAPER_BZ128['fedavg'][0]:.2f} / {t / PAPER_BZ128['fedavg'][1]:.2f})"
        for k, (m, t) in PAPER_BZ128.items()))


if __name__ == "__main__":
    main()
