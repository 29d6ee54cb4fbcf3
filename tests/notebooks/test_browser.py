"""The learner's real experience: every notebook run in JupyterLab in a headless browser (issue 8).

nbval proves the code runs; this proves a learner who runs the README's "open the lab" command
sees working widgets. One JupyterLab server (exactly the README's command, in a temporary copy
of the repo) and one Chromium tab (Debian's ``chromium-headless-shell`` driven by
``playwright``) serve the whole module. Each notebook in ``notebooks/`` is opened (the README's
from the page the server writes, the others from File > Open from Path...), run with Run > Run
All Cells, saved, checked, and its tab closed:

* no cell raised (read from the saved ``.ipynb``), every cell ran, no "Error displaying widget";
* every plot rendered as a loaded image (and a notebook that plots has at least one);
* every quiz form (``lk.quiz.ask``) takes an answer: a wrong one, then the bank's right one, and
  shows the feedback;
* every ring player (``lk.ringviz.player``) advances on ▶ (caption, step and image change) and
  on Play;
* a cell that ran longer than ``SLOW_S`` in the browser shows a progress bar;
* the kernel, still live after Run All, is graded exactly as the grader does: an untouched
  student notebook must score zero, cleanly. (So each student notebook executes once in the
  test run, here; nbval runs ``notebooks/`` only where there is no browser: tests/conftest.py.)

Per-notebook expectations come from the notebook's source (a notebook that calls
``lk.quiz.ask`` must show a quiz form ...). ``test_the_checks_can_fail`` runs a generated notebook
with a raising cell, a broken widget, a slow cell without a bar, a process that outlives the
kernel and an answered bank question, and asserts all five are caught. Screenshots land in
``artifacts/browser/NOTEBOOK/`` (not committed), with ``summary.txt``: where the notebook's time
went (open, run all, checks, grade, its slowest cells), written on a pass too.

Skipped, with the reason, only where ``playwright`` or ``chromium-headless-shell`` is missing
(``tests/install_browser.sh`` installs the browser where it can); ``LABKIT_REQUIRE_BROWSER=1``
(CI) makes that a failure instead.
"""
from __future__ import annotations

import os
import re

import nbformat
import pytest

from browser_helpers import (ARTIFACTS, CHROMIUM_ARGS, REPO, Lab, chromium_path, lab_command,
                             missing)
import browser_page as bp

MISSING = missing()
if MISSING and os.environ.get("LABKIT_REQUIRE_BROWSER") != "1":
    pytest.skip("browser test skipped: " + "; ".join(MISSING), allow_module_level=True)

NOTEBOOKS = sorted((REPO / "notebooks").glob("*.ipynb"))
SLOW_S = 20.0          # a cell running longer than this in the browser must show a progress bar
PLOTS = re.compile(r"\bplt\.|\bplot\w*\(|\.savefig\(|\bimshow\(")


@pytest.fixture(scope="module")
def lab():
    assert not MISSING, "LABKIT_REQUIRE_BROWSER=1 but " + "; ".join(MISSING)
    with Lab() as lab:
        yield lab


@pytest.fixture(scope="module")
def browser(lab):
    from playwright.sync_api import sync_playwright

    with sync_playwright() as p:
        b = p.chromium.launch(executable_path=chromium_path(), args=CHROMIUM_ARGS,
                              env=lab.chromium_env())
        try:
            yield b
        finally:
            b.close()
    left = lab.wait_gone(lambda: lab.marked("chromium-"), within=10)
    for proc in left:
        proc.kill()
    assert not left, f"Chromium processes left after browser.close(): {[p.pid for p in left]}"


@pytest.fixture(scope="module")
def page(browser):
    """One tab for the module, as a learner has: JupyterLab loads once, then each notebook
    opens from File > Open from Path... (a fresh JupyterLab per notebook cost ~8 s of CPU)."""
    page = bp.new_page(browser)
    yield page
    page.context.close()


def readme_notebook() -> str:
    """The notebook the README's lab command opens (relative path)."""
    return next(w for w in lab_command()[2:] if w.endswith(".ipynb"))


def test_readme_command_opens_an_existing_notebook():
    target = readme_notebook()
    assert (REPO / target).is_file(), f"the README's lab command opens {target}, which is missing"


def test_readme_command_serves_the_whole_repository(lab):
    """The README sends learners to solutions/ and the cheat sheet: the file browser must reach
    them (JupyterLab roots itself at the opened notebook's folder unless told otherwise)."""
    assert lab.root_dir.resolve() == lab.root.resolve()
    for rel in ("solutions/00_setup.ipynb", "README.md", "notebooks/cheatsheet.md"):
        assert lab.api("GET", f"/api/contents/{lab.tree_path(rel)}?content=0")


