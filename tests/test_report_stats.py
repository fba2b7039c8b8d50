"""``pl-fed report``'s paired statistics: Student's t computed without scipy, checked against scipy; the verdict
rule; the degenerate cases; ``pairs.md``/``pairs.csv`` end to end on hand-made run directories."""

from __future__ import annotations

import csv
import json
import math
import random
from pathlib import Path
from typing import Any

import pytest

from pl_fedsparse.run.report import main, pair_table, seed_pairs
from pl_fedsparse.run.runs import load_run
from pl_fedsparse.run.stats import paired_difference, t_cdf, t_quantile, welch_difference

REL = 1e-9


def _values(n: int, seed: int, mean: float, spread: float) -> list[float]:
    """Fixed accuracy-like values (the same on every machine: Python's Mersenne Twister with a fixed seed)."""
    rng = random.Random(seed)
    return [round(mean + rng.gauss(0.0, spread), 4) for _ in range(n)]


# n = 2, 3, 5, 10 pairs: a clear gap, a small one, a reversed one, one that holds 0
PAIRED_CASES = [
    ([0.712, 0.695], [0.684, 0.671]),
    ([0.712, 0.695, 0.731], [0.684, 0.671, 0.690]),
    (_values(5, 1, 0.65, 0.02), _values(5, 2, 0.64, 0.02)),
    (_values(10, 3, 0.60, 0.03), _values(10, 4, 0.62, 0.03)),
    (_values(10, 5, 0.80, 0.01), _values(10, 6, 0.80, 0.01)),
]
WELCH_CASES = [
    ([0.712, 0.695], [0.684, 0.671]),
    ([0.712, 0.695, 0.731], [0.684, 0.671, 0.690, 0.702, 0.655]),
    (_values(5, 7, 0.65, 0.02), _values(10, 8, 0.64, 0.05)),
    (_values(10, 9, 0.60, 0.03), _values(3, 10, 0.62, 0.001)),
]


@pytest.mark.parametrize("df", [1, 2, 3, 4, 9, 2.7, 4.655, 30, 1000])
@pytest.mark.parametrize("q", [0.975, 0.995, 0.9, 0.6, 0.025, 0.9995])
def test_t_quantile_and_cdf_match_scipy(q: float, df: float) -> None:
    stats = pytest.importorskip("scipy.stats")
    assert t_quantile(q, df) == pytest.approx(float(stats.t.ppf(q, df)), rel=REL)
    for t in (-40.0, -2.5, -0.3, 0.0, 0.7, 2.0, 12.7, 300.0):
        assert t_cdf(t, df) == pytest.approx(float(stats.t.cdf(t, df)), rel=REL, abs=1e-300)


@pytest.mark.parametrize("a, b", PAIRED_CASES, ids=[f"n{len(a)}-{i}" for i, (a, _) in enumerate(PAIRED_CASES)])
def test_paired_difference_matches_scipy_ttest_rel(a: list[float], b: list[float]) -> None:
    stats = pytest.importorskip("scipy.stats")
    ref = stats.ttest_rel(a, b)
    ci = ref.confidence_interval(0.95)
    d = [x - y for x, y in zip(a, b)]
    r = paired_difference(a, b)
    assert r["n"] == len(a) and r["df"] == len(a) - 1
    assert r["mean"] == pytest.approx(sum(d) / len(d), rel=REL)
    assert r["std"] == pytest.approx(float(stats.tstd(d)), rel=REL)
    assert r["t"] == pytest.approx(float(ref.statistic), rel=REL)
    assert r["p"] == pytest.approx(float(ref.pvalue), rel=REL)  # two-sided
    assert (r["lo"], r["hi"]) == pytest.approx((float(ci.low), float(ci.high)), rel=REL)
    # the interval is mean ± t_{0.975, n-1} · s / √n: Student's quantile, not the normal's 1.96
    half = float(stats.t.ppf(0.975, len(a) - 1)) * float(stats.tstd(d)) / math.sqrt(len(d))
    assert r["hi"] - r["mean"] == pytest.approx(half, rel=1e-7)


@pytest.mark.parametrize("a, b", WELCH_CASES, ids=[f"n{len(a)}x{len(b)}" for a, b in WELCH_CASES])
def test_welch_difference_matches_scipy_ttest_ind(a: list[float], b: list[float]) -> None:
    stats = pytest.importorskip("scipy.stats")
    ref = stats.ttest_ind(a, b, equal_var=False)
    ci = ref.confidence_interval(0.95)
    r = welch_difference(a, b)
    assert (r["n_a"], r["n_b"]) == (len(a), len(b))
    assert r["mean"] == pytest.approx(sum(a) / len(a) - sum(b) / len(b), rel=REL)
    assert r["df"] == pytest.approx(float(ref.df), rel=REL)  # Welch–Satterthwaite
    assert r["t"] == pytest.approx(float(ref.statistic), rel=REL)
    assert r["p"] == pytest.approx(float(ref.pvalue), rel=REL)
    assert (r["lo"], r["hi"]) == pytest.approx((float(ci.low), float(ci.high)), rel=REL)


