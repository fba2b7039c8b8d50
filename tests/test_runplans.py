"""The recorded plans of ``papers/<paper>/`` resolve: each planned ``pl-fed fit`` parses (``--print_config``: no training,
no data), and the one setting a study varies reaches the configuration — so a renamed config or argument fails here,
not hours into a worker. The plans that became sweeps (``configs/sweeps/``) list the same runs as the scripts they
replaced: the same names, configs, seeds and overrides, and (slow) the same resolved configuration."""

from __future__ import annotations

import importlib
import json
import sys
from pathlib import Path

import pytest
import yaml

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "benchmarks"))  # runplan
for _paper in ("dmpfl", "fedpse"):  # the plan scripts, imported by name as their workers run them
    sys.path.insert(0, str(ROOT / "papers" / _paper))

import runplan  # noqa: E402

from pl_fedsparse.sweep import SweepRun, campaign


@pytest.fixture(autouse=True)
def _at_the_root(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(ROOT)  # the plans name configs relative to the checkout, as their workers run them


def _plan(module: str, monkeypatch: pytest.MonkeyPatch, **env: str) -> list[runplan.Run]:
    for k, v in env.items():
        monkeypatch.setenv(k, v)
    sys.modules.pop(module, None)  # module constants read the environment at import
    return importlib.import_module(module).plan()


def _dual_mask(cfg: dict) -> dict:
    return next(cb["init_args"] for cb in cfg["trainer"]["callbacks"] if cb["class_path"].endswith(".DualMask"))


def test_the_iterations_plan_sets_iterations(monkeypatch: pytest.MonkeyPatch) -> None:
    runs = [r for r in _plan("dmpfl_iterations", monkeypatch, DMPFL_ITER_DATA="/nonexistent")
            if r.meta["seed"] == 0]
    assert [r.meta["iterations"] for r in runs] == [0, 1, 2]
    for run in runs:
        cfg = runplan.resolve(run)
        assert _dual_mask(cfg)["iterations"] == run.meta["iterations"], run.name
        assert cfg["seed_everything"] == 0 and cfg["data"]["seed"] == 0
        assert [cb["class_path"].rsplit(".", 1)[1] for cb in cfg["trainer"]["callbacks"]] == [
            "DualMask", "AdaptiveInference", "ShiftEvaluation"]  # the card's other callbacks are kept


def test_iterations_2_is_the_tables_command(monkeypatch: pytest.MonkeyPatch) -> None:
    """The same-code check compares iter2_seed<s> with the table's dmpfl_plus_seed<s>: same arguments."""
    it = {r.name: r for r in _plan("dmpfl_iterations", monkeypatch, DMPFL_ITER_DATA="/d")}
    table = {r.name: r for r in _plan("dmpfl_table", monkeypatch, DMPFL_TABLE_DATA="/d")}
    for s in (0, 1, 2):
        assert _arguments(it[f"iter2_seed{s}"].args) == _arguments(table[f"dmpfl_plus_seed{s}"].fit_args())


def test_the_synthetic_alpha_sweep_sets_each_schedule(monkeypatch: pytest.MonkeyPatch) -> None:
    mod_runs = _plan("dmpfl_alpha_sweep", monkeypatch)
    variants = sys.modules["dmpfl_alpha_sweep"].VARIANTS
    runs = [r for r in mod_runs if r.meta["seed"] == 1]
    assert len(runs) == len(variants) == 5
    for run in runs:
        cfg = runplan.resolve(run)
        got = _dual_mask(cfg)
        assert {k: got[k] for k in variants[run.meta["variant"]]} == variants[run.meta["variant"]], run.name
        assert cfg["seed_everything"] == 1 and cfg["data"]["seed"] == 1


def test_the_100_round_table_plan(monkeypatch: pytest.MonkeyPatch) -> None:
    runs = _plan("dmpfl_table", monkeypatch, DMPFL_TABLE_ROUNDS="100", DMPFL_TABLE_DATA="/d",
                 DMPFL_TABLE_METHODS="dmpfl_plus,fedavg,fedavg_ft")
    assert sorted({r.name.rsplit("_seed", 1)[0] for r in runs}) == ["dmpfl_plus", "fedavg", "fedavg_ft"]
    assert len(runs) == 9
    mod = sys.modules["dmpfl_table"]
    assert mod.RECORD.name == "dmpfl_table_r100" and mod.RUNS.name == "dmpfl_table_r100"
    args = mod.sweep_args()
    assert args[args.index("--record") + 1] == str(mod.RECORD) and args[args.index("--out") + 1] == str(mod.RUNS)
    for run in runs[:3]:
        assert runplan.resolve(runplan.Run(run.name, run.fit_args()))["trainer"]["num_rounds"] == 100, run.name
    with pytest.raises(SystemExit, match="DMPFL_TABLE_METHODS=ditto,nope is invalid: expected names from dmpfl_plus"):
        _plan("dmpfl_table", monkeypatch, DMPFL_TABLE_METHODS="ditto,nope")



def test_the_long_fedpse_plan_is_the_protocol_runs_continued(monkeypatch: pytest.MonkeyPatch,
                                                             tmp_path: Path) -> None:
    """FedPSE's long plan runs the recorded 5-round protocol runs' exact settings (split, lr, batch, seeds) for 20
    rounds, then 100: only the horizon and the evaluation / checkpoint cadence differ; a 100-round run continues its
    20-round run's directory only when that is on this machine."""
    _plan("fedpse_long", monkeypatch, FEDPSE_LONG_DATA="/d")
    mod = sys.modules["fedpse_long"]
    monkeypatch.setattr(mod, "RUNS", tmp_path)  # no run directories (this machine's may hold 20-round runs)
    runs = mod.plan()
    assert len(runs) == 24 and runs[0].meta["seed"] == 0
    assert [r.meta["rounds"] for r in runs] == [20] * 12 + [100] * 12
    assert all(r.start_from is None for r in runs)  # no 20-round run directory here
    for run in (runs[0], runs[11], runs[12], runs[-1]):
        cfg = runplan.resolve(run)
        old_dir = ROOT / "papers/fedpse/records/fedpse_protocol" / run.name.rsplit("_r", 1)[0]
        old = yaml.safe_load((old_dir / "config.yaml").read_text())
        assert cfg["trainer"]["num_rounds"] == run.meta["rounds"] and cfg["trainer"]["eval_every"] == 5, run.name
        assert cfg["trainer"]["checkpoint_every"] == 5
        assert cfg["trainer"]["flush_denormal"] is (run.meta["rounds"] == 100), run.name  # (speed; see the plan)
        for key in ("noniid_order", "noniid_ratio", "num_clients", "batch_size", "seed", "partition"):
            assert cfg["data"][key] == old["data"][key], (run.name, key)
        assert cfg["model"] == old["model"] and cfg["seed_everything"] == old["seed_everything"]
        assert cfg["trainer"]["callbacks"] == old["trainer"]["callbacks"]
    (tmp_path / runs[0].name).mkdir()
    cont = {r.name: r.start_from for r in mod.plan() if r.meta["rounds"] == 100}
    assert cont[runs[12].name] == tmp_path / runs[0].name and runs[12].name == runs[0].name[:-3] + "r100"
    assert sum(v is not None for v in cont.values()) == 1


def test_the_fedpse_protocol_plan_reads_the_split_both_ways(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    """FedPSE's protocol plan under the literal reading (``--order sorted``) is the recorded runs of the paper's split
    with only the split changed, recorded in a folder of its own; its run directories never meet the halves runs'.
    ``--seeds`` adds seeds to either plan, ``--lams`` keeps some λ only."""
    monkeypatch.setenv("FEDPSE_TABLES_RUNS", str(tmp_path))
    sys.modules.pop("fedpse_tables", None)  # module constants read the environment at import
    mod = importlib.import_module("fedpse_tables")
    assert mod.RUNS == tmp_path.resolve()
    halves, literal = mod.plan("protocol"), mod.plan("protocol", "sorted")
    assert len(halves) == 12 and [r["name"] for r in literal] == ["fedpse_protocol_sorted/" + r["name"] for r in halves]
    records = ROOT / "papers/fedpse/records"
    for h, s in zip(halves, literal):
        assert mod._record_dir(h) / h["name"] == records / "fedpse_protocol" / h["name"]
        assert mod._record_dir(s) / s["name"] == records / "fedpse_protocol_sorted" / h["name"]
        ch, cs = mod.command(h), mod.command(s)
        assert ch[ch.index("--data.noniid_order") + 1] == "halves" and cs[cs.index("--data.noniid_order") + 1] == "sorted"
        assert ch[ch.index("--trainer.default_root_dir") + 1] != cs[cs.index("--trainer.default_root_dir") + 1]
        assert [a for a in ch if a not in ("halves", "sorted") and not a.startswith(str(tmp_path))] == \
            [a for a in cs if a not in ("halves", "sorted") and not a.startswith(str(tmp_path))]
    run = literal[0]
    cfg = runplan.resolve(runplan.Run(run["name"], mod.command(run)[4:]))  # after `python -m pl_fedsparse.cli fit`
    old = yaml.safe_load((records / "fedpse_protocol" / halves[0]["name"] / "config.yaml").read_text())
    assert cfg["data"]["noniid_order"] == "sorted"
    for key in ("noniid_ratio", "num_clients", "batch_size", "seed", "partition", "max_train_samples"):
        assert cfg["data"][key] == old["data"][key], key
    assert cfg["model"] == old["model"] and cfg["seed_everything"] == old["seed_everything"]
    assert cfg["trainer"]["callbacks"] == old["trainer"]["callbacks"]
    assert cfg["trainer"]["num_rounds"] == old["trainer"]["num_rounds"] == 5
    more = mod.plan("protocol", "halves", (3, 4))
    assert [r["seed"] for r in more] == [3] * 4 + [4] * 4 and all(r["name"].endswith(f"_seed{r['seed']}") for r in more)
    cmd = mod.command(more[-1])
    assert cmd[cmd.index("--seed_everything") + 1] == cmd[cmd.index("--data.seed") + 1] == "4"
    assert [(r["seed"], r["lam"], r["method"]) for r in mod.plan("protocol", "halves", (3, 4), (0.5,))] == [
        (3, 0.5, "fedpse"), (3, 0.5, "fedavg"), (4, 0.5, "fedpse"), (4, 0.5, "fedavg")]  # ``--lams``: one λ only


def test_a_plan_whose_arguments_do_not_resolve_is_one_line(capsys: pytest.CaptureFixture[str]) -> None:
    bad = runplan.Run("bad", ["--config", "configs/cifar10_dmpfl_plus_cpu.yaml", "--trainer.callbacks",
                              '[{"class_path": "pl_fedsparse.callbacks.DualMask", "init_args": {"iterations": "x"}}]'])
    with pytest.raises(SystemExit) as e:
        runplan.check([bad])
    msg = str(e.value)
    assert msg.startswith("error: run bad: its arguments do not resolve: ") and "\n" not in msg
    assert "iterations" in msg
    with pytest.raises(SystemExit, match="no such file"):
        runplan.resolve(runplan.Run("missing", ["--config", "configs/no_such_config.yaml"]))


@pytest.mark.slow
def test_a_parked_run_resumes_on_a_fresh_machine(tmp_path: Path) -> None:
    """``park`` keeps an unfinished run's last checkpoint with the records; a worker whose machine has no run
    directory (the next session's) resumes from it instead of starting over, and the parked file goes once the run
    is recorded."""
    from conftest import TINY_CLI

    def plan(rounds: int) -> list[runplan.Run]:
        return [runplan.Run("tiny", [*TINY_CLI, "--trainer.num_rounds", str(rounds), "--trainer.eval_every", "1",
                                     "--trainer.logger", "false"])]

    record, first, fresh = tmp_path / "record", tmp_path / "machine1", tmp_path / "machine2"
    # machine 1: the run has done 2 of its 4 rounds when the session ends (no summary.json, no record)
    assert runplan.run_plan(plan(2), first, record, ROOT) == 1
    (first / "tiny" / "summary.json").unlink()
    rows_before = (record / "tiny" / "metrics.jsonl").read_text().splitlines()
    for f in (record / "tiny").iterdir():
        f.unlink()
    assert runplan.park(plan(4), first, record) == ["tiny"]
    assert runplan.parked(record, "tiny").exists()
    # machine 2: no run directory; the worker resumes from the parked checkpoint
    assert runplan.run_plan(plan(4), fresh, record, ROOT) == 1
    summary = json.loads((record / "tiny" / "summary.json").read_text())
    assert summary["resumes"] and summary["resumes"][0]["round"] == 2  # continued, not started over
    rows = [json.loads(r) for r in (record / "tiny" / "metrics.jsonl").read_text().splitlines()]
    assert [r["round"] for r in rows] == [0, 1, 2, 3]
    assert [json.loads(r)["acc_weighted"] for r in rows_before] == [r["acc_weighted"] for r in rows[:2]]
    assert "(resumed)" in (fresh / "tiny.log").read_text()
    assert not runplan.parked(record, "tiny").exists()  # recorded: the checkpoint is no longer kept
    assert runplan.park(plan(4), fresh, record) == []  # nothing left to park



def test_a_checkpoint_too_large_for_git_is_not_parked(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                      capsys: pytest.CaptureFixture[str]) -> None:
    last = tmp_path / "runs" / "big" / "checkpoints" / "last.ckpt"
    last.parent.mkdir(parents=True)
    last.write_bytes(b"x" * 3_000_000)
    monkeypatch.setattr(runplan, "PARK_LIMIT_MB", 2)
    assert runplan.park([runplan.Run("big", [])], tmp_path / "runs", tmp_path / "record") == []
    assert not runplan.parked(tmp_path / "record", "big").exists()
    assert capsys.readouterr().out == ("not parked big: its checkpoint is 3 MB, more than PARK_LIMIT_MB=2 that git "
                                       "should hold; expected a run that finishes within a session (or on a GPU)\n")


@pytest.mark.slow
def test_a_continuation_not_yet_started_parks_its_starting_point(tmp_path: Path) -> None:
    """A continuation (``start_from``) whose base run finished on this machine but which has not started parks the
    base's last checkpoint: on a fresh machine it continues from there instead of waiting for a base that is gone."""
    from conftest import TINY_CLI

    args = [*TINY_CLI, "--trainer.eval_every", "1", "--trainer.logger", "false"]
    record, first, fresh = tmp_path / "record", tmp_path / "machine1", tmp_path / "machine2"
    assert runplan.run_plan([runplan.Run("base", [*args, "--trainer.num_rounds", "2"])], first, record, ROOT) == 1
    cont = [runplan.Run("cont", [*args, "--trainer.num_rounds", "4"], start_from=first / "base")]
    assert runplan.park(cont, first, record) == ["cont"]
    assert runplan.run_plan(cont, fresh, record, ROOT) == 1  # machine 2 has no base run directory
    summary = json.loads((record / "cont" / "summary.json").read_text())
    assert summary["resumes"] and summary["resumes"][0]["round"] == 2
    assert [json.loads(r)["round"] for r in (record / "cont" / "metrics.jsonl").read_text().splitlines()] == [0, 1, 2, 3]



# ------------------------------------------------------------------------------------------------ plans that are sweeps
# The grids of the plan scripts that became sweeps, as those scripts built them (papers/dmpfl/dmpfl_table.py,
# cifar10_baselines.sh, cifar10_sparse.sh, cifar10_p2p.sh and cifar10_dmpfl.sh before they became sweeps): run name ->
# its ``pl-fed fit`` arguments, after ``fit``, as the script passed them.
_SHIFT = {"class_path": "pl_fedsparse.callbacks.ShiftEvaluation",
          "init_args": {"shifts": [0, 0.2, 0.4, 0.5, 0.6, 0.8, 1.0], "corruptions": "all", "severities": [5]}}
_DMPFL_METHODS = {  # dmpfl_table.py's METHODS = cifar10_dmpfl.sh's cases (there, dmpfl_plus was named dmpfl)
    "dmpfl_plus": ["--config", "configs/cifar10_dmpfl_plus_cpu.yaml"],
    "fedavg": ["--config", "configs/cifar10_dmpfl_cpu.yaml", "--trainer.callbacks", json.dumps([_SHIFT])],
    "fedavg_ft": ["--config", "configs/cifar10_dmpfl_cpu.yaml", "--trainer.callbacks", json.dumps(
        [{"class_path": "pl_fedsparse.callbacks.FineTune", "init_args": {"epochs": 2}}, _SHIFT])],
    "ditto": ["--config", "configs/cifar10_ditto_cpu.yaml"],
    "local": ["--config", "configs/cifar10_dmpfl_cpu.yaml", "--trainer.callbacks", json.dumps(
        [{"class_path": "pl_fedsparse.callbacks.LocalTraining"}, _SHIFT])],
    "feddst": ["--config", "configs/cifar10_feddst_cpu.yaml"],
}
_SHELL = ["--trainer.enable_progress_bar", "false", "--trainer.overwrite", "true"]  # every shell plan's own


def _old_dmpfl_table(rounds: int, data: str, runs: Path) -> dict[str, list[str]]:
    extra = [] if rounds == 30 else ["--trainer.num_rounds", str(rounds)]
    return {f"{m}_seed{s}": [*args, "--data.root", data, "--seed_everything", str(s), "--data.seed", str(s),
                             "--trainer.logger", "false", *extra, "--trainer.default_root_dir",
                             str(runs / f"{m}_seed{s}"), "--trainer.enable_progress_bar", "false"]
            for s in (0, 1, 2) for m, args in _DMPFL_METHODS.items()}


def _old_shell(configs: dict[str, str], common: list[str], out: str) -> dict[str, list[str]]:
    return {name: ["--config", config, *common, *_SHELL, "--trainer.default_root_dir", f"{out}/{name}"]
            for name, config in configs.items()}


_ROOT = "data/cifar10"  # the shell plans' default data folder
OLD_PLANS: dict[str, tuple[list[str], dict[str, list[str]]]] = {
    # plan: (its pl-fed sweep arguments now, the old script's runs)
    "cifar10_baselines": (["--grid", "configs/sweeps/cifar10_baselines.yaml"], _old_shell(
        {m: f"configs/cifar10_{m}.yaml" for m in ("local", "fedavg", "fedavg_ft")},
        ["--data.root", _ROOT, "--data.num_clients", "20", "--data.max_train_samples", "10000", "--trainer.join_ratio",
         "0.5", "--trainer.num_rounds", "30", "--trainer.eval_every", "5", "--trainer.accelerator", "cpu"],
        "benchmarks/_runs/cifar10_baselines")),
    "cifar10_sparse": (["--grid", "configs/sweeps/cifar10_sparse.yaml"], _old_shell(
        {f"fedspa_{m}": f"configs/cifar10_fedspa_{m}_cpu.yaml" for m in ("dst", "rsm")},
        ["--data.root", _ROOT, "--trainer.accelerator", "cpu"], "benchmarks/_runs/cifar10_sparse")),
    "cifar10_p2p": (["--grid", "configs/sweeps/cifar10_p2p.yaml"], _old_shell(
        {m: f"configs/cifar10_{m}_cpu.yaml" for m in ("dispfl", "dpsgd", "dpsgd_ft", "local_p2p")},
        ["--data.root", _ROOT, "--trainer.accelerator", "cpu"], "benchmarks/_runs/cifar10_p2p")),
    "cifar10_dmpfl": (["--grid", "configs/sweeps/cifar10_dmpfl.yaml"], {
        name: [*args, "--data.root", _ROOT, *_SHELL, "--trainer.default_root_dir",
               f"benchmarks/_runs/cifar10_dmpfl/{name}"]
        for name, args in ((("dmpfl" if m == "dmpfl_plus" else m), a) for m, a in _DMPFL_METHODS.items())}),
}


def _arguments(args: list[str]) -> dict[str, object]:
    """``--key value`` pairs as a dict, each value as ``pl-fed fit`` reads it (JSON where it parses)."""
    assert len(args) % 2 == 0 and all(k.startswith("--") for k in args[::2]), args
    out: dict[str, object] = {}
    for key, value in zip(args[::2], args[1::2]):
        assert key not in out, key  # given twice: which one wins would depend on the order
        try:
            out[key] = json.loads(value)
        except ValueError:
            out[key] = value
    return out


def _same_runs(new: list[SweepRun], out: Path, old: dict[str, list[str]], overwrite: bool) -> None:
    """The sweep's runs are the old script's: the same names in the same order, each with the same config, seed and
    overrides (a seed the old script left to its config is the config's ``seed_everything``). The old scripts passed
    ``--trainer.overwrite true`` (``overwrite``): a sweep resumes or skips a run directory instead."""
    assert [r.name for r in new] == list(old)
    for run in new:
        want = _arguments(old[run.name])
        if overwrite:
            assert want.pop("--trainer.overwrite") is True
        if "--seed_everything" not in want:
            want["--seed_everything"] = yaml.safe_load((ROOT / str(want["--config"])).read_text())["seed_everything"]
        got = _arguments(run.command(out)[4:])  # after python -m pl_fedsparse.cli fit
        assert got == want, run.name
        assert run.state(out) == "new" or run.command(out)[4:] != run.fit_args()  # (a resume is its own config)


@pytest.mark.parametrize("plan", sorted(OLD_PLANS))
def test_a_shell_plan_is_the_same_grid_as_a_sweep(plan: str) -> None:
    argv, old = OLD_PLANS[plan]
    c = campaign(argv)
    assert c.record is None and c.out == Path(f"benchmarks/_runs/{plan}")
    _same_runs(c.runs, c.out, old, overwrite=True)


@pytest.mark.parametrize("rounds", [30, 100])
def test_the_dmpfl_table_plan_is_the_same_grid_as_a_sweep(rounds: int, monkeypatch: pytest.MonkeyPatch) -> None:
    runs = _plan("dmpfl_table", monkeypatch, DMPFL_TABLE_DATA="/d", DMPFL_TABLE_ROUNDS=str(rounds))
    mod = sys.modules["dmpfl_table"]
    suffix = "" if rounds == 30 else f"_r{rounds}"
    assert mod.RUNS == ROOT / "benchmarks" / "_runs" / f"dmpfl_table{suffix}"  # where the old plan kept them
    assert mod.RECORD == ROOT / "papers" / "dmpfl" / "records" / f"dmpfl_table{suffix}"
    c = campaign(mod.sweep_args())
    assert (c.out, c.record) == (mod.RUNS, mod.RECORD) and c.runs == runs
    _same_runs(runs, mod.RUNS, _old_dmpfl_table(rounds, "/d", mod.RUNS), overwrite=False)
    # the records the docs cite are this sweep's runs and its extra seeds' (``--extra``), the sweep's all done: a
    # sweep started now runs nothing
    extra = mod.plan(extra=True)
    assert {r.name for r in extra} == ({f"{m}_seed{s}" for m in mod.EXTRA_METHODS for s in mod.EXTRA_SEEDS}
                                       if mod.EXTRA_METHODS else set())
    assert mod.EXTRA_METHODS, "both horizons have claims that were not shown at three seeds"
    recorded = {p.name for p in mod.RECORD.iterdir() if (p / "summary.json").exists()}
    assert {r.name for r in runs} <= recorded <= {r.name for r in runs} | {r.name for r in extra}
    assert all(r.state(ROOT / "nowhere", mod.RECORD) == "done" for r in runs)


@pytest.mark.slow
@pytest.mark.parametrize("plan", ["dmpfl_table", "dmpfl_table_r100", *sorted(OLD_PLANS)])
def test_a_plan_that_became_a_sweep_resolves_to_the_old_configuration(plan: str,
                                                                      monkeypatch: pytest.MonkeyPatch) -> None:
    """Every run's whole configuration (``--print_config``) is the old script's, run by run."""
    if plan.startswith("dmpfl_table"):
        rounds = 100 if plan.endswith("r100") else 30
        runs = _plan("dmpfl_table", monkeypatch, DMPFL_TABLE_DATA="/d", DMPFL_TABLE_ROUNDS=str(rounds))
        old, out = _old_dmpfl_table(rounds, "/d", sys.modules["dmpfl_table"].RUNS), sys.modules["dmpfl_table"].RUNS
    else:
        c = campaign(OLD_PLANS[plan][0])
        runs, old, out = c.runs, OLD_PLANS[plan][1], c.out
    for run in runs:
        new_cfg = runplan.resolve(runplan.Run(run.name, run.command(out)[4:]))
        old_cfg = runplan.resolve(runplan.Run(run.name, old[run.name]))
        old_cfg["trainer"]["overwrite"] = new_cfg["trainer"]["overwrite"]  # (the one documented difference)
        assert new_cfg == old_cfg, run.name
