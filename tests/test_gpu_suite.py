"""``benchmarks/gpu_suite.sh --dry-run`` runs without a GPU: every step's command parses and every timed config
resolves (CI has no GPU; the real run happens whenever a GPU is lent)."""

from __future__ import annotations

import importlib
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def _suite(*args: str) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "PYTHON": sys.executable, "OMP_NUM_THREADS": "1"}
    return subprocess.run(["bash", str(ROOT / "benchmarks" / "gpu_suite.sh"), *args], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=600, check=False)


@pytest.mark.slow
def test_the_dry_run_resolves_every_step() -> None:
    res = _suite("--dry-run")
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
    out = res.stdout
    for name in ("fedavg", "pfedgate", "fedspa_dst", "dispfl", "dmpfl", "fedpse"):
        assert f"{name}: " in out and "resolves" in out, out
    for name in ("pfedgate", "fedspa_dst", "dispfl", "dmpfl", "fedpse"):  # the papers' runs on the GPU
        assert f"{name}: " in out and "resolves (" in out and "eval every" in out, out
    for step in ("pytest -vv -p no:cacheprovider -m gpu", "overhead.py", "gpu_rounds.py run", "ray_speedup.py one",
                 "gpu_paper_runs.py run --seconds 390",
                 "vectorized.py --task lenet --clients 100 --accelerator gpu", "vectorized.py parses",
                 "profile_fit.py --config configs/cifar10_fedspa_dst.yaml --accelerator gpu --clients 10",
                 "profile_fit: configs/cifar10_fedspa_dst.yaml resolves (clients per round: 10)"):
        assert step in out, (step, out)
    assert "dry run: every step's command resolves" in out


def test_a_bad_argument_is_one_line() -> None:
    res = _suite("--only", "nonsense")
    assert res.returncode == 2
    assert res.stderr.strip() == ("error: gpu_suite.sh: --only 'nonsense' is not a step "
                                  "(allowed: env tests runner traffic server dispfl compile overhead rounds paper ray vectorized profile)")


def _cuda() -> bool:
    import torch

    return torch.cuda.is_available()


def _plans(*args: str) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "PYTHON": sys.executable, "OMP_NUM_THREADS": "1"}
    env.pop("GPU_PLANS_ANY_DEVICE", None)
    return subprocess.run(["bash", str(ROOT / "benchmarks" / "gpu_plans.sh"), *args], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=600, check=False)


@pytest.mark.slow
def test_the_long_plans_dry_run_resolves_their_remaining_runs() -> None:
    res = _plans("--dry-run", "--workers", "2", "fedpse_long", "pfedgate_table")
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
    out = res.stdout
    assert out.count("papers/fedpse/fedpse_long.py run") == 2 and out.count("papers/pfedgate/pfedgate_table.py run") == 2
    assert "fedpse_n10_lam1_seed0_r20: resolves" in out and "fedavg_n10_lam0.5_seed2_r100: resolves" in out
    assert "dry run: every plan's remaining runs resolve" in out


@pytest.mark.parametrize(("args", "message"), [
    (["--minutes", "0", "fedpse_long"], "--minutes='0' is invalid; expected a whole number of minutes >= 1"),
    (["--workers", "x", "fedpse_long"], "--workers='x' is invalid; expected a whole number of workers >= 1"),
    (["nonsense"], "plan 'nonsense' is not one of: "),
    ([], "no plan given; expected one or more of: "),
    pytest.param(["fedpse_long"], "no CUDA device is visible",  # the real run needs one
                 marks=pytest.mark.skipif(_cuda(), reason="a CUDA device is visible: the real run would start")),
])
@pytest.mark.slow
def test_the_long_plans_bad_input_is_one_line(args: list[str], message: str) -> None:
    res = _plans(*args)
    assert res.returncode == 2 and res.stdout == ""
    assert res.stderr.startswith("error: gpu_plans.sh: ") and message in res.stderr
    assert res.stderr.count("\n") == 1