def _selfcheck_notebook() -> tuple[nbformat.NotebookNode, dict[str, int]]:
    """A notebook with working quiz, player, plot and progress cells, then four faults."""
    from labkit.grading.bank import all_banks
    qs = [q for b in all_banks().values() for q in b.questions.values() if not q.key]
    picks = [next(q for q in qs if q.kind == k) for k in ("numeric", "single", "multi", "short")
             if any(q.kind == k for q in qs)]
    answered = next(q for q in qs if q.kind == "numeric")     # a graded answer: not zero
    cells = ["import labkit as lk, time\nimport matplotlib.pyplot as plt\n"
             "from tqdm.auto import tqdm", f"{answered.variable} = {answered.answer!r}"]
    cells += [f"lk.quiz.ask({q.id!r})" for q in picks]
    cells += ["ring = lk.collectives.record('ring', world_size=3, numel=6)\nlk.ringviz.player(ring)",
              "fig, ax = plt.subplots(figsize=(4, 2.5)); ax.plot([1, 3, 2]); plt.show()",
              "for _ in tqdm(range(4)):\n    time.sleep(0.4)"]
    fault = {"tqdm": len(cells) - 1, "slow": len(cells)}
    cells.append("time.sleep(1.6)   # slow, no progress bar")
    cells.append("import subprocess   # a process that outlives its kernel\n"
                 "subprocess.Popen(['sleep', '120'], start_new_session=True)")
    fault["widget"] = len(cells)
    cells.append("display({'application/vnd.jupyter.widget-view+json': {'model_id': 'f' * 32, "
                 "'version_major': 2, 'version_minor': 0}}, raw=True)   # no such model")
    fault["error"] = len(cells)
    cells += ["1 / 0", "print('never runs')"]
    nb = nbformat.v4.new_notebook(cells=[nbformat.v4.new_code_cell(c) for c in cells])
    nb.metadata["kernelspec"] = {"name": "python3", "display_name": "Python 3 (ipykernel)",
                                 "language": "python"}
    nb.metadata["labkit"] = {"bank": next(b.name for b in all_banks().values()
                                          if answered.id in b.questions)}
    return nb, fault


@pytest.mark.timeout(300)
def test_the_checks_can_fail(lab, page):
    nb, fault = _selfcheck_notebook()
    rel = "notebooks/_browser_selfcheck.ipynb"        # in the server's temporary copy only
    nbformat.write(nb, lab.root / rel)
    report = bp.check_notebook(lab, page, rel, slow_s=1.0, grade=True, gone_s=3.0)  # sleep 120 stays
    print(report.summary())
    probs = report.problems
    print("\n".join(probs))
    cell = {k: f"cell {i + 1}:" for k, i in fault.items()}       # problems count cells from 1
    assert any(p.startswith(cell["error"]) and "ZeroDivisionError" in p for p in probs), probs
    assert any(p.startswith(f"cell {fault['error'] + 2}:") and "did not run" in p
               for p in probs), probs
    assert any("Error displaying widget" in p for p in probs), probs
    assert any("outlived the kernel" in p and "sleep 120" in p for p in probs), probs
    assert any(p.startswith("grade: an untouched student notebook must score zero") for p in probs)
    assert len([p for p in probs if "progress bar" not in p]) == 5, probs   # nothing else failed
    bars = [p for p in probs if "progress bar" in p]                # limit 1 s: also other cells
    assert any(p.startswith(cell["slow"]) for p in bars), probs
    assert not any(p.startswith(cell["tqdm"]) for p in bars), probs  # 1.6 s, but with a bar
    assert report.quizzes >= 3 and report.players == 1 and report.images >= 1


@pytest.mark.timeout(600)
@pytest.mark.parametrize("path", NOTEBOOKS, ids=[p.stem for p in NOTEBOOKS])
def test_notebook_in_jupyterlab(lab, page, path):
    rel = path.relative_to(REPO).as_posix()
    source = "\n".join(c.source for c in nbformat.read(path, as_version=4).cells
                       if c.cell_type == "code")
    report = bp.check_notebook(lab, page, rel, slow_s=SLOW_S,
                               as_readme=(rel == readme_notebook()), grade=True)
    print(report.summary())
    (ARTIFACTS / path.stem / "summary.txt").write_text(report.summary() + "\n")
    assert report.problems == [], f"{rel} in JupyterLab:\n  " + "\n  ".join(report.problems)
    if "quiz.ask(" in source:
        assert report.quizzes, f"{rel} calls lk.quiz.ask but no quiz form (.labkit-quiz) rendered"
    if "ringviz.player(" in source:
        assert report.players, f"{rel} shows lk.ringviz.player but no player rendered"
    if PLOTS.search(source):
        assert report.images, f"{rel} plots, but no image rendered in JupyterLab"
