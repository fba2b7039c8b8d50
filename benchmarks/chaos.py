"""Chaos: stop a seeded run at random moments — SIGKILL, SIGTERM or a disk that fills up — resume it each time as a
user would, compare with an uninterrupted run.

    OMP_NUM_THREADS=1 python benchmarks/chaos.py --trials 5 --kills 4 --seed 0                     # SIGKILL, FedAvg-FT
    OMP_NUM_THREADS=1 python benchmarks/chaos.py --fault term --config configs/synthetic_dispfl.yaml
    OMP_NUM_THREADS=1 python benchmarks/chaos.py --fault disk-full --trials 3   # root: a tmpfs that fills up
    OMP_NUM_THREADS=1 python benchmarks/chaos.py --all --out-record benchmarks/chaos_all.json      # the matrix
    OMP_NUM_THREADS=1 python benchmarks/chaos.py --catalogue --out-record benchmarks/chaos/catalogue.txt

``kill``: start ``pl-fed fit`` into a fresh run directory, SIGKILL it after a random delay, and continue the run —
the README's resume command when ``checkpoints/last.ckpt`` exists, else a plain rerun of the same command — killing
it again until ``--kills`` kills have landed, then let it finish. One kill in three waits for a checkpoint or run
file being written (a ``.tmp`` file in the run) and kills right then.

``term``: the same with SIGTERM (a scheduler's preemption). Every stop must be clean: exit 143, one
``terminated (SIGTERM): resume with `...``` line, no traceback, no ``.lock`` and no ``.tmp`` file left; the run goes
on with the printed command.

``disk-full`` (Linux, root): the run directory is a tmpfs sized at 30–90 % of the uninterrupted run's directory, so
the disk fills up mid-run. The stop must be clean (exit 74, one line naming the file, no ``.lock``, no ``.tmp``);
then the tmpfs is enlarged ("space freed") and the printed resume command (or a rerun, when no checkpoint was
written) finishes the run.

In every mode the final ``metrics.jsonl`` (every key but wall times) must equal the uninterrupted run's. Prints one
line per trial and a summary.

``--catalogue``: the cases of ``benchmarks/chaos_catalogue.py`` — bad inputs over the user's code, data and config,
run directories whose own entries are links, checkpoints / ``run.json`` / ``config.yaml`` from elsewhere naming
modules with a side effect — each run as ``python -m pl_fedsparse.cli ...`` in its own scratch folder and judged
there (exit status, one stderr line with the expected text, no traceback, nothing written before a refusal, no file
outside the run directory touched, no marker of an import). Prints one line per case and a summary; with
``--out-record FILE`` writes them there, headed by the command and the commit.
"""

from __future__ import annotations

import argparse
import atexit
import json
import os
import random
import shlex
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))  # chaos_catalogue.py, beside this file

CONFIG = "configs/synthetic_fedavg_ft.yaml"
ARGS = ["--trainer.num_rounds", "8", "--trainer.eval_every", "1", "--trainer.enable_progress_bar", "false",
        "--trainer.logger", "true"]
TIME_KEYS = ("time_s", "time_train_s", "time_cum_s")


METHODS = {"fedavg": "configs/synthetic_fedavg.yaml", "dispfl": "configs/synthetic_dispfl.yaml",
           "pfedgate": "configs/synthetic_pfedgate.yaml", "fedpse": "configs/synthetic_fedpse.yaml",
           "dmpfl": "configs/synthetic_dmpfl.yaml"}


def _cmd(run: Path, resume: bool, config: str = CONFIG) -> list[str]:
    base = [sys.executable, "-m", "pl_fedsparse.cli", "fit"]
    if resume:
        return base + ["--config", str(run / "config.yaml"), "--trainer.default_root_dir", str(run),
                       "--ckpt_path", str(run / "checkpoints" / "last.ckpt")]
    return base + ["--config", config, *ARGS, "--trainer.default_root_dir", str(run)]


