"""DisPFL end to end: two federation rounds equal a plain re-implementation of the paper's Alg. 1 written here.

Per round ``t`` and client ``k`` (every client trains every round): receive the neighbours' last trained models with
the masks they trained with (the topology's draw), average each position over the models whose masks hold it, own
model included (line 7), keep the own current mask's positions, train one local epoch of masked SGD (gradients and
weights kept on the mask), then prune the ``α_t`` share of the smallest |w| and regrow as many by the largest |dense
gradient| of one local batch (Alg. 2, lines 9-10), ``α_t = α₀/2 · (1 + cos(π t / T))``. The new mask masks the next
round's aggregate; the model sent on is the trained one under the mask it trained with, so a regrown entry starts
from its neighbours' average and a pruned one still reaches them (the DisPFL code, ``client.py``;
``shared/methods/dispfl_fedspa.md`` §2-3). The kernels (drop-and-grow, the cosine rate)
are the library's, tested on their own; the orchestration, the training, the averaging and the gradient are written
here.
"""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch
from conftest import plain_dense_gradient, plain_masked_epoch, tiny_datamodule, tiny_loop, tiny_module

from pl_fedsparse import RandomPeers
from pl_fedsparse.callbacks import Gossip, GradientRegrow
from pl_fedsparse.functional.sparse import drop_and_grow, prune_regrow_count

ROUNDS, CLIENTS, ALPHA0, LR = 2, 4, 0.5, 0.1


def test_two_dispfl_rounds_equal_a_plain_implementation(tmp_path: Path) -> None:
    topology = RandomPeers(k=2)
    cb = GradientRegrow(density=0.5, same_mask=False, alpha0=ALPHA0, mask_personal_eval=False)
    loop = tiny_loop(tmp_path, num_rounds=ROUNDS, topology=topology, callbacks=[cb, Gossip()], join_ratio=1.0)
    loop.fit(tiny_module(), tiny_datamodule(num_clients=CLIENTS))
    dm = tiny_datamodule(num_clients=CLIENTS)
    dm.setup("fit")

    w0 = {k: v.clone() for k, v in tiny_module().state_dict().items()}
    masks = {k: {n: m.clone() for n, m in cb.draw_mask(loop, k).items()} for k in range(CLIENTS)}  # Alg. 1 line 2
    models = {k: dict(w0) for k in range(CLIENTS)}  # each client's last trained model ...
    trained_on = {k: masks[k] for k in range(CLIENTS)}  # ... and the mask it trained with
    for t in range(ROUNDS):
        sent = {j: (models[j], trained_on[j]) for j in range(CLIENTS)}  # a synchronous round
        for k in range(CLIENTS):
            group = [k, *topology.neighbors(t, k, range(CLIENTS), loop.seed)]
            start = {}
            for n in w0:
                if n in masks[k]:
                    num = sum(sent[j][0][n] * sent[j][1][n] for j in group)
                    den = sum(sent[j][1][n].to(w0[n].dtype) for j in group)
                    start[n] = torch.where(den > 0, num / den.clamp_min(1), torch.zeros_like(num)) * masks[k][n]
                else:  # dense tensors (biases): the plain average
                    start[n] = sum(sent[j][0][n] for j in group) / len(group)
            seed = loop.streams.fit_seed("train", t, k)
            trained = plain_masked_epoch(start, {n: m.float() for n, m in masks[k].items()},
                                         dm.train_loader(k, seed=seed), seed, LR)
            rate = ALPHA0 / 2 * (1 + math.cos(math.pi * t / ROUNDS))
            grad = plain_dense_gradient(trained, dm.train_loader(k, seed=loop.streams.seed("grow", t, k)))
            models[k], trained_on[k] = trained, masks[k]
            masks[k] = {n: drop_and_grow(m, trained[n].abs(), grad[n].abs(), prune_regrow_count(m, rate))
                        for n, m in masks[k].items()}
    for k in range(CLIENTS):
        assert all(torch.equal(cb.masks(loop, k)[n], masks[k][n]) for n in masks[k]), k
        for n, v in loop.personal_state(k).items():
            torch.testing.assert_close(v, models[k][n], rtol=1e-5, atol=1e-6)


@pytest.mark.slow
def test_the_round_benchmark_counts_each_sides_operators(tmp_path: Path) -> None:
    """``benchmarks/dispfl_round.py --ops`` runs both sides in a simulated device run and prints, per round, every
    operator (an upper bound of the launches) and those on the device outside the messages (a lower bound): the
    device count is at most the whole count on each side, and the engine's messages are fewer after round 0."""
    import re
    import subprocess
    import sys

    root = Path(__file__).resolve().parents[1]
    out = subprocess.run([sys.executable, str(root / "benchmarks" / "dispfl_round.py"), "--ops", "--model", "lenet",
                          "--clients", "3", "--neighbours", "2", "--samples", "32", "--batch-size", "16",
                          "--repeats", "1", "--threads", "1"], cwd=tmp_path, capture_output=True, text=True,
                         timeout=600)
    assert out.returncode == 0, out.stderr[-2000:]
    rows = re.findall(r"^round (\d).*?plain ([\d,]+) operators \(([\d,]+) in messages, ([\d,]+) a client outside "
                      r"them\)  pl_fedsparse ([\d,]+) \(([\d,]+) in messages, ([\d,]+) a client outside them, (\d+) "
                      r"host reads\).*on the device: plain ([\d,]+) a client, pl_fedsparse ([\d,]+)$", out.stdout,
                      re.M)
    assert [r[0] for r in rows] == ["0", "1"], out.stdout
    for row in rows:
        n = [int(x.replace(",", "")) for x in row]
        assert n[8] <= n[3] and n[9] <= n[6] and n[7] == 0, row
    assert int(rows[1][5].replace(",", "")) < int(rows[1][2].replace(",", "")), rows[1]
