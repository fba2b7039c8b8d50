"""Shipped configs by name (``--config NAME[.yaml]`` from any directory), ``pl-fed configs``, and the wheel: the
configs and the extension examples are inside it."""

from __future__ import annotations

import importlib.util
import json
import os
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest
import yaml
from conftest import one_line, run_main

from pl_fedsparse import shipped
from pl_fedsparse.errors import ConfigError

REPO = Path(__file__).resolve().parents[1]
CONFIGS = sorted((REPO / "configs").glob("*.yaml"))
EXAMPLES = sorted(p.name for p in (REPO / "callbacks").glob("*.py"))


def leading_comment(path: Path) -> str:
    """The leading ``#`` lines of ``path`` without the ``#`` and the example command, joined (computed here
    independently)."""
    lines = path.read_text().lstrip("\n").splitlines()
    block = [ln.strip()[1:].strip() for ln in lines[:next(i for i, ln in enumerate(lines + [""])
                                                           if not ln.strip().startswith("#"))]]
    return " ".join(" ".join(b for b in block if not b.startswith("pl-fed ")).split())


def listed(out: str) -> dict[str, str]:
    """``pl-fed configs``'s output as ``{name: description}``: a name starts a line, its wrapped description follows
    (on the same line and on the indented lines after it)."""
    entries: dict[str, list[str]] = {}
    for line in out.splitlines():
        if line[:1].strip():
            name, _, desc = line.partition(" ")
            entries[name] = [desc]
        else:
            entries[list(entries)[-1]].append(line)
    return {name: " ".join(" ".join(parts).split()) for name, parts in entries.items()}


def printed_config(args: list[str], capsys: pytest.CaptureFixture[str]) -> dict:
    code, out, err = run_main(["fit", *args, "--print_config"], capsys)
    assert code == 0, err
    return yaml.safe_load(out)


