"""``pl-fed report``: the comparison table on hand-made run directories, the CSV, the figures, bad input."""

from __future__ import annotations

import csv
import json
from pathlib import Path
from typing import Any

import pytest

from pl_fedsparse import ConfigError
from pl_fedsparse.run.report import main, markdown_table, table_rows, write_report
from pl_fedsparse.run.runs import load_run


def make_run(d: Path, accs: list[float], cum_bytes: list[int], callbacks: list[str] | None = None,
             finished: bool = True, extra: dict[str, Any] | None = None) -> Path:
    d.mkdir(parents=True)
    rows = [{"round": r, "evaluated": True, "acc_mean": a, "acc_weighted": a + 0.01, "acc_bottom10": a - 0.1,
             "global_acc": a - 0.05, "comm_cum_bytes_total": b, **(extra or {})}
            for r, (a, b) in enumerate(zip(accs, cum_bytes))]
    (d / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    cbs = [{"class_path": f"pl_fedsparse.callbacks.{c}"} for c in callbacks or []]
    (d / "config.yaml").write_text(json.dumps({"trainer": {"callbacks": cbs}}))  # JSON is YAML
    if finished:
        (d / "summary.json").write_text(json.dumps({
            "final": rows[-1], "client_acc": [accs[-1] - 0.1, accs[-1] + 0.1], "comm_cum_bytes_total": cum_bytes[-1],
            "flops_train_cum": 1.5e12, "time_cum_s": 42.0}))
    return d


def test_table_from_hand_made_runs(tmp_path: Path) -> None:
    a = make_run(tmp_path / "fedavg", [0.5, 0.7], [10_000_000, 20_000_000])
    b = make_run(tmp_path / "pse", [0.6, 0.9], [1_000_000, 2_500_000], ["TopKUpload", "ElementwiseAggregation"],
                 finished=False, extra={"f1_macro_mean": 0.8})
    table = markdown_table([load_run(a), load_run(b)])
    lines = table.splitlines()
    assert lines[0].startswith("| run | method | rounds | acc mean % | acc weighted % | acc bottom decile % |")
    assert "F1 macro %" in lines[0] and "shift avg" not in lines[0]  # columns only where some run has the metric
    assert "| fedavg | FedAvg | 2 | 70.00 | 71.00 | 60.00 | 65.00 |" in lines[2]
    assert "| 20.0 | 1.500e+12 | 42 |" in lines[2]
    assert lines[3].startswith("| pse (unfinished) | TopKUpload + ElementwiseAggregation | 2 | 90.00 |")
    assert "| 80.00 | 2.5 |" in lines[3]  # F1 from the last row; bytes of an unfinished run from the last row


def test_method_label_leaves_out_evaluation_only_callbacks(tmp_path: Path) -> None:
    """FedAvg evaluated under shift is FedAvg, not "ShiftEvaluation"; a method's own callbacks stay in the label; a
    class outside the library is named as written (its module is never imported to ask)."""
    shift = load_run(make_run(tmp_path / "fedavg_shift", [0.5], [1], ["ShiftEvaluation"]))
    dm = load_run(make_run(tmp_path / "dm", [0.5], [1], ["DualMask", "AdaptiveInference", "ShiftEvaluation"]))
    assert shift.method == "FedAvg"
    assert dm.method == "DualMask + AdaptiveInference"
    user = tmp_path / "user"
    make_run(user, [0.5], [1])
    (user / "config.yaml").write_text(json.dumps({"trainer": {"callbacks": [
        {"class_path": "not_importable_anywhere.ShiftEvaluation"}]}}))
    assert load_run(user).method == "ShiftEvaluation"


def test_report_files_and_figures(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    pytest.importorskip("matplotlib")
    a = make_run(tmp_path / "a", [0.5, 0.7], [10, 20])
    b = make_run(tmp_path / "b", [0.6, 0.8], [1, 2])
    out = tmp_path / "rep"
    assert main([str(a), str(b), "--out", str(out), "--names", "FedAvg", "FedPSE"]) == 0
    printed = capsys.readouterr().out
    assert "| FedAvg | FedAvg | 2 | 70.00 |" in printed
    with open(out / "report.csv", newline="") as f:
        rows = list(csv.reader(f))
    assert rows[0][:4] == ["run", "method", "rounds", "acc mean %"] and rows[2][0] == "FedPSE"
    assert float(rows[2][3]) == pytest.approx(0.8)  # raw values in the CSV
    for name in ("acc_vs_round.png", "acc_vs_traffic.png", "client_acc.png"):
        data = (out / name).read_bytes()
        assert data[:8] == b"\x89PNG\r\n\x1a\n" and len(data) > 5000


def test_without_matplotlib_the_table_is_still_written(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    import builtins

    real_import = builtins.__import__

    def no_matplotlib(name: str, *args: Any, **kw: Any) -> Any:
        if name.split(".")[0] == "matplotlib":
            raise ImportError(name)
        return real_import(name, *args, **kw)

    monkeypatch.setattr(builtins, "__import__", no_matplotlib)
    result = write_report([load_run(make_run(tmp_path / "a", [0.5], [1]))], tmp_path / "rep")
    assert (tmp_path / "rep" / "report.md").exists() and result["figures"] == []
    assert "matplotlib is not installed" in result["figures_skipped"]


def test_bad_input_is_a_one_line_error(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main([str(tmp_path / "missing")]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("pl-fed report: error: run_dir=") and "no such directory" in err and "\n" not in err
    (tmp_path / "afile").write_text("x")
    assert main([str(tmp_path / "afile")]) == 2
    assert "is invalid: a file; expected a run directory" in capsys.readouterr().err
    (tmp_path / "empty").mkdir()
    assert main([str(tmp_path / "empty")]) == 2
    assert "has no metrics.jsonl" in capsys.readouterr().err
    bad = tmp_path / "bad"
    bad.mkdir()
    (bad / "metrics.jsonl").write_text('{"round": 0}\nnot json\n')
    assert main([str(bad)]) == 2
    assert "metrics.jsonl line 2 is not JSON" in capsys.readouterr().err
    ok = make_run(tmp_path / "ok", [0.5], [1])
    assert main([str(ok), "--names", "a", "b"]) == 2
    assert "2 names for 1 runs" in capsys.readouterr().err
    other = make_run(tmp_path / "other", [0.6], [1])
    assert main([str(ok), str(other), "--names", "a", "a", "--no-figures", "--out", str(tmp_path / "r")]) == 2
    assert "names=['a', 'a'] is invalid: 'a' given twice; expected distinct names" in capsys.readouterr().err
    assert main([str(ok), "--metrics", "nosuch", "--no-figures", "--out", str(tmp_path / "r")]) == 2
    err = capsys.readouterr().err
    assert "metrics=['nosuch'] is invalid: no run has that key in its final row; expected keys such as " in err
    assert "acc_mean" in err and not (tmp_path / "r").exists()


def test_a_running_runs_cut_last_line_is_left_out_not_refused(tmp_path: Path,
                                                             capsys: pytest.CaptureFixture[str]) -> None:
    """A run killed while appending its row leaves a cut last line (its resume rewrites the file): the report reads
    the rows before it; a bad line elsewhere is still refused."""
    run = make_run(tmp_path / "cut", [0.5, 0.6], [1, 2], finished=False)
    with open(run / "metrics.jsonl", "a") as f:
        f.write('{"round": 2, "evaluated": true, "acc_me')
    assert [r["round"] for r in load_run(run).rows] == [0, 1]
    (run / "metrics.jsonl").write_text('{"round": 0, "eval\n{"round": 1, "evaluated": true, "acc_mean": 0.5}\n')
    with pytest.raises(ConfigError, match="metrics.jsonl line 1 is not JSON"):
        load_run(run)


def test_pl_fed_report_subcommand(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    from conftest import run_main

    run = make_run(tmp_path / "a", [0.5, 0.6], [1, 2])
    code, out, err = run_main(["report", str(run), "--out", str(tmp_path / "rep"), "--no-figures"], capsys)
    assert code == 0 and "| a | FedAvg | 2 | 60.00 |" in out and (tmp_path / "rep" / "report.csv").exists()
    code, _, err = run_main(["report", str(tmp_path / "nope")], capsys)
    assert code == 2 and "run_dir=" in err


def test_extra_metrics_and_a_baseline(tmp_path: Path) -> None:
    a = make_run(tmp_path / "fedavg", [0.5, 0.7], [10_000_000, 20_000_000], extra={"shift50/acc_mean": 0.4})
    b = make_run(tmp_path / "sparse", [0.6, 0.9], [1_000_000, 5_000_000])
    header, cells, raw = table_rows([load_run(a), load_run(b)], ["shift50/acc_mean"], baseline="fedavg")
    assert header[-3:] == ["shift50/acc_mean %", "bytes vs fedavg %", "FLOPs vs fedavg %"]
    assert cells[0][-3:] == ["40.00", "100.00", "100.00"]
    assert cells[1][-3:] == ["-", "25.00", "100.00"]  # 5 MB / 20 MB; the sparse run has no shift view
    assert raw[1][-2] == pytest.approx(0.25)
    with pytest.raises(ConfigError, match="baseline='nope' is invalid: no run of that name; expected one of fedavg"):
        table_rows([load_run(a)], baseline="nope")


def _seeded(d: Path, acc: float, seed: int, lr: float = 0.1, **extra_cfg: Any) -> Path:
    make_run(d, [acc - 0.1, acc], [100, 200], ["Gossip"])
    cfg = {"seed_everything": seed, "trainer": {"callbacks": [{"class_path": "pl_fedsparse.callbacks.Gossip"}],
                                                "default_root_dir": str(d)},
           "model": {"lr": lr}, "data": {"seed": seed, **extra_cfg}}
    (d / "config.yaml").write_text(json.dumps(cfg))
    return d


def test_runs_that_differ_only_in_seed_are_one_row_with_mean_and_std(tmp_path: Path) -> None:
    from pl_fedsparse.run.report import seed_table
    from pl_fedsparse.run.runs import seed_groups

    runs = [load_run(_seeded(tmp_path / "a0", 0.6670, 0)), load_run(_seeded(tmp_path / "b0", 0.5, 0, lr=0.05)),
            load_run(_seeded(tmp_path / "a1", 0.6301, 1)),
            load_run(_seeded(tmp_path / "a2", 0.6485, 2, image_size=None))]  # a key a later version added
    groups = seed_groups(runs)
    assert [[r.name for r in g.runs] for g in groups] == [["a0", "a1", "a2"], ["b0"]]
    assert groups[0].seeds == [0, 1, 2]
    md, table_csv = seed_table(runs)
    row = next(line for line in md.splitlines() if line.startswith("| a0, a1, a2 "))
    assert "| 64.85 ± 1.85 (3) |" in row  # mean and sample std of 66.70, 63.01, 64.85
    assert "| 50.00 (1) |" in md  # a single seed: no spread to show
    parsed = list(csv.reader(table_csv.splitlines()))
    assert parsed[1][4:7] == ["0.6485333333333333", str(parsed[1][5]), "3"]
    assert float(parsed[1][5]) == pytest.approx(0.018450, abs=1e-5)


def test_write_report_adds_the_seed_table_only_when_seeds_repeat(tmp_path: Path) -> None:
    one = [load_run(_seeded(tmp_path / "x0", 0.6, 0)), load_run(_seeded(tmp_path / "y0", 0.6, 0, lr=0.5))]
    assert not (write_report(one, tmp_path / "r1", figures=False)["table"].parent / "seeds.md").exists()
    two = [*one, load_run(_seeded(tmp_path / "x1", 0.7, 1))]
    out = write_report(two, tmp_path / "r2", figures=False)["table"].parent
    assert "x0, x1" in (out / "seeds.md").read_text() and (out / "seeds.csv").is_file()


def test_seed_groups_get_a_mean_line_and_a_std_band(tmp_path: Path) -> None:
    from pl_fedsparse.run.runs import seed_curve, seed_groups

    runs = [load_run(_seeded(tmp_path / f"s{i}", acc, i)) for i, acc in enumerate([0.60, 0.70, 0.65])]
    rounds, mean, std = seed_curve(seed_groups(runs)[0])
    assert rounds == [1, 2]  # 1-based, the rounds every seed evaluated
    assert mean == pytest.approx([0.55, 0.65]) and std == pytest.approx([0.05, 0.05])  # sample std of .6, .7, .65
    pytest.importorskip("matplotlib")
    out = write_report(runs, tmp_path / "r")
    assert tmp_path / "r" / "acc_vs_round_seeds.png" in out["figures"]
    single = write_report(runs[:1], tmp_path / "r1")
    assert not any(p.name == "acc_vs_round_seeds.png" for p in single["figures"])
