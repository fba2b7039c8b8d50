"""The yardsticks of the server-work benchmarks: ``benchmarks/dispfl_round.py``'s plain DisPFL loop does DisPFL's work
(masks keep their counts through prune-and-regrow, weights stay on their masks, the masks move), and both scripts
run end to end at a tiny size and print what their records hold."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "benchmarks"))
import dispfl_round

from pl_fedsparse.data import FederatedDataModule
from pl_fedsparse.models import LeNetCIFAR
from pl_fedsparse.topology import RandomPeers


def test_the_plain_dispfl_loop_keeps_counts_and_moves_masks() -> None:
    dm = FederatedDataModule(name="synthetic", num_clients=3, partition="iid", batch_size=16, test_mode="global",
                             augment=False, synthetic={"num_train": 96, "num_test": 30, "channels": 3, "size": 32})
    dm.setup()
    torch.manual_seed(0)
    module = LeNetCIFAR(num_classes=10)
    g = torch.Generator().manual_seed(1)
    masks = [{n: torch.rand(t.shape, generator=g) < 0.5 for n, t in module.state_dict().items() if t.dim() > 1}
             for _ in range(3)]
    plain = dispfl_round.PlainDisPFL(module, dm, masks, RandomPeers(k=2), 0, 1, 0.1, 5e-4, 0.5, 4, torch.device("cpu"))
    before = [{n: m.clone() for n, m in mk.items()} for mk in plain.masks]
    plain.round(0)
    for k in range(3):
        for name, m in plain.masks[k].items():
            assert int(m.sum()) == int(before[k][name].sum())  # as many regrown as dropped
            assert not plain.models[k][name][~m].any()  # the weights live on the mask
        assert any(not torch.equal(plain.masks[k][n], before[k][n]) for n in before[k])  # readjusted


@pytest.mark.slow
@pytest.mark.parametrize("script, args, expect", [
    ("dispfl_round.py", ["--clients", "4", "--neighbours", "2", "--repeats", "1", "--samples", "64"],
     "ratio pl_fedsparse / plain"),
    ("server_work.py", ["--repeats", "1", "--clients", "2", "--neighbours", "1"], "| dmpfl_eq5 |\n| ewa |\n| gossip |"),
])
def test_the_scripts_run_end_to_end(script: str, args: list[str], expect: str) -> None:
    res = subprocess.run(check=False, args=[sys.executable, str(REPO / "benchmarks" / script), *args], capture_output=True, text=True,
                         cwd=REPO, env={**os.environ, "OMP_NUM_THREADS": "1"}, timeout=600)
    assert res.returncode == 0, res.stderr[-2000:]
    assert all(e in res.stdout for e in expect.split("\n")), res.stdout  # (each row the record holds)
