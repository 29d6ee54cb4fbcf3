'''Student notebooks generated from the solutions: one source of truth, checked for drift.

``solutions/NN_name.ipynb`` is what authors edit. Solution regions are marked
the nbgrader way, each marker alone on its line::

    def ring_all_reduce(tensor):
        """Sum tensor across ranks, in place."""
        ### BEGIN SOLUTION
        ...
        ### END SOLUTION

    ### BEGIN SOLUTION
    q_ring_steps = 6
    ### END SOLUTION

``python -m labkit students`` writes ``notebooks/NN_name.ipynb`` with

* a region inside a function body replaced by
  ``raise NotImplementedError("ring_all_reduce: write your code here")`` at the
  region's indentation (``lk.exercise.check`` then reports "not done yet");
* a region at top level, which must hold only simple assignments ``name = value``,
  replaced by one ``name = None  # YOUR ANSWER HERE`` per assignment
  (``lk.quiz.check`` then reports "not answered yet");
* a region in a markdown cell replaced by ``YOUR ANSWER HERE``;
* outputs, execution counts, widget state and cell metadata other than ``tags``
  removed; notebook metadata ``labkit.bank = "NN_name"`` added (the grader uses it).

So a student notebook runs top to bottom without errors. ``generate --check``
writes nothing and exits 1 listing every notebook that differs from what would
be generated (tests/grading/test_notebooks_sync.py runs it). Any malformed region is an
error naming notebook, cell and line.

Commands::

    python -m labkit students            # rewrite notebooks/ from solutions/
    python -m labkit students --check    # exit 1 if notebooks/ drifted
    python -m labkit students --solutions S --notebooks N 03_ring_allreduce
'''
from __future__ import annotations

import argparse
import ast
import re
import sys
import textwrap
from pathlib import Path

from ..runtime.errors import LabkitError

__all__ = ["NotebookSourceError", "stub_code", "stub_markdown", "student_version", "generate",
           "main", "BEGIN", "END"]

BEGIN, END = "### BEGIN SOLUTION", "### END SOLUTION"
_ROOT = Path(__file__).resolve().parents[2]   # the repository: labkit/grading/ is two below
_DEF = re.compile(r"^\s*(async\s+)?def\s+([A-Za-z_]\w*)")


class NotebookSourceError(LabkitError):
    """A solution notebook has a malformed solution region (says where and how to fix it)."""


def _regions(lines: list[str], where: str) -> list[tuple[int, int]]:
    """(begin, end) line indices of each solution region, markers included."""
    out, start = [], None
    for i, line in enumerate(lines):
        marker = line.strip()
        if marker == BEGIN:
            if start is not None:
                raise NotebookSourceError(f"{where}, line {i + 1}: {BEGIN} inside another region "
                                          f"(opened on line {start + 1}); close it first.")
            start = i
        elif marker == END:
            if start is None:
                raise NotebookSourceError(f"{where}, line {i + 1}: {END} without {BEGIN}.")
            out.append((start, i))
            start = None
    if start is not None:
        raise NotebookSourceError(f"{where}, line {start + 1}: {BEGIN} is never closed; add "
                                  f"{END} after the solution.")
    return out


def _enclosing_def(lines: list[str], i: int, indent: int) -> str | None:
    """The name of the function whose body holds line ``i`` (indented by ``indent``), or None."""
    for line in reversed(lines[:i]):
        stripped = line.strip()
        if not stripped or stripped.startswith("#"):
            continue
        ind = len(line) - len(line.lstrip())
        if ind < indent:
            m = _DEF.match(line)
            if m:
                return m.group(2)
            indent = ind
            if ind == 0:
                return None
    return None


def _assignments(body: list[str], where: str) -> list[str]:
    """The names assigned by a top-level region, which must hold only ``name = value``."""
    src = textwrap.dedent("\n".join(body))
    try:
        tree = ast.parse(src)
    except SyntaxError as exc:
        raise NotebookSourceError(f"{where}: a top-level solution region must be plain Python "
                                  f"assignments; line {exc.lineno} does not parse: "
                                  f"{exc.msg}.") from None
    names = []
    for stmt in tree.body:
        target = (stmt.targets[0] if isinstance(stmt, ast.Assign) and len(stmt.targets) == 1
                  else stmt.target if isinstance(stmt, ast.AnnAssign) and stmt.value else None)
        if not isinstance(target, ast.Name):
            raise NotebookSourceError(
                f"{where}: line {stmt.lineno} of the region is `{ast.unparse(stmt)[:60]}`, but a "
                f"top-level solution region may hold only simple assignments `name = value`. "
                f"Move other code out of the region, or into a function.")
        names.append(target.id)
    return names


