"""The examples of ``docs/your-own-model.md`` and ``docs/your-own-data.md`` run as written.

Every fenced block preceded by ``<!-- file: PATH -->`` is written to ``PATH`` in an empty folder outside the
repository; the top-level scripts among them (data preparation) are run, then every YAML with ``pl-fed fit --config`` from that folder (shortened to 2 rounds).
"""

from __future__ import annotations

import json
import re
import runpy
from pathlib import Path

import pytest
from conftest import run_main
from test_your_project import in_project

REPO = Path(__file__).resolve().parents[1]
PAGES = ["your-own-model.md", "your-own-data.md"]
_FILE = re.compile(r"<!-- file: (\S+) -->\s*```[a-z]*\n(.*?)```", re.DOTALL)


def doc_files(page: str) -> dict[str, str]:
    """``{path: text}`` of the page's example files."""
    return {m.group(1): m.group(2) for m in _FILE.finditer((REPO / "docs" / page).read_text())}


@pytest.mark.parametrize("page", PAGES)
@pytest.mark.slow
def test_page_examples_run(page: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    files = doc_files(page)
    assert any(p.endswith(".yaml") for p in files), f"docs/{page} has no example config"
    project = tmp_path / "project"
    for rel, text in files.items():
        path = project / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
        if rel.endswith(".py"):  # make its folder a package, as the page's layout implies
            for parent in path.relative_to(project).parents:
                if str(parent) != ".":
                    (project / parent / "__init__.py").touch()
    for script in sorted(p for p in files if p.endswith(".py") and "/" not in p):  # data preparation, as a user
        with in_project(project):
            runpy.run_path(str(project / script), run_name="__main__")
    for rel in sorted(p for p in files if p.endswith(".yaml")):
        run = tmp_path / f"run_{Path(rel).stem}"
        with in_project(project):
            code, _, err = run_main(["fit", "--config", rel, "--trainer.num_rounds", "2",
                                     "--trainer.default_root_dir", str(run), "--trainer.enable_progress_bar",
                                     "false"], capsys)
        assert code == 0, f"{page}: {rel}: {err}"
        rows = [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines()]
        assert rows[-1]["round"] == 1 and rows[-1]["acc_mean"] is not None
