"""The README's two commands and .ci/run stay in sync; every shipped config parses; the README stays a short front
door; papers are cited by name, never by a path users do not have."""

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


def test_the_readme_is_a_front_door() -> None:
    """At most 250 lines; one checked line per paper, each linking to that paper's reproduction page."""
    text = (REPO / "README.md").read_text()
    assert len(text.splitlines()) <= 250, "README.md grew past 250 lines: move the details to a page under docs/"
    spec = re.search(r"^<!-- numbers\s*\nid: readme-claims\b.*?-->\s*\n(.*?)\n\n", text,
                     flags=re.DOTALL | re.MULTILINE)
    assert spec, "README.md lost its checked claims table (readme-claims)"
    rows = [r for r in spec.group(1).splitlines()[2:] if r.startswith("|")]
    pages = sorted(p.parent.name for p in (REPO / "papers").glob("*/README.md"))
    linked = sorted(m for r in rows for m in re.findall(r"\(papers/(\w+)/README\.md\)", r))
    assert linked == pages, f"one claims row per paper page: rows link {linked}, the pages are {pages}"


#: a citation of the project's private paper texts or method notes, which users do not have
PRIVATE = re.compile(r"shared/(papers|methods)/")


def test_papers_are_cited_by_name_not_by_a_private_path() -> None:
    """The README, the docs, the papers' folders (pages and scripts), the engine pages and the package's docstrings
    cite papers by name, venue and section."""
    pages = [*(REPO / "docs").rglob("*.md"), *(REPO / "papers").glob("*/*.md"), *(REPO / "papers").glob("*/*.py"),
             *(REPO / "benchmarks").glob("*.md")]
    files = [REPO / "README.md", *sorted(pages), *sorted((REPO / "pl_fedsparse").rglob("*.py"))]
    bad = [f"{f.relative_to(REPO)}:{i}: {line.strip()[:100]}" for f in files
           for i, line in enumerate(f.read_text().splitlines(), 1) if PRIVATE.search(line)]
    assert not bad, "cite the paper by name, venue and section instead:\n" + "\n".join(bad)