def test_the_paper_runs_skip_a_paper_without_its_data(tmp_path: Path) -> None:
    """A paper whose data are missing is skipped with one line naming the path; the ledger is left as it was."""
    (tmp_path / "out").mkdir()
    ledger = tmp_path / "out" / "paper_runs.jsonl"
    ledger.write_text(next(x for x in (ROOT / "benchmarks" / "gpu" / "paper_runs.jsonl").read_text().splitlines()
                           if '"name": "dmpfl"' in x) + "\n")  # a recorded line, kept as it is
    before = ledger.read_bytes()
    res = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "gpu_paper_runs.py"), "run", "--accelerator", "cpu",
                          "--force", "--only", "dmpfl", "--data-root", str(tmp_path / "absent"),
                          "--out", str(tmp_path / "out"), "--seconds", "20", "--grace", "5"],
                         cwd=ROOT, capture_output=True, text=True, timeout=300, check=False)
    assert res.returncode == 0, res.stderr[-2000:]
    assert f"dmpfl: skipped: no cifar10 data at {tmp_path / 'absent'}" in res.stdout
    assert ledger.read_bytes() == before and not (tmp_path / "out" / "paper_runs").exists()


def _ray_parts(root: Path, *args: str) -> subprocess.CompletedProcess[str]:
    """``gpu_ray_parts.sh`` run from a copy in ``root/benchmarks`` (it works on ``root/data``)."""
    (root / "benchmarks").mkdir(exist_ok=True)
    script = root / "benchmarks" / "gpu_ray_parts.sh"
    script.write_text((ROOT / "benchmarks" / "gpu_ray_parts.sh").read_text())
    env = {**os.environ, "PYTHON": sys.executable}
    return subprocess.run(["bash", str(script), *args], cwd=root, env=env, capture_output=True, text=True,
                          timeout=120, check=False)


def test_the_ray_wheel_parts_are_joined_only_whole(tmp_path: Path) -> None:
    """The install side (no network, no pip run): each missing or wrong piece is one line, exit 2."""
    res = _ray_parts(tmp_path, "nonsense")
    assert res.returncode == 2 and res.stderr.strip() == ("error: gpu_ray_parts.sh: expected 'pack' (here) or "
                                                          "'install' (on the lent machine), got 'nonsense'")
    res = _ray_parts(tmp_path, "install")
    assert res.returncode == 2 and res.stderr.strip() == ('error: gpu_ray_parts.sh: no data/ray_b here: carry '
                                                          '["data/ray_b"] in this call')
    name = "ray-0.0-cp312-cp312-manylinux2014_x86_64.whl"
    a, b = tmp_path / "data" / "ray_a", tmp_path / "data" / "ray_b"
    b.mkdir(parents=True)
    whole = bytes(range(256)) * 64
    (b / f"{name}.part-01").write_bytes(whole[4000:])
    import hashlib

    (b / "ray.sha256").write_text(f"{hashlib.sha256(whole).hexdigest()}  {name}\n")
    res = _ray_parts(tmp_path, "install")  # the first call's part is not there (a cold machine)
    assert res.returncode == 2 and "no data/ray_a/*.part-00 here" in res.stderr and res.stderr.count("\n") == 1
    a.mkdir()
    (a / f"{name}.part-00").write_bytes(whole[:3999])  # one byte short: the join's sha256 must catch it
    res = _ray_parts(tmp_path, "install")
    assert res.returncode == 2 and res.stderr == (f"error: gpu_ray_parts.sh: the joined {name} does not match its "
                                                  "sha256 (a part is missing or from another wheel)\n"), res.stderr
    (a / f"{name}.part-00").write_bytes(whole[:4000])  # whole again: joined and checked, then pip refuses the bytes
    res = _ray_parts(tmp_path, "install")
    assert res.returncode == 2 and res.stderr == (f"error: gpu_ray_parts.sh: pip could not install {name} from the "
                                                  "carried wheels (its output: data/ray_b/pip.log)\n"), res.stderr


