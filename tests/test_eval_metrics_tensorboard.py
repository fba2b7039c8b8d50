"""Per-client metrics beyond accuracy (macro-F1, expected calibration error) checked against hand computations, and
what a run writes to TensorBoard (sections, per-client histograms, the config, hparams) read back with
tensorboard's own event reader."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch
from conftest import TINY_CLI, fit_rows, tiny_datamodule, tiny_loop, tiny_module
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

from pl_fedsparse import ConfigError
from pl_fedsparse.evaluation import ECE_BINS, logits_metrics
from pl_fedsparse.executors.base import load_state
from pl_fedsparse.run.writer import tensorboard_tag


def hand_f1_macro(pred: np.ndarray, true: np.ndarray) -> float:
    """Macro-F1 over the classes that occur in the labels or the predictions."""
    scores = []
    for c in sorted(set(pred.tolist()) | set(true.tolist())):
        tp = int(((pred == c) & (true == c)).sum())
        fp = int(((pred == c) & (true != c)).sum())
        fn = int(((pred != c) & (true == c)).sum())
        scores.append(2 * tp / (2 * tp + fp + fn))
    return float(np.mean(scores))


def hand_ece(probs: np.ndarray, true: np.ndarray, bins: int = ECE_BINS) -> float:
    """Top-label ECE with equal-width bins (right-closed), weighted by the share of samples in each bin."""
    conf, pred = probs.max(1), probs.argmax(1)
    total = 0.0
    for b in range(bins):
        lo, hi = b / bins, (b + 1) / bins
        inside = (conf > lo) & (conf <= hi)
        if inside.any():
            total += inside.mean() * abs(float((pred[inside] == true[inside]).mean()) - float(conf[inside].mean()))
    return total


def test_f1_and_ece_of_a_hand_made_example() -> None:
    logits = torch.tensor([[3.0, 0.0, 0.0], [0.0, 2.0, 0.0], [1.0, 0.0, 0.5], [0.0, 0.0, 4.0], [0.2, 0.1, 0.0]])
    labels = torch.tensor([0, 1, 2, 2, 1])
    m = logits_metrics(logits, labels, ["f1_macro", "ece"])
    # predictions 0, 1, 0, 2, 0: class 0 tp 1 fp 2 -> 0.5; class 1 tp 1 fn 1 -> 2/3; class 2 tp 1 fn 1 -> 2/3
    assert m["f1_macro"] == pytest.approx((0.5 + 2 / 3 + 2 / 3) / 3)
    assert m["ece"] == pytest.approx(hand_ece(logits.softmax(1).numpy(), labels.numpy()), abs=1e-6)
    assert m["acc"] == pytest.approx(3 / 5)


def test_eval_metrics_in_a_run_match_a_hand_computation(tmp_path: Path) -> None:
    loop = tiny_loop(tmp_path, num_rounds=1, eval_metrics=["f1_macro", "ece"])
    loop.fit(tiny_module(), tiny_datamodule())
    row = json.loads((tmp_path / "metrics.jsonl").read_text().splitlines()[-1])
    f1s, eces, ns = [], [], []
    for k in range(loop.num_clients):
        load_state(loop.model, loop.personal_state(k))  # type: ignore[arg-type]
        logits, labels = loop.predict(k, "test")
        f1s.append(hand_f1_macro(logits.argmax(1).numpy(), labels.numpy()))
        eces.append(hand_ece(logits.softmax(1).numpy(), labels.numpy()))
        ns.append(len(labels))
    assert row["f1_macro_mean"] == pytest.approx(np.mean(f1s), abs=1e-6)
    assert row["f1_macro_weighted"] == pytest.approx(np.average(f1s, weights=ns), abs=1e-6)
    assert row["ece_mean"] == pytest.approx(np.mean(eces), abs=1e-5)
    assert row["ece_top10"] == pytest.approx(max(eces), abs=1e-5)  # fewer than 10 clients: the worst one
    assert row["global_f1_macro"] == pytest.approx(row["f1_macro_mean"])  # FedAvg: personal = global


def test_unknown_eval_metric_is_a_config_error(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="trainer.eval_metrics='auroc'"):
        tiny_loop(tmp_path, eval_metrics=["auroc"])


def test_tags_read_like_the_metrics_table() -> None:
    assert tensorboard_tag("acc_bottom10") == "accuracy/acc_bottom10"
    assert tensorboard_tag("f1_macro_mean") == "accuracy/f1_macro_mean"
    assert tensorboard_tag("flops_train") == "flops/flops_train"
    assert tensorboard_tag("time_s") == "time/time_s"
    assert tensorboard_tag("train_loss") == "train/train_loss"
    assert tensorboard_tag("contrast_s5/global_acc") == "contrast_s5/global_acc"


def test_tensorboard_has_sections_histograms_config_and_hparams(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                                 capsys: pytest.CaptureFixture[str]) -> None:
    monkeypatch.chdir(tmp_path)
    run = tmp_path / "run"
    fit_rows([*TINY_CLI, "--trainer.num_rounds", "2", "--trainer.default_root_dir", str(run),
              "--trainer.callbacks+=pl_fedsparse.callbacks.TopKUpload",
              "--trainer.callbacks+=pl_fedsparse.callbacks.ElementwiseAggregation",
              "--trainer.eval_metrics", "[f1_macro]"], capsys)
    events = EventAccumulator(str(run / "tensorboard"), size_guidance={"tensors": 0, "histograms": 0})
    events.Reload()
    tags = events.Tags()
    assert {"accuracy/acc_mean", "accuracy/f1_macro_mean", "comm/comm_bytes_up", "time/time_s"} <= set(tags["scalars"])
    assert not [t for t in tags["scalars"] if "/" not in t]  # every scalar in a section
    hist = events.Histograms("clients/acc")
    assert [h.step for h in hist] == [0, 1] and hist[-1].histogram_value.num == 4  # 4 clients, every round
    config = [t for t in tags["tensors"] if t.startswith("config")]
    assert config and b"TopKUpload" in events.Tensors(config[0])[0].tensor_proto.string_val[0]
    # hparams: the HPARAMS plugin's session info names the method and the final metrics sit under hparams/
    plugin = events.PluginTagToContent("hparams")
    start = plugin["_hparams_/session_start_info"]
    assert b"TopKUpload + ElementwiseAggregation" in start and b"model.lr" in start
    assert "hparams/acc_mean" in tags["scalars"] and "hparams/comm_cum_bytes_total" in tags["scalars"]