@pytest.fixture
def elsewhere(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """A working directory outside the repository, with no configs/ folder."""
    cwd = tmp_path / "elsewhere"
    cwd.mkdir()
    monkeypatch.chdir(cwd)
    return cwd


# ------------------------------------------------------------------------------------------- resolution
def test_the_repository_configs_are_the_shipped_ones() -> None:
    assert list(shipped.shipped_configs()) == [p.name for p in CONFIGS]
    assert shipped.config_dir() == REPO / "configs"  # a source checkout / editable install reads them in place


@pytest.mark.parametrize("value", ["cifar10_dmpfl.yaml", "cifar10_dmpfl"])
def test_name_and_name_yaml_resolve_from_any_directory(value: str, elsewhere: Path,
                                                       capsys: pytest.CaptureFixture[str]) -> None:
    assert shipped.resolve_config(value) == str(REPO / "configs" / "cifar10_dmpfl.yaml")
    expected = yaml.safe_load((REPO / "configs" / "cifar10_dmpfl.yaml").read_text())
    cfg = printed_config(["--config", value], capsys)
    assert cfg["trainer"]["num_rounds"] == expected["trainer"]["num_rounds"]
    assert [c["class_path"] for c in cfg["trainer"]["callbacks"]] == \
        [c["class_path"] for c in expected["trainer"]["callbacks"]]
    assert cfg["data"]["name"] == "cifar10" and cfg["data"]["root"] == expected["data"]["root"]


def test_equals_form_and_top_level_config_flag(elsewhere: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert printed_config(["--config=synthetic_local.yaml"], capsys)["trainer"]["callbacks"][0]["class_path"] == \
        "pl_fedsparse.callbacks.LocalTraining"
    assert shipped.rewrite_config_args(["-c", "quickstart", "fit"]) == \
        ["-c", str(REPO / "configs" / "quickstart.yaml"), "fit"]


def test_a_local_file_shadows_a_shipped_name(elsewhere: Path, capsys: pytest.CaptureFixture[str]) -> None:
    shipped_rounds = yaml.safe_load((REPO / "configs" / "quickstart.yaml").read_text())["trainer"]["num_rounds"]
    (elsewhere / "quickstart.yaml").write_text(f"trainer:\n  num_rounds: {shipped_rounds + 7}\n")
    for value in ("quickstart.yaml", "quickstart", "./quickstart.yaml", str(elsewhere / "quickstart.yaml")):
        assert printed_config(["--config", value], capsys)["trainer"]["num_rounds"] == shipped_rounds + 7, value
    assert shipped.resolve_config("quickstart") == "quickstart.yaml"  # the local file, left relative


def test_several_configs_combine_in_order(elsewhere: Path, capsys: pytest.CaptureFixture[str]) -> None:
    (elsewhere / "short.yaml").write_text("trainer:\n  num_rounds: 2\n")
    base = yaml.safe_load((REPO / "configs" / "quickstart.yaml").read_text())
    cfg = printed_config(["--config", "quickstart", "--config", "short.yaml"], capsys)
    assert cfg["trainer"]["num_rounds"] == 2 and cfg["data"]["num_clients"] == base["data"]["num_clients"]
    cfg = printed_config(["--config", "short.yaml", "--config", "quickstart"], capsys)  # the later one wins
    assert cfg["trainer"]["num_rounds"] == base["trainer"]["num_rounds"]
    # a YAML string is still a config (not a name)
    cfg = printed_config(["--config", "quickstart", "--config", "{trainer: {num_rounds: 3}}"], capsys)
    assert cfg["trainer"]["num_rounds"] == 3


@pytest.mark.parametrize("value, close", [("quickstrat.yaml", ["quickstart.yaml"]),
                                          ("dmpfl", ["cifar10_dmpfl.yaml", "synthetic_dmpfl.yaml"]),
                                          ("zzzzzzzzzz", [])])
def test_unknown_name_is_one_line_with_close_matches(value: str, close: list[str], elsewhere: Path,
                                                     capsys: pytest.CaptureFixture[str]) -> None:
    code, out, err = run_main(["fit", "--config", value], capsys)
    line = one_line(err)
    assert code == 2 and out == ""
    assert line.startswith(f"error: config={value!r} is invalid: no such file and no shipped config of that name; "
                           f"expected ")
    assert f"`pl-fed configs` lists the {len(CONFIGS)} shipped configs" in line
    if close:
        listed = line.split("close matches: ")[1].split(" (")[0].split(", ")
        assert set(close) <= set(listed) and all(n in shipped.shipped_configs() for n in listed)
    else:
        assert "close matches" not in line


def test_a_missing_path_to_a_shipped_config_suggests_its_name(elsewhere: Path,
                                                              capsys: pytest.CaptureFixture[str]) -> None:
    code, _, err = run_main(["fit", "--config", "configs/quickstart.yaml", "--print_config"], capsys)
    line = one_line(err)
    assert code == 2 and "config='configs/quickstart.yaml' is invalid: no such file" in line
    assert "--config quickstart.yaml" in line
    with pytest.raises(ConfigError, match=r"^config='nowhere/x\.yaml' is invalid: no such file; expected"):
        shipped.resolve_config("nowhere/x.yaml")


def test_help_and_other_arguments_are_untouched(capsys: pytest.CaptureFixture[str]) -> None:
    args = ["fit", "--trainer.num_rounds", "2", "--data.root", "quickstart", "--", "--config", "x"]
    assert shipped.rewrite_config_args(args) == args
    code, out, _ = run_main(["fit", "--help"], capsys)
    assert code == 0 and "shipped config" in out and "--trainer.num_rounds" in out


def test_an_example_config_runs_by_name_outside_the_repository(elsewhere: Path, monkeypatch: pytest.MonkeyPatch,
                                                               capsys: pytest.CaptureFixture[str]) -> None:
    """The worked extension example names ``pl_fedsparse.examples``: no callbacks/ folder needed."""
    monkeypatch.setattr(sys, "path", [p for p in sys.path if Path(p or ".").resolve() != REPO])
    for name in [k for k in sys.modules if k == "callbacks" or k.startswith("callbacks.")]:
        monkeypatch.delitem(sys.modules, name)
    run = elsewhere / "run"
    code, _, err = run_main(["fit", "--config", "synthetic_fedprox", "--trainer.num_rounds", "1",
                             "--data.num_clients", "4", "--trainer.enable_progress_bar", "false",
                             "--trainer.default_root_dir", str(run)], capsys)
    assert code == 0, err
    assert "pl_fedsparse.examples.fedprox.FedProx" in (run / "config.yaml").read_text()
    assert json.loads((run / "metrics.jsonl").read_text().splitlines()[-1])["round"] == 0
    assert "callbacks" not in sys.modules


# ------------------------------------------------------------------------------------------- pl-fed configs
def test_pl_fed_configs_lists_every_shipped_config_with_its_description(capsys: pytest.CaptureFixture[str]) -> None:
    code, out, err = run_main(["configs"], capsys)
    assert code == 0 and err == ""
    entries = listed(out)
    assert list(entries) == [p.name for p in CONFIGS]
    for path in CONFIGS:
        assert entries[path.name] == leading_comment(path)  # whole, not cut mid-sentence
        assert entries[path.name]  # every shipped config describes itself in its leading comment lines


def test_pl_fed_configs_format(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                               capsys: pytest.CaptureFixture[str]) -> None:
    (tmp_path / "b_long_name.yaml").write_text("# FedFoo: a method\n# on two lines.\n#   pl-fed fit --config b.yaml\n"
                                               "seed_everything: 0\n# not the description\n")
    (tmp_path / "a.yaml").write_text("seed_everything: 0\n# not leading: no description\n")
    (tmp_path / "notes.txt").write_text("# not a config\n")
    monkeypatch.setattr(shipped, "config_dir", lambda: tmp_path)
    monkeypatch.setenv("COLUMNS", "100")
    assert run_main(["configs"], capsys)[1] == "a.yaml\nb_long_name.yaml  FedFoo: a method on two lines.\n"
    monkeypatch.setenv("COLUMNS", "40")  # narrow: the description below its name, wrapped and indented
    assert run_main(["configs"], capsys)[1] == "a.yaml\nb_long_name.yaml\n    FedFoo: a method on two lines.\n"
    code, out, _ = run_main(["configs", "--help"], capsys)
    assert code == 0 and out.startswith("usage: pl-fed configs") and str(tmp_path) in out
    code, out, err = run_main(["configs", "cifar10"], capsys)
    assert code == 2 and out == "" and "unrecognized arguments: cifar10" in one_line(err)


# ------------------------------------------------------------------------------------------- the wheel
def _wheel_tooling_missing() -> str | None:
    """Why this interpreter cannot build the wheel offline (``None``: it can). setuptools is not imported here: after
    distutils it refuses to load in-process."""
    from importlib.metadata import PackageNotFoundError, version

    try:
        version("pip")
        major, minor = (int(x) for x in version("setuptools").split(".")[:2])
    except (PackageNotFoundError, ValueError):
        return "pip and setuptools are needed to build the wheel"
    if (major, minor) < (70, 1) and importlib.util.find_spec("wheel") is None:
        return "setuptools < 70.1 needs the wheel package to build wheels"
    return None


_NO_WHEEL = _wheel_tooling_missing()


@pytest.mark.skipif(_NO_WHEEL is not None, reason=str(_NO_WHEEL))
@pytest.mark.slow
def test_wheel_contains_the_configs_and_the_examples(tmp_path: Path) -> None:
    """Build the wheel offline (a copy of the sources, no build isolation) and look inside; then import the package
    from the unpacked wheel in a fresh interpreter outside the repository: the shipped configs and the examples are
    found there."""
    src = tmp_path / "src"
    ignore = shutil.ignore_patterns("__pycache__", "*.pyc", "*.egg-info", "build")
    src.mkdir()
    for name in ("pyproject.toml", "setup.py", "README.md"):
        shutil.copy2(REPO / name, src / name)
    for folder in ("pl_fedsparse", "configs", "callbacks"):
        shutil.copytree(REPO / folder, src / folder, ignore=ignore)
    out = tmp_path / "wheels"
    proc = subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "--no-index",
                           "-q", "-w", str(out), str(src)], capture_output=True, text=True, timeout=300, check=False)
    assert proc.returncode == 0, proc.stderr
    (wheel,) = out.glob("pl_fedsparse-*.whl")
    names = set(zipfile.ZipFile(wheel).namelist())
    assert {f"pl_fedsparse/configs/{p.name}" for p in CONFIGS} <= names
    assert {f"pl_fedsparse/examples/{n}" for n in EXAMPLES} <= names
    assert "pl_fedsparse/py.typed" in names  # (PEP 561: a user's type checker reads the annotations)
    assert "pl_fedsparse/shipped.py" in names and not any(n.startswith(("tests/", "benchmarks/")) for n in names)
    entry = next(n for n in names if n.endswith(".dist-info/entry_points.txt"))
    assert "pl-fed = pl_fedsparse.cli:console_main" in zipfile.ZipFile(wheel).read(entry).decode()

    site = tmp_path / "site"
    zipfile.ZipFile(wheel).extractall(site)
    probe = ("import sys, importlib.util; sys.path.insert(0, sys.argv[1]); import pl_fedsparse.shipped as s; "
             "from pl_fedsparse.cli import main; print(s.__file__); print(s.config_dir()); "
             "print(importlib.util.find_spec('pl_fedsparse.examples.fedprox').origin); main(['configs'])")
    env = {**os.environ, "PYTHONWARNINGS": "ignore"}
    env.pop("PYTHONPATH", None)
    proc = subprocess.run([sys.executable, "-c", probe, str(site)], cwd=tmp_path, capture_output=True, text=True,
                          timeout=300, env=env, check=False)
    assert proc.returncode == 0, proc.stderr
    module, folder, example, *listing = proc.stdout.splitlines()
    assert Path(module).is_relative_to(site) and Path(folder) == site / "pl_fedsparse" / "configs"
    assert Path(example) == site / "pl_fedsparse" / "examples" / "fedprox.py"
    assert list(listed("\n".join(listing))) == [p.name for p in CONFIGS]
