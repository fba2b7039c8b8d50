"""The paper-table configs (DisPFL Table 1, FedSpa Table 1 on CIFAR-10): each parses, names its table row in its first
line, and has the settings that make it that row (clients, rounds, partition, model, participation, callbacks)."""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml
from conftest import run_main

REPO = Path(__file__).resolve().parents[1]
CB = "pl_fedsparse.callbacks."
RESNET, VGG = "pl_fedsparse.models.ResNet18GN", "pl_fedsparse.models.VGG11GN"

# config: (table, row, model, rounds, join_ratio, local_epochs, [(callback, {init_arg: value})])
ROWS: dict[str, tuple[str, str, str, int, float, int, list[tuple[str, dict]]]] = {
    "cifar10_dispfl_table1_local.yaml": ("DisPFL Table 1", "Local", RESNET, 500, 1.0, 5, [("LocalTraining", {})]),
    "cifar10_dispfl_table1_fedavg.yaml": ("DisPFL Table 1", "FedAvg", RESNET, 500, 0.1, 5, []),
    "cifar10_dispfl_table1_fedavg_ft.yaml": ("DisPFL Table 1", "FedAvg-FT", RESNET, 500, 0.1, 5, [
        ("FineTune", {"epochs": 5, "every": None, "start": "global", "lr": "reference"})]),
    "cifar10_dispfl_table1_ditto.yaml": ("DisPFL Table 1", "Ditto", RESNET, 500, 0.1, 2, [
        ("Ditto", {"lam": 0.5, "personal_epochs": 3})]),
    "cifar10_dpsgd.yaml": ("DisPFL Table 1", "D-PSGD", RESNET, 500, 1.0, 5, [("Gossip", {})]),
    "cifar10_dpsgd_ft.yaml": ("DisPFL Table 1", "D-PSGD-FT", RESNET, 500, 1.0, 5, [
        ("Gossip", {}), ("FineTune", {"epochs": 5, "every": 100, "start": "consensus", "lr": "reference"})]),
    "cifar10_dispfl_reference.yaml": ("DisPFL Table 1", "DisPFL", RESNET, 500, 1.0, 5, [
        ("RandomRegrow", {"density": 0.5, "distribution": "erk", "same_mask": False, "alpha0": 0.5,
                          "schedule": "cosine", "mask_gradients": False, "mask_personal_eval": False}),
        ("Gossip", {})]),
    "cifar10_fedspa_table_local.yaml": ("FedSpa Table 1", "Local", VGG, 1000, 0.1, 5, [("LocalTraining", {})]),
    "cifar10_fedspa_table_fedavg.yaml": ("FedSpa Table 1", "FedAvg", VGG, 1000, 0.1, 5, []),
    "cifar10_fedspa_table_ditto.yaml": ("FedSpa Table 1", "Ditto", VGG, 1000, 0.1, 2, [
        ("Ditto", {"lam": 0.5, "personal_epochs": 3})]),
}


@pytest.mark.parametrize("name", sorted(ROWS))
def test_paper_table_config(name: str, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch) -> None:
    table, row, model, rounds, join, epochs, callbacks = ROWS[name]
    path = REPO / "configs" / name
    first = path.read_text().splitlines()[0]
    assert first.startswith(f'# {table}, ') and f'row "{row}"' in first, first  # the header names its table row

    monkeypatch.chdir(REPO)
    code, out, err = run_main(["fit", "--config", str(path), "--print_config"], capsys)
    assert code == 0, err
    cfg = yaml.safe_load(out)
    tr, data = cfg["trainer"], cfg["data"]
    assert (tr["num_rounds"], tr["join_ratio"], tr["local_epochs"]) == (rounds, join, epochs)
    assert (data["name"], data["num_clients"], data["partition"], data["alpha"]) == ("cifar10", 100, "dirichlet", 0.3)
    assert (data["batch_size"], data["test_mode"], data["quantity_skew"]) == (128, "global", False)
    assert cfg["model"]["backbone"]["class_path"] == model
    assert (cfg["model"]["lr"], cfg["model"]["lr_decay"], cfg["model"]["weight_decay"]) == (0.1, 0.998, 5e-4)
    assert cfg["model"]["momentum"] == 0.0
    got = tr.get("callbacks") or []
    assert [c["class_path"] for c in got] == [CB + c for c, _ in callbacks]
    for c, (_, args) in zip(got, callbacks):
        assert {k: c["init_args"][k] for k in args} == args, c["class_path"]
    if table.startswith("DisPFL"):
        assert tr["gradient_clip_val"] == 10.0  # every method of the DisPFL code clips at 10
    else:
        assert data["test_per_client"] == 100 and tr.get("gradient_clip_val") is None  # as cifar10_fedspa_dst.yaml
    if join == 1.0 and "LocalTraining" not in [c for c, _ in callbacks]:  # the serverless rows: 10 random peers
        assert tr["topology"]["class_path"] == "pl_fedsparse.topology.RandomPeers"
        assert tr["topology"]["init_args"]["k"] == 10


def test_fedspa_baselines_share_the_dst_rows_training_settings() -> None:
    """The FedSpa baselines differ from the DST row only in the method, so the table compares methods."""
    dst = yaml.safe_load((REPO / "configs" / "cifar10_fedspa_dst.yaml").read_text())
    for name in (n for n in ROWS if n.startswith("cifar10_fedspa_table_")):
        cfg = yaml.safe_load((REPO / "configs" / name).read_text())
        assert cfg["data"] == dst["data"], name
        assert cfg["model"] == dst["model"], name
        assert cfg["trainer"]["num_rounds"] == dst["trainer"]["num_rounds"], name
        assert cfg["trainer"]["join_ratio"] == dst["trainer"]["join_ratio"], name