def test_verdict_follows_the_interval() -> None:
    base = [0.70, 0.65, 0.72, 0.68]
    ahead = [x + d for x, d in zip(base, [0.03, 0.04, 0.05, 0.035])]
    mixed = [x + d for x, d in zip(base, [0.05, -0.04, 0.01, -0.02])]
    up = paired_difference(ahead, base)
    assert up["lo"] > 0 and up["verdict"] == "holds"
    down = paired_difference(base, ahead)
    assert down["hi"] < 0 and down["verdict"] == "reversed"
    assert (down["lo"], down["hi"]) == pytest.approx((-up["hi"], -up["lo"]), rel=1e-12)
    assert down["p"] == pytest.approx(up["p"], rel=1e-12)  # two-sided: the same either way round
    straddle = paired_difference(mixed, base)
    assert straddle["lo"] < 0 < straddle["hi"] and straddle["verdict"] == "not shown"
    # a gap the 1.96 of the normal would call shown, Student's t with 2 seeds (12.7) does not
    two = paired_difference([0.70, 0.75], [0.65, 0.66])
    assert two["lo"] < 0 < two["hi"] and two["verdict"] == "not shown"
    assert two["mean"] - 1.96 * two["std"] / math.sqrt(2) > 0
    # and Welch's verdict by the same rule
    assert welch_difference([0.80, 0.82, 0.81], [0.70, 0.71, 0.69])["verdict"] == "holds"
    assert welch_difference([0.70, 0.71, 0.69], [0.80, 0.82, 0.81])["verdict"] == "reversed"
    assert welch_difference([0.70, 0.75, 0.80], [0.74, 0.72, 0.78])["verdict"] == "not shown"


def test_equal_differences_have_a_point_interval() -> None:
    # 0.7 - 0.6 and 0.8 - 0.7 differ in the last bits of a float: still one gap, no spread
    r = paired_difference([0.7, 0.8, 0.9], [0.6, 0.7, 0.8])
    assert r["std"] == 0.0 and r["lo"] == r["hi"] == r["mean"] == pytest.approx(0.1)
    assert r["p"] == 0.0 and r["verdict"] == "holds" and r["t"] == math.inf
    r = paired_difference([1.0, 2.0], [1.5, 2.5])  # exactly equal differences
    assert (r["mean"], r["lo"], r["hi"], r["p"], r["verdict"]) == (-0.5, -0.5, -0.5, 0.0, "reversed")
    r = paired_difference([0.1 + 0.2, 0.3, 0.5], [0.3, 0.3, 0.5])  # equal to rounding: no gap at all
    assert (r["mean"], r["lo"], r["hi"], r["p"], r["verdict"]) == (0.0, 0.0, 0.0, 1.0, "not shown")
    w = welch_difference([0.7, 0.7], [0.6, 0.6, 0.6])
    assert (w["lo"], w["hi"], w["p"], w["verdict"]) == (w["mean"], w["mean"], 0.0, "holds")
    assert w["mean"] == pytest.approx(0.1) and math.isnan(w["df"])
    w = welch_difference([0.6, 0.6], [0.6, 0.6, 0.6])
    assert (w["mean"], w["p"], w["verdict"]) == (0.0, 1.0, "not shown")


def test_fewer_than_two_values_show_nothing() -> None:
    one = paired_difference([0.8], [0.7])
    assert one["n"] == 1 and one["mean"] == pytest.approx(0.1)
    assert (one["std"], one["lo"], one["hi"], one["p"], one["verdict"]) == (None, None, None, None, "not shown")
    assert paired_difference([], [])["verdict"] == "not shown"
    w = welch_difference([0.8], [0.7, 0.6, 0.65])
    assert (w["lo"], w["hi"], w["p"], w["verdict"]) == (None, None, None, "not shown")
    with pytest.raises(ValueError, match="one pair per index"):
        paired_difference([0.1, 0.2], [0.1])
    with pytest.raises(ValueError, match="q=1.0 is invalid"):
        t_quantile(1.0, 3)
    with pytest.raises(ValueError, match="df=0 is invalid"):
        t_cdf(1.0, 0)


# --- end to end: pl-fed report over hand-made run directories

