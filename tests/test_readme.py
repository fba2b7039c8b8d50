"""The README's two commands and .ci/run stay in sync; every shipped config parses."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from pl_fedsparse.cli import main

REPO = Path(__file__).resolve().parents[1]


def readme_commands() -> list[str]:
    blocks = re.findall(r"```bash\n(.*?)```", (REPO / "README.md").read_text(), flags=re.S)
    return [b.strip() for b in blocks[:2]]


def test_readme_starts_with_two_commands_and_ci_runs_the_second() -> None:
    quick, tests = readme_commands()
    assert "pl-fed fit --config configs/quickstart.yaml" in quick
    assert tests.endswith('pytest -m "not slow"') and "\n" not in tests
    ci = (REPO / ".ci" / "run").read_text().splitlines()
    assert tests in ci, ".ci/run must run the README's test command verbatim"
    assert ci.index("pytest -m slow") > ci.index(tests), ".ci/run must run the slow set after the README's command"


@pytest.mark.parametrize("config", sorted((REPO / "configs").glob("*.yaml")), ids=lambda p: p.name)
def test_config_parses(config: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(REPO)
    with pytest.raises(SystemExit) as e:
        main(["fit", "--config", str(config), "--print_config"])
    assert e.value.code in (0, None), capsys.readouterr().err
