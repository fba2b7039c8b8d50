"""``import pl_fedsparse`` is light (its public names and subpackages are imported on first use), so the ``pl-fed``
command handles signals before torch loads; every public name still resolves, to the object its module defines."""

from __future__ import annotations

import importlib
import subprocess
import sys

import pytest

import pl_fedsparse
import pl_fedsparse.cli
from pl_fedsparse.cli.help import OWN_SUBCOMMANDS


def test_importing_the_package_or_the_console_script_loads_no_torch() -> None:
    code = ("import sys, pl_fedsparse; from pl_fedsparse.cli import console_main; "
            "print(sorted(m for m in ('torch', 'lightning', 'pl_fedsparse.loop') if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "[]"


@pytest.mark.parametrize("package", [pl_fedsparse, pl_fedsparse.cli], ids=lambda p: p.__name__)
def test_every_public_name_resolves_to_its_module_s_object(package: object) -> None:
    names = [n for n in package.__all__ if n != "__version__"]  # type: ignore[attr-defined]
    assert sorted(names) == sorted(package._PUBLIC)  # type: ignore[attr-defined]
    for name in names:
        defining = importlib.import_module(package._PUBLIC[name])  # type: ignore[attr-defined]
        assert getattr(package, name) is getattr(defining, name), name
        assert name in dir(package)
    from pl_fedsparse import FederatedLoop, current_fit  # noqa: F401  (the from-import form)


def test_subpackages_are_attributes_and_unknown_names_are_attribute_errors() -> None:
    assert pl_fedsparse.callbacks is importlib.import_module("pl_fedsparse.callbacks")
    assert pl_fedsparse.report.load_run is importlib.import_module("pl_fedsparse.run.runs").load_run  # an old path
    with pytest.raises(AttributeError, match="module 'pl_fedsparse' has no attribute 'no_such_name'"):
        pl_fedsparse.no_such_name  # noqa: B018
    with pytest.raises(AttributeError, match="module 'pl_fedsparse.cli' has no attribute 'callbacks'"):
        pl_fedsparse.cli.callbacks  # noqa: B018
    assert not hasattr(pl_fedsparse, "__wrapped__")  # (dunder lookups by tools are not imports)


def _console(words: list[str]) -> subprocess.CompletedProcess[str]:
    """The console script on ``words``; its stderr ends with the heavy modules it imported (a list)."""
    code = (f"import atexit, sys; sys.argv = ['pl-fed', *{words!r}]\n"
            "atexit.register(lambda: sys.stderr.write(str(sorted(m for m in ('torch', 'lightning') if m in "
            "sys.modules))))\n"
            "from pl_fedsparse.cli.entry import console_main\nconsole_main()\n")
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=False)


def test_pl_fed_configs_answers_without_importing_torch(monkeypatch: pytest.MonkeyPatch) -> None:
    """The first command a new user types lists the shipped configs at once (no seconds of torch imports), the same
    list as through the full command line."""
    monkeypatch.setenv("COLUMNS", "100")  # (the listing wraps to the terminal's width: the same in both)
    res = _console(["configs"])
    assert (res.returncode, res.stderr) == (0, "[]")
    from pl_fedsparse.shipped import format_listing

    assert res.stdout == format_listing()


@pytest.mark.parametrize("command", ["report", "sweep"])
def test_pl_fed_report_and_sweep_start_without_importing_torch(command: str) -> None:
    """``pl-fed report`` reads run directories and ``pl-fed sweep`` starts runs as processes of their own: neither
    imports torch or Lightning in the ``pl-fed`` process (their help shown, a missing folder refused, at once)."""
    res = _console([command, "--help"])
    assert (res.returncode, res.stderr) == (0, "[]") and f"usage: pl-fed {command}" in res.stdout
    res = _console([command, "no-such-folder"] if command == "report" else [command, "--config", "no-such.yaml"])
    line, heavy = res.stderr.split("\n")
    assert (res.returncode, heavy) == (2, "[]") and "error: " in line and "no-such" in line, res.stderr


@pytest.mark.parametrize("name", sorted(OWN_SUBCOMMANDS))
def test_every_listed_own_subcommand_is_run_by_run_own(name: str, capsys: pytest.CaptureFixture[str]) -> None:
    """The console script sends every name of ``OWN_SUBCOMMANDS`` (the help's list) to ``run_own``: each one is
    run there (its help shown), none falls through as ``None`` (which would end the command with status 0 and no
    output)."""
    from pl_fedsparse.cli.own import run_own

    try:
        code = run_own([name, "--help"])
    except SystemExit as e:  # (argparse's help)
        code = e.code
    assert code == 0 and f"usage: pl-fed {name}" in capsys.readouterr().out