def _gpu_rounds():
    import importlib.util

    spec = importlib.util.spec_from_file_location("gpu_rounds_under_test", ROOT / "benchmarks" / "gpu_rounds.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


class _NoSampler:  # (no nvidia-smi in these tests)
    def __init__(self, path):
        pass

    def stop(self):
        return {}


def _offline_rounds(tmp_path, monkeypatch, popen):
    """``gpu_rounds`` writing under ``tmp_path``, its runs made by ``popen`` (a stand-in for the CLI's process)."""
    mod = _gpu_rounds()
    monkeypatch.setattr(mod, "OUT", tmp_path)
    monkeypatch.setattr(mod.subprocess, "Popen", popen)
    monkeypatch.setattr(mod, "GpuSampler", _NoSampler)
    return mod


def _run_args(**given):
    """``gpu_rounds run``'s arguments: one CIFAR-10 config for 3 rounds on the GPU, ``given`` on top."""
    import argparse

    args = {"only": ["fedavg"], "force": False, "data_root": "d", "fmnist_root": "f", "accelerator": "gpu",
            "precision": "32-true", "rounds": 3, "eval_every": 3, "seconds": 1.0, "tag": "", "extra": []}
    return argparse.Namespace(**{**args, **given})


def test_a_run_that_fails_at_once_reports_no_earlier_runs_rounds(tmp_path, monkeypatch, capsys) -> None:
    """A run that stops before its first round (a bad argument: exit 2) must not report the rows an earlier run left
    in the same folder as its own (a lease recorded an H100 run's seconds under an H200 run that had failed)."""
    import json

    class Failed:  # the CLI refusing its arguments: no rows written
        def __init__(self, cmd, cwd=None):
            self.cmd = cmd

        def wait(self, timeout=None):
            return 2

    mod = _offline_rounds(tmp_path, monkeypatch, Failed)
    old = tmp_path / "rounds" / "fedavg"
    old.mkdir(parents=True)
    (old / "metrics.jsonl").write_text(json.dumps({"round": 0, "time_train_s": 6.0, "time_s": 7.0}) + "\n")
    mod.run(_run_args(force=True))
    line = json.loads((tmp_path / "rounds.jsonl").read_text().splitlines()[-1])
    assert line["exit_code"] == 2 and line["rounds_done"] == 0 and "train_s_per_round" not in line, line


def test_a_schedule_that_needs_more_rounds_gets_them() -> None:
    """DM-PFL's two phases of two iterations need four rounds: fewer asked are raised, more are kept."""
    mod = _gpu_rounds()
    assert mod.rounds_for("dmpfl", 3) == 4 and mod.rounds_for("dmpfl", 6) == 6 and mod.rounds_for("fedavg", 3) == 3
    argv = mod.fit_args("dmpfl", _run_args(), Path("run"))
    assert argv[argv.index("--trainer.num_rounds") + 1] == "4"


def test_dmpfls_refinement_rounds_are_counted_as_often_as_the_papers_run_has_them() -> None:
    """A 4-round DM-PFL run ends two of its rounds with every client's personal refinement (Alg. 3); the paper's
    300-round run has two such rounds in all. The estimate takes the other rounds' median as the round's cost and adds
    the refinement's extra twice, not the median of a run where half the rounds refine (four times too much)."""
    mod = _gpu_rounds()
    times = [1.0, 11.0, 1.2, 12.0]
    rows = [{"round": r, "time_train_s": t, "time_s": t + (3.0 if r == 3 else 0.0), "evaluated": r in (1, 3)}
            for r, t in enumerate(times)]
    rows[1]["time_s"] += 2.0  # an evaluation of 2 s in round 1
    out = mod.summarise("dmpfl", rows, 30.0, 0, 4)
    assert out["train_s_per_round"] == pytest.approx(1.1) and out["refine_rounds_paper"] == 2
    assert out["refine_extra_s"] == pytest.approx(11.5 - 1.1)
    expected = (300 * 1.1 + 2 * (11.5 - 1.1) + (300 // 10) * 2.0 + (3.0 - 2.0)) / 3600
    assert out["full_run_estimate_h"] == pytest.approx(expected)
    plain = mod.summarise("fedavg", rows, 30.0, 0, 4)  # no refinement rule: the median of every round
    assert plain["train_s_per_round"] == pytest.approx(6.1) and "refine_extra_s" not in plain


def test_a_tagged_run_passes_its_arguments_and_is_recorded_beside_the_plain_one(tmp_path, monkeypatch) -> None:
    """``--tag ray8 -- --trainer.executor ...``: the arguments after ``--`` reach the run's ``pl-fed fit``, and the
    run is recorded as ``pfedgate+ray8`` in its own folder, so the plain run's line and rows stay."""
    import json

    (tmp_path / "rounds.jsonl").write_text(json.dumps({"name": "pfedgate", "config": "cifar10_pfedgate.yaml",
                                                       "rounds_done": 3, "paper_num_rounds": 400}) + "\n")
    seen: list[list[str]] = []

    class Done:
        def __init__(self, cmd, cwd=None):
            seen.append(cmd)
            run_dir = Path(cmd[cmd.index("--trainer.default_root_dir") + 1])
            run_dir.mkdir(parents=True, exist_ok=True)
            (run_dir / "metrics.jsonl").write_text(json.dumps({"round": 0, "time_train_s": 2.0, "time_s": 2.0}) + "\n")

        def wait(self, timeout=None):
            return 0

    mod = _offline_rounds(tmp_path, monkeypatch, Done)
    extra = ["--trainer.executor", "RayExecutor", "--trainer.executor.num_workers", "8"]
    mod.run(_run_args(only=["pfedgate"], tag="ray8", extra=extra))
    assert len(seen) == 1 and seen[0][-len(extra):] == extra  # (the plain pfedgate line did not stop the tagged run)
    assert (tmp_path / "rounds" / "pfedgate+ray8" / "metrics.jsonl").exists()
    lines = [json.loads(x) for x in (tmp_path / "rounds.jsonl").read_text().splitlines()]
    assert [x["name"] for x in lines] == ["pfedgate", "pfedgate+ray8"] and lines[1]["extra_args"] == extra
    assert lines[1]["train_s_per_round"] == 2.0


def test_the_next_leases_prepared_call_parses_and_names_what_exists() -> None:
    """``benchmarks/gpu/lease_next.sh`` (the next lease's first call, prepared where no GPU is): bash parses it,
    every script and config it runs exists, and every argument it gives a benchmark script is one that script takes
    (a rename here must not cost device time there)."""
    import re

    script = ROOT / "benchmarks" / "gpu" / "lease_next.sh"
    assert subprocess.run(["bash", "-n", str(script)], capture_output=True, check=False).returncode == 0
    text = script.read_text().replace("\\\n", " ")
    calls = re.findall(r"python3 (benchmarks/\S+\.py)((?: [^\n;&|]*)?)", text)
    assert {c[0] for c in calls} >= {"benchmarks/overhead.py", "benchmarks/gpu_rounds.py"}
    for path, args in calls:
        assert (ROOT / path).is_file(), path
        source = (ROOT / path).read_text()
        own, _, passed = args.partition(" -- ")  # after a bare --: pl-fed's own arguments, passed on
        for flag in re.findall(r"(--[a-z][a-z-]*)", own):
            assert f'"{flag}"' in source, (path, flag)
        for flag, value in re.findall(r"--([a-z_.]+) (\S+)", passed):
            assert flag.split(".")[0] in ("trainer", "model", "data"), (path, flag)
            if re.fullmatch(r"pl_fedsparse(\.\w+)+", value):  # a class path: it must import
                module, _, name = value.rpartition(".")
                assert hasattr(importlib.import_module(module), name), (path, value)
        for config in re.findall(r"(configs/\S+\.yaml)", args):
            assert (ROOT / config).is_file(), config
