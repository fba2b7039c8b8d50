"""The top-level callbacks/ examples work from the repository root, by class_path."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from pl_fedsparse.cli import main

REPO = Path(__file__).resolve().parents[1]


def test_trimmed_mean_drops_outliers() -> None:
    from callbacks.trimmed_mean import trimmed_mean

    vals = [torch.tensor([1.0, -50.0]), torch.tensor([2.0, 0.0]), torch.tensor([3.0, 1.0]),
            torch.tensor([1000.0, 2.0]), torch.tensor([2.0, 1.0])]
    torch.testing.assert_close(trimmed_mean(vals, 0.2), torch.tensor([7 / 3, 2 / 3]))
    torch.testing.assert_close(trimmed_mean(vals, 0.0), torch.stack(vals).mean(0))


def test_trimmed_mean_config_runs_from_repo_root(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                 capsys: pytest.CaptureFixture[str]) -> None:
    monkeypatch.chdir(REPO)
    run = tmp_path / "run"
    code = main(["fit", "--config", "configs/synthetic_trimmed_mean.yaml", "--trainer.num_rounds", "2",
                 "--data.num_clients", "10", "--trainer.default_root_dir", str(run)])
    assert code == 0, capsys.readouterr().err
    rows = [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines()]
    assert rows[-1]["round"] == 1 and rows[-1]["acc_mean"] > 0.1


def test_trimmed_mean_rejects_bad_trim() -> None:
    from callbacks.trimmed_mean import TrimmedMean
    from pl_fedsparse import ConfigError

    with pytest.raises(ConfigError, match="TrimmedMean.trim=0.5"):
        TrimmedMean(trim=0.5)


def test_movement_prune_drops_weights_that_shrank(tmp_path: Path) -> None:
    from callbacks.movement_prune import MovementPrune
    from pl_fedsparse import ClientUpdate

    cb = MovementPrune(density=0.5)

    class L:
        global_state = {"w": torch.tensor([1.0, 1.0, 1.0, 0.0])}

    mask = torch.tensor([True, True, True, False])
    up = ClientUpdate(0, 0, 1, {"w": torch.tensor([2.0, 0.5, 3.0, 0.0])}, masks={"w": mask})
    score = cb.drop_score(L(), up, "w", up.state["w"])
    # entry 1 shrank (1 -> 0.5) and has the lowest score although entry 0/2 would also survive magnitude pruning
    assert int(score[:3].argmin()) == 1


def test_movement_prune_config_runs_from_repo_root(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                   capsys: pytest.CaptureFixture[str]) -> None:
    monkeypatch.chdir(REPO)
    run = tmp_path / "run"
    code = main(["fit", "--config", "configs/synthetic_movement_prune.yaml", "--trainer.num_rounds", "2",
                 "--data.num_clients", "10", "--trainer.default_root_dir", str(run)])
    assert code == 0, capsys.readouterr().err
    s = json.loads((run / "summary.json").read_text())
    mlp_params = 768 * 200 + 200 + 200 * 200 + 200 + 200 * 10 + 10  # MLP on 3x16x16, hidden [200, 200]
    dense_bytes = 2 * 5 * 2 * 4 * mlp_params  # 2 rounds x 5 clients x (down + up) x 4 B
    assert s["comm_cum_bytes_total"] < 0.75 * dense_bytes  # sparse messages at density 0.5