def _run(d: Path, acc: float, seed: int, method: str, lr: float = 0.1) -> Path:
    """A finished two-round run of ``method`` with final personal accuracy ``acc`` on ``seed``."""
    d.mkdir(parents=True)
    rows = [{"round": r, "evaluated": True, "acc_mean": a, "global_acc": a - 0.05,
             "comm_cum_bytes_total": 100 * (r + 1)} for r, a in enumerate([acc - 0.1, acc])]
    (d / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    (d / "summary.json").write_text(json.dumps({"final": rows[-1], "comm_cum_bytes_total": 200}))
    cfg: dict[str, Any] = {"seed_everything": seed, "model": {"lr": lr}, "data": {"seed": seed},
                           "trainer": {"callbacks": [{"class_path": f"pl_fedsparse.callbacks.{method}"}],
                                       "default_root_dir": str(d)}}
    (d / "config.yaml").write_text(json.dumps(cfg))
    return d


A_ACC = {0: 0.712, 1: 0.695, 2: 0.731}  # seed -> final acc_mean
B_ACC = {0: 0.684, 1: 0.671, 2: 0.690}
C_ACC = {5: 0.60, 6: 0.64}  # no seed in common with A or B


def test_pl_fed_report_writes_paired_gaps(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    stats = pytest.importorskip("scipy.stats")
    dirs = [_run(tmp_path / f"gossip_s{s}", a, s, "Gossip") for s, a in A_ACC.items()]
    # B's seeds in another order: the runs must be paired by seed, not by position
    dirs += [_run(tmp_path / f"topk_s{s}", B_ACC[s], s, "TopKUpload") for s in (2, 0, 1)]
    dirs += [_run(tmp_path / f"dense_s{s}", a, s, "Gossip", lr=0.5) for s, a in C_ACC.items()]
    dirs += [_run(tmp_path / "single", 0.9, 0, "DualMask")]  # one seed: compared with nothing
    out = tmp_path / "rep"
    assert main([*map(str, dirs), "--out", str(out), "--no-figures"]) == 0
    printed = capsys.readouterr().out

    seeds = sorted(A_ACC)
    a, b = [A_ACC[s] for s in seeds], [B_ACC[s] for s in seeds]
    ref = stats.ttest_rel(a, b)
    ci = ref.confidence_interval(0.95)
    gap = sum(x - y for x, y in zip(a, b)) / 3
    assert ci.low > 0  # the case is built so that the gap holds
    p_cell = "< 0.001" if ref.pvalue < 0.001 else f"{ref.pvalue:.3f}"
    row = (f"| gossip_s0 (+2) | topk_s2 (+2) | acc mean % | 3 | {100 * gap:.2f} | "
           f"[{100 * ci.low:.2f}, {100 * ci.high:.2f}] | {p_cell} | paired t | holds |")
    assert row == "| gossip_s0 (+2) | topk_s2 (+2) | acc mean % | 3 | 3.10 | [0.89, 5.31] | 0.026 | paired t | holds |"
    md = (out / "pairs.md").read_text()
    assert row in md and row in printed
    assert "single" not in md

    # A and C share no seed: Welch on all their runs, said to be unpaired
    welch = stats.ttest_ind(a, list(C_ACC.values()), equal_var=False)
    wci = welch.confidence_interval(0.95)
    wgap = sum(a) / 3 - sum(C_ACC.values()) / 2
    assert (f"| gossip_s0 (+2) | dense_s5 (+1) | acc mean % | 3 vs 2 | {100 * wgap:.2f} | "
            f"[{100 * wci.low:.2f}, {100 * wci.high:.2f}] | {welch.pvalue:.3f} | Welch t (unpaired) | not shown |"
            ) in md

    with open(out / "pairs.csv", newline="") as f:
        rows = list(csv.DictReader(f))
    assert [(r["a"], r["b"], r["metric"], r["test"]) for r in rows] == [
        ("gossip_s0 (+2)", "topk_s2 (+2)", "acc_mean", "paired t"),
        ("gossip_s0 (+2)", "dense_s5 (+1)", "acc_mean", "Welch t (unpaired)"),
        ("topk_s2 (+2)", "dense_s5 (+1)", "acc_mean", "Welch t (unpaired)")]
    first = rows[0]
    assert first["n"] == "3" and first["verdict"] == "holds"
    assert [float(first[k]) for k in ("gap", "ci low", "ci high", "p")] == pytest.approx(
        [gap, float(ci.low), float(ci.high), float(ref.pvalue)], rel=REL)  # raw fractions, as report.csv


def test_extra_metrics_are_compared_too_and_no_pairs_without_two_groups(tmp_path: Path) -> None:
    runs = [load_run(_run(tmp_path / f"a{s}", 0.70 + s / 100, s, "Gossip")) for s in range(3)]
    runs += [load_run(_run(tmp_path / f"b{s}", 0.60 + s / 50, s, "TopKUpload")) for s in range(3)]
    pairs = seed_pairs(runs, ["global_acc", "not_recorded"])
    assert [p["key"] for p in pairs] == ["acc_mean", "global_acc"]  # a key no run has is left out
    assert pairs[1]["mean"] == pytest.approx(pairs[0]["mean"]) and pairs[1]["column"] == "global acc %"
    assert seed_pairs(runs[:3]) == []  # one group: nothing to compare
    assert pair_table(runs[:3])[0].count("\n") == 2  # header only
    out = tmp_path / "rep"
    assert main([str(r.path) for r in runs[:3]] + ["--out", str(out), "--no-figures"]) == 0
    assert (out / "seeds.md").is_file() and not (out / "pairs.md").exists()