def _leftovers(run: Path) -> str | None:
    """Why the run directory is not clean after a stop (a ``.lock`` or a ``.tmp`` file), or ``None``."""
    return "lock or temporary file left" if (run / ".lock").exists() or _tmp_files(run) else None


def _clean_stop(run: Path, rc: int, err: str, expected_rc: int, prefix: str) -> str | None:
    """Why a stop was not clean (``None`` when it was): exit status, one line, no traceback, lock and temp files."""
    lines = [x for x in err.splitlines() if x.strip() and "Warning" not in x and "skip_none" not in x
             and "super().dump" not in x]
    if rc != expected_rc:
        return f"exit {rc} (expected {expected_rc}): {err.strip()[-300:]}"
    if "Traceback" in err or len([x for x in lines if x.startswith(prefix)]) != 1:
        return f"not one line: {err.strip()[-300:]}"
    return _leftovers(run)


def _resume_command(err: str, run: Path, config: str) -> list[str]:
    """The printed resume command (as a module call), or a plain rerun when none was printed."""
    for line in err.splitlines():
        if "`pl-fed fit" in line:
            return [sys.executable, "-m", "pl_fedsparse.cli", *shlex.split(line.split("`")[1])[1:]]
    return _cmd(run, resume=False, config=config)


def _rows(run: Path) -> list[dict]:
    rows = [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines()]
    return [{k: v for k, v in r.items() if k not in TIME_KEYS} for r in rows]


def _tmp_files(run: Path) -> bool:
    for d in (run, run / "checkpoints"):
        try:
            if any(name.endswith(".tmp") for name in os.listdir(d)):
                return True
        except OSError:
            pass
    return False


def _stop(proc: subprocess.Popen, run: Path, delay: float, at_write: bool, sig: str = "kill") -> int:
    """SIGKILL (or SIGTERM) ``proc`` after ``delay`` s, or (``at_write``) as soon as a ``.tmp`` file appears in the
    run: 0 when the process ended first, 2 when it was stopped while a ``.tmp`` file existed, else 1."""
    deadline = time.perf_counter() + (4 * delay if at_write else delay)
    seen = False
    while time.perf_counter() < deadline:
        if proc.poll() is not None:
            return 0
        if at_write and _tmp_files(run):
            seen = True
            break
        time.sleep(0.0005 if at_write else 0.01)
    if proc.poll() is not None:
        return 0
    proc.send_signal(signal.SIGKILL if sig == "kill" else signal.SIGTERM)
    proc.wait()
    return 2 if seen else 1