def stub_code(source: str, where: str = "cell") -> str:
    """The student version of one code cell's source (see the module docstring for the rules).

    >>> src = "def f(x):\\n    ### BEGIN SOLUTION\\n    return 2 * x\\n    ### END SOLUTION"
    >>> print(stub_code(src))
    def f(x):
        raise NotImplementedError("f: write your code here")
    """
    lines = source.split("\n")
    out, pos = [], 0
    for begin, end in _regions(lines, where):
        out += lines[pos:begin]
        marker = lines[begin]
        indent = len(marker) - len(marker.lstrip())
        pad = marker[:indent]
        here = f"{where}, region on line {begin + 1}"
        if indent:
            name = _enclosing_def(lines, begin, indent)
            if name is None:
                raise NotebookSourceError(f"{here}: an indented solution region must be inside "
                                          f"a function body (it becomes `raise "
                                          f"NotImplementedError`).")
            out.append(f'{pad}raise NotImplementedError("{name}: write your code here")')
        else:
            out += [f"{n} = None  # YOUR ANSWER HERE" for n in
                    _assignments(lines[begin + 1:end], here)]
        pos = end + 1
    return "\n".join(out + lines[pos:])


def stub_markdown(source: str, where: str = "cell") -> str:
    """A markdown cell with each solution region replaced by ``YOUR ANSWER HERE``."""
    lines = source.split("\n")
    out, pos = [], 0
    for begin, end in _regions(lines, where):
        out += lines[pos:begin] + ["YOUR ANSWER HERE"]
        pos = end + 1
    return "\n".join(out + lines[pos:])


def student_version(nb, name: str):
    """A new notebook: ``nb`` (a solution) with stubs, without outputs or widget state."""
    import nbformat

    nb = nbformat.from_dict(nb)
    for i, cell in enumerate(nb.cells):
        where = f"solutions/{name}.ipynb, cell {i + 1}"
        if cell.cell_type == "code":
            cell.source = stub_code(cell.source, where)
            cell.outputs, cell.execution_count = [], None
        elif cell.cell_type == "markdown":
            cell.source = stub_markdown(cell.source, where)
        cell.metadata = {"tags": cell.metadata["tags"]} if cell.metadata.get("tags") else {}
        if not cell.get("id"):
            cell["id"] = f"{name[:50]}-{i}"
    nb.metadata.pop("widgets", None)
    nb.metadata["labkit"] = {"bank": name, "generated_from": f"solutions/{name}.ipynb"}
    if nb.nbformat_minor < 5:
        nb.nbformat_minor = 5
    return nb


def _render(path: Path) -> str:
    import nbformat

    nb = student_version(nbformat.read(path, as_version=4), path.stem)
    return nbformat.writes(nb) + "\n"


def generate(solutions: Path, notebooks: Path, names: list[str] | None = None,
             check: bool = False) -> list[str]:
    """Regenerate ``notebooks/`` from ``solutions/``; return the names that differed.

    With ``check=True`` nothing is written. A student notebook without a solution
    counts as drift (it would never be regenerated).
    """
    sources = sorted(solutions.glob("*.ipynb"))
    if names:
        sources = [p for p in sources if p.stem in names]
        unknown = set(names) - {p.stem for p in sources}
        if unknown:
            raise NotebookSourceError(f"no solution notebook for {sorted(unknown)} in {solutions}.")
    drifted = []
    for src in sources:
        target = notebooks / src.name
        text = _render(src)
        if not target.exists() or target.read_text(encoding="utf-8") != text:
            drifted.append(src.stem)
            if not check:
                notebooks.mkdir(parents=True, exist_ok=True)
                target.write_text(text, encoding="utf-8")
    if not names:
        drifted += sorted(p.stem for p in notebooks.glob("*.ipynb")
                          if not (solutions / p.name).exists())
    return drifted


def main(argv: list[str] | None = None) -> int:
    """``python -m labkit students [NAMES] [--check]``."""
    parser = argparse.ArgumentParser(prog="python -m labkit students",
                                     description="Generate the student notebooks in notebooks/ "
                                                 "from the solved ones in solutions/.")
    parser.add_argument("names", nargs="*",
                        help="notebooks (default: all), e.g. 03_ring_allreduce")
    parser.add_argument("--check", action="store_true",
                        help="write nothing; exit 1 listing notebooks that differ from solutions/")
    parser.add_argument("--solutions", type=Path, default=_ROOT / "solutions")
    parser.add_argument("--notebooks", type=Path, default=_ROOT / "notebooks")
    args = parser.parse_args(argv)
    try:
        drifted = generate(args.solutions, args.notebooks, args.names, check=args.check)
    except (NotebookSourceError, OSError, ValueError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    orphans = [n for n in drifted if not (args.solutions / f"{n}.ipynb").exists()]
    for n in drifted:
        if n in orphans:
            print(f"{args.notebooks / n}.ipynb has no solutions/{n}.ipynb: delete it or add the "
                  f"solution notebook")
        elif args.check:
            print(f"{args.notebooks / n}.ipynb differs from solutions/{n}.ipynb")
        else:
            print(f"wrote {args.notebooks / n}.ipynb")
    if args.check and drifted:
        print("Run `python -m labkit students` and commit the result.", file=sys.stderr)
        return 1
    if not drifted:
        print("student notebooks are up to date")
    return 1 if orphans else 0


if __name__ == "__main__":
    sys.exit(main())
