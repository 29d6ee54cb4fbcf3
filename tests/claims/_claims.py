"""Claim tests: each one reproduces a sentence the lab says about torch / gloo / torchrun.

A claim test's docstring starts with where the sentence is and quotes it, e.g. the docstring
``02 "Step 2 · Scatter": “the shards are disjoint except for the padding”.``

``NN`` is the notebook number (its solution in ``solutions/``), or ``README``; a docstring may
quote several sentences, each belonging to the place named before it. :func:`check_quotes`
(called by each claim file) asserts that every quoted sentence really is in the notebook (or
README), so prose and test cannot drift apart: change the sentence, and the test that backs it
must change too. When a claim test fails after a torch upgrade, the sentence it quotes is wrong
for the new version: fix the prose, then the test.
"""
from __future__ import annotations

import inspect
import re
import subprocess
from pathlib import Path

import nbformat

ROOT = Path(__file__).resolve().parents[2]
_WHERE = re.compile(r'(?:^|\s)(\d\d|README) "')        # 02 "Step 2 · Scatter"
_QUOTE = re.compile(r"“(.+?)”", re.S)


def _norm(text: str) -> str:
    return " ".join(text.replace("**", "").split())


def source_text(where: str) -> str:
    """The prose of solutions/NN_*.ipynb (markdown and code), or of the README."""
    if where == "README":
        return _norm((ROOT / "README.md").read_text())
    [path] = (ROOT / "solutions").glob(f"{where}_*.ipynb")
    nb = nbformat.read(path, as_version=4)
    return _norm("\n".join(c.source for c in nb.cells))


def quotes(module) -> list[tuple[str, str, str]]:
    """``(test name, where, sentence)`` for every claim test of a module, from its docstring."""
    out = []
    for name, fn in inspect.getmembers(module, inspect.isfunction):
        if name.startswith("test_") and fn.__doc__ and fn.__module__ == module.__name__:
            places = [(m.start(), m.group(1)) for m in _WHERE.finditer(fn.__doc__)]
            for q in _QUOTE.finditer(fn.__doc__):   # each quote belongs to the place before it
                where = [w for at, w in places if at < q.start()]
                if where:
                    out.append((name, where[-1], _norm(q.group(1))))
    return out


def check_quotes(module) -> None:
    """Every claim test quotes a sentence, and every quoted sentence is where it says."""
    found = quotes(module)
    tests = [n for n, fn in inspect.getmembers(module, inspect.isfunction)
             if n.startswith("test_") and fn.__module__ == module.__name__
             and n != "test_the_lab_says_what_these_tests_show"]
    missing = sorted(set(tests) - {n for n, _, _ in found})
    assert not missing, f"claim tests without a quoted sentence in their docstring: {missing}"
    for name, where, sentence in found:
        assert sentence in source_text(where), (
            f"{name} backs the sentence “{sentence}”, which {where} no longer says: update the "
            f"test's docstring together with the prose")


def run_tree(cmd: list[str], timeout: float, **kwargs) -> subprocess.CompletedProcess:
    """``subprocess.run(cmd, capture_output=True, text=True)`` that, on a timeout, kills the whole
    process tree: torchrun starts its workers in their own sessions, so killing the agent alone
    would leave them running. Raises ``subprocess.TimeoutExpired`` after cleaning up."""
    import psutil

    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            **kwargs)
    try:
        out, err = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        try:
            tree = psutil.Process(proc.pid).children(recursive=True) + [psutil.Process(proc.pid)]
        except psutil.NoSuchProcess:
            tree = []
        for p in tree:
            try:
                p.kill()
            except psutil.NoSuchProcess:
                pass
        proc.communicate()
        raise
    return subprocess.CompletedProcess(cmd, proc.returncode, out, err)