def _signal_trial(run: Path, config: str, sig: str, stops: int, duration: float, rng: random.Random,
                  env: dict[str, str], expected: list[dict]) -> dict:
    """One trial of ``kill`` or ``term``: stop the run ``stops`` times, resume it, compare."""
    kills = during_write = restarts_plain = early = late = 0
    unclean: list[str] = []
    cmd = _cmd(run, resume=False, config=config)
    while True:
        restarts_plain += int("--ckpt_path" not in cmd and kills > 0)
        proc = subprocess.Popen(cmd, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
        if kills < stops:
            # a random moment, or (one stop in three) the moment a checkpoint or run file is being written
            at_write = rng.random() < 1 / 3
            stopped = _stop(proc, run, rng.uniform(0.2, duration), at_write, sig)
            if stopped:
                kills += 1
                during_write += int(stopped == 2)
                err = proc.stderr.read().decode() if proc.stderr else ""
                if sig == "term":
                    quiet = proc.returncode == -signal.SIGTERM and "error" not in err and "terminated" not in err
                    done = (run / "summary.json").exists() and len(_rows(run)) == len(expected)
                    if quiet and done:
                        # the run had finished and the interpreter was exiting (handlers restored): nothing lost
                        late += 1
                        why = _leftovers(run)
                    elif quiet and not err.strip():
                        # before pl-fed installed its handlers (imports): the default action, nothing written yet
                        early += 1
                        why = _leftovers(run)
                    else:
                        why = _clean_stop(run, proc.returncode, err, 143, "terminated (SIGTERM)")
                    if why:
                        unclean.append(why)
                    cmd = _resume_command(err, run, config) if "`pl-fed fit" in err else \
                        _cmd(run, (run / "checkpoints" / "last.ckpt").exists(), config)
                    if os.environ.get("CHAOS_DEBUG"):
                        print("   stop:", proc.returncode, (err.strip().splitlines() or [""])[-1][:300], flush=True)
                else:
                    cmd = _cmd(run, (run / "checkpoints" / "last.ckpt").exists(), config)
                continue
        proc.wait()
        err = proc.stderr.read().decode() if proc.stderr else ""
        if proc.returncode != 0:
            return {"stops": kills, "identical": False, "error": f"exit {proc.returncode}: {err.strip()[-300:]}"}
        if (run / "summary.json").exists() and len(_rows(run)) == len(expected):
            break
    same = (run / "metrics.jsonl").exists() and _rows(run) == expected
    return {"stops": kills, "during_write": during_write, "restarts_plain": restarts_plain, "identical": same,
            "unclean": unclean, "before_startup": early, "after_finish": late}


def _disk_trial(run: Path, config: str, ref_bytes: int, rng: random.Random, env: dict[str, str],
                expected: list[dict]) -> dict:
    """One ``disk-full`` trial: the run directory is a tmpfs that fills up; then it is enlarged and the run resumed."""
    run.mkdir(parents=True)
    size = max(int(ref_bytes * rng.uniform(0.3, 0.9)), 64 * 1024)
    subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(run)], check=True)
    try:
        res = subprocess.run(_cmd(run, False, config), env=env, capture_output=True, text=True, check=False)
        if res.returncode == 0:
            return {"size": size, "filled": False, "identical": _rows(run) == expected}
        why = _clean_stop(run, res.returncode, res.stderr, 74, "error:")
        line = next((x for x in res.stderr.splitlines() if x.startswith("error:")), "")
        ckpt_ok = None
        if (run / "checkpoints" / "last.ckpt").exists():
            from pl_fedsparse.run.checkpoint import load_checkpoint

            try:
                load_checkpoint(run / "checkpoints" / "last.ckpt")
                ckpt_ok = True
            except Exception:  # noqa: BLE001 - recorded as a failure
                ckpt_ok = False
        subprocess.run(["mount", "-o", f"remount,size={ref_bytes * 4}", str(run)], check=True)  # space freed
        res2 = subprocess.run(_resume_command(res.stderr, run, config), env=env, capture_output=True, text=True,
                              check=False)
        same = res2.returncode == 0 and _rows(run) == expected
        return {"size": size, "filled": True, "unclean": [why] if why else [], "line": line[:200],
                "checkpoint_loads": ckpt_ok, "identical": same,
                **({"error": res2.stderr.strip()[-300:]} if res2.returncode else {})}
    finally:
        subprocess.run(["umount", str(run)], check=False)


def _dir_bytes(run: Path) -> int:
    return sum(p.stat().st_size for p in run.rglob("*") if p.is_file())


