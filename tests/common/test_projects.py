"""``python -m labkit export``: the two projects a learner takes away run as folders of their own,
with torch alone."""
from __future__ import annotations

import ast
import re
import subprocess
import sys

import pytest

from labkit.common import projects

pytestmark = pytest.mark.timeout(300)

RUNS = {
    "train": ["--snapshot-dir", "snaps", "--log-every", "64"],
    "capstone": ["--steps", "12", "--n-layer", "2", "--n-head", "2", "--n-embd", "32",
                 "--block-size", "32", "--batch-size", "8", "--corpus-bytes", "3000",
                 "--log-every", "4", "--ckpt-every", "4", "--eval-every", "0",
                 "--eval-windows", "0", "--eval-batch", "4", "--sample-tokens", "0",
                 "--out-dir", "out"],
}
DONE = {"train": "done: 64 steps, final parameters in snaps/final.pt",
        "capstone": "done: 12 steps on 1 rank(s), final parameters in out/final.pt"}


@pytest.mark.parametrize("project", list(projects.PROJECTS))
def test_an_exported_project_imports_only_torch_the_stdlib_and_its_own_files(tmp_path, project):
    written = projects.export(project, tmp_path)
    own = {p.stem for p in written}
    for path in written:
        for node in ast.walk(ast.parse(path.read_text())):
            names = ([a.name for a in node.names] if isinstance(node, ast.Import) else
                     [node.module or ""] if isinstance(node, ast.ImportFrom) else [])
            if isinstance(node, ast.ImportFrom):
                assert node.level == 0, f"{path.name}: a relative import is left"
            for name in names:
                top = name.split(".")[0]
                assert top in own | {"torch", "__future__"} or top in sys.stdlib_module_names, \
                    f"{path.name} imports {name}"


@pytest.mark.parametrize("project", list(projects.PROJECTS))
def test_an_exported_project_trains_in_its_folder_without_labkit(tmp_path, project):
    written = projects.export(project, tmp_path)
    out = subprocess.run([sys.executable, "-X", "importtime", written[0].name, *RUNS[project]],
                         cwd=tmp_path, capture_output=True, text=True, timeout=240)
    assert out.returncode == 0, out.stderr[-3000:]
    assert DONE[project] in out.stdout
    imported = re.findall(r"\|\s+(labkit[\w.]*)\s*$", out.stderr, re.M)
    assert imported == [], f"the exported {project} imported {imported}"
    help_text = subprocess.run([sys.executable, written[0].name, "--help"], cwd=tmp_path,
                               capture_output=True, text=True, timeout=120).stdout
    assert help_text.startswith(f"usage: python {written[0].name}"), help_text[:200]
    assert not any("-m labkit" in p.read_text() for p in written)


def test_export_refuses_an_unknown_project_and_a_folder_that_holds_its_files(tmp_path, capsys):
    with pytest.raises(ValueError, match="no project 'gpt': choose one of train, capstone"):
        projects.export("gpt", tmp_path)
    (tmp_path / "elastic.py").write_text("# mine\n")
    assert projects.main(["train", str(tmp_path)]) == 1
    assert "already holds elastic.py" in capsys.readouterr().err
    assert sorted(p.name for p in tmp_path.iterdir()) == ["elastic.py"]   # nothing written
    assert (tmp_path / "elastic.py").read_text() == "# mine\n"