def chaos(config: str, fault: str, trials: int, stops: int, seed: int, out: Path) -> dict:
    rng = random.Random(seed)
    shutil.rmtree(out, ignore_errors=True)
    out.mkdir(parents=True)
    env = {**os.environ, "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "1")}
    ref = out / "reference"
    t = time.perf_counter()
    subprocess.run(_cmd(ref, resume=False, config=config), env=env, check=True, capture_output=True)
    duration = time.perf_counter() - t
    expected = _rows(ref)
    print(f"{config} {fault}: reference run: {len(expected)} rows in {duration:.1f} s, {_dir_bytes(ref)} bytes",
          flush=True)
    results = []
    for trial in range(trials):
        run = out / f"trial{trial}"
        if fault == "disk-full":
            r = _disk_trial(run, config, _dir_bytes(ref), rng, env, expected)
        else:
            r = _signal_trial(run, config, fault, stops, duration, rng, env, expected)
        results.append(r)
        print(f"trial {trial}: {json.dumps(r)}", flush=True)
    summary = {"config": config, "fault": fault, "trials": trials,
               "identical": sum(bool(r["identical"]) for r in results),
               "stops": sum(r.get("stops", int(r.get("filled", False))) for r in results),
               "during_write": sum(r.get("during_write", 0) for r in results),
               "before_startup": sum(r.get("before_startup", 0) for r in results),
               "after_finish": sum(r.get("after_finish", 0) for r in results),
               "unclean_stops": sum(len(r.get("unclean", [])) for r in results), "results": results}
    print(f"summary: {config} {fault}: {summary['trials']} trials, {summary['stops']} stops "
          f"({summary['during_write']} during a write), {summary['unclean_stops']} unclean, "
          f"{summary['identical']}/{trials} runs identical", flush=True)
    return summary


def _catalogue_case(case: Any, where: Path) -> dict:
    """Run one catalogue case as a real ``pl-fed`` process in its own scratch folder; its verdicts."""
    from chaos_catalogue import judge, prepare, snapshot

    where.mkdir(parents=True)
    prepare(case, where)
    before = snapshot(where)
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PL_FEDSPARSE_CACHE": str(where / "cache")}
    env.pop("PL_FED_DEBUG", None)
    res = subprocess.run([sys.executable, "-m", "pl_fedsparse.cli", *case.args], cwd=where, env=env,
                         capture_output=True, text=True, check=False, timeout=600)
    return judge(case, where, res.returncode, res.stdout, res.stderr, before)


def catalogue(only: str | None, jobs: int, out: Path, record: str | None) -> int:
    """``--catalogue``: every case of ``chaos_catalogue.CASES`` (or those whose id holds ``only``), one line each and
    a summary; 0 when every case behaved."""
    from concurrent.futures import ThreadPoolExecutor

    from chaos_catalogue import CASES, prepare

    cases = [c for c in CASES if only is None or only in c.id]
    shutil.rmtree(out, ignore_errors=True)
    out.mkdir(parents=True)
    # the finished run several cases copy: made once, in this process, before the cases run side by side
    scratch = Path(tempfile.mkdtemp(prefix="catalogue-"))
    atexit.register(shutil.rmtree, scratch, ignore_errors=True)
    prepare(next((c for c in cases if c.group == "link"), cases[0]), scratch)
    lines: list[str] = []

    def say(text: str) -> None:
        print(text, flush=True)
        lines.append(text)

    t0 = time.perf_counter()
    with ThreadPoolExecutor(max(1, jobs)) as pool:
        verdicts = list(pool.map(lambda ic: _catalogue_case(ic[1], out / f"{ic[0]:03d}"), enumerate(cases)))
    for case, v in zip(cases, verdicts):
        status = "ok  " if not v["problems"] else "FAIL"
        detail = v["line"] if not v["problems"] else "; ".join(v["problems"])
        say(f"{status} {case.group:<10} {case.id:<58} exit {v['exit']}  {detail[:240]}")
    n = len(verdicts)
    refusals = [v for c, v in zip(cases, verdicts) if v["nothing_written"] is not None]
    by = {g: [v for v in verdicts if v["group"] == g] for g in ("input", "link", "provenance")}
    say("")
    say(f"summary: {n} cases ({', '.join(f'{len(v)} {g}' for g, v in by.items())}) in "
        f"{time.perf_counter() - t0:.0f} s")
    say(f"  {sum(v['one_line'] for v in verdicts)}/{n} one line (the expected one, no traceback; exit-0 link and "
        f"provenance cases: no line)")
    say(f"  {sum(v['exit_ok'] for v in verdicts)}/{n} exit as expected "
        f"({sum(c.code == 0 for c in cases)} of them 0: a documented warning, or a run that goes on)")
    say(f"  {sum(bool(v['nothing_written']) for v in refusals)}/{len(refusals)} refusals before the run wrote "
        "nothing (the others stop after the run started: no .lock, no .tmp left)")
    say(f"  links: {len(by['link'])} cases, files outside the run directory touched: "
        f"{sum(v['outside_touched'] or 0 for v in by['link'])}")
    say(f"  provenance: {len(by['provenance'])} cases, markers of an import: "
        f"{sum(v['markers'] or 0 for v in by['provenance'])}")
    failed = [v["id"] for v in verdicts if v["problems"]]
    say(f"  {n - len(failed)}/{n} cases as expected" + (f"; failed: {', '.join(failed)}" if failed else ""))
    if record:
        commit = subprocess.run(["git", "rev-parse", "HEAD"], capture_output=True, text=True, check=False).stdout
        dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], capture_output=True,
                               text=True, check=False).stdout.strip()
        head = [f"# command: OMP_NUM_THREADS=1 python benchmarks/chaos.py --catalogue --jobs {jobs} --out-record "
                f"{record}" + (f" --only {only}" if only else ""),
                f"# commit: {commit.strip()}" + (" (with uncommitted changes in the working tree)" if dirty else ""),
                f"# python {sys.version.split()[0]}, {sys.platform}", ""]
        Path(record).write_text("\n".join(head + lines) + "\n")
    return 0 if not failed else 1


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--fault", choices=["kill", "term", "disk-full"], default="kill")
    ap.add_argument("--config", default=CONFIG)
    ap.add_argument("--trials", type=int, default=5)
    ap.add_argument("--kills", type=int, default=4, help="stops per trial (kill, term)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", default="benchmarks/_runs/chaos")
    ap.add_argument("--all", action="store_true", help="kill, term and disk-full over FedAvg, DisPFL, pFedGate, FedPSE, "
                                                        "DM-PFL (--trials each)")
    ap.add_argument("--out-record", default=None, help="write the summaries as JSON here (--catalogue: the text)")
    ap.add_argument("--catalogue", action="store_true", help="run the bad-input, link and provenance catalogue")
    ap.add_argument("--only", default=None, help="--catalogue: the cases whose id contains this text")
    ap.add_argument("--jobs", type=int, default=1, help="--catalogue: cases run at a time")
    args = ap.parse_args()
    if args.catalogue:
        return catalogue(args.only, args.jobs, Path(args.out) / "catalogue", args.out_record)
    if args.fault == "disk-full" or args.all:
        if os.geteuid() != 0 or not sys.platform.startswith("linux"):
            raise SystemExit("error: chaos.py --fault disk-full mounts a tmpfs: it needs Linux and root")
    if args.all:
        plan = [(cfg, fault) for cfg in METHODS.values() for fault in ("kill", "term", "disk-full")]
    else:
        plan = [(args.config, args.fault)]
    summaries = []
    for i, (cfg, fault) in enumerate(plan):
        summaries.append(chaos(cfg, fault, args.trials, args.kills, args.seed + i, Path(args.out) / f"{i}"))
        if args.out_record:
            Path(args.out_record).write_text(json.dumps(summaries, indent=1) + "\n")
    ok = all(s["identical"] == s["trials"] and s["unclean_stops"] == 0 for s in summaries)
    if len(summaries) > 1:
        print("\n| config | fault | trials | stops | during a write | before start-up | after the run | unclean stops "
              "| identical |")
        print("|---|---|---|---|---|---|---|---|---|")
        for s in summaries:
            print(f"| {s['config']} | {s['fault']} | {s['trials']} | {s['stops']} | {s['during_write']} | "
                  f"{s['before_startup']} | {s['after_finish']} | {s['unclean_stops']} | "
                  f"{s['identical']}/{s['trials']} |")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
