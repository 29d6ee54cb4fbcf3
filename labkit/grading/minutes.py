"""How long a section takes, by the method the README states: ``python -m labkit minutes [NN...]``.

Every ``##`` heading of a lesson ends with its route and minutes, ``[core · 6 min]`` or
``[deep dive · 9 min]``. This module splits a notebook at those headings (:func:`sections`) and
estimates each section the same way for every lesson:

* its prose and code at 200 words a minute (code counted in words, comments and solution
  regions left out), its tables at 400 (skimmed);
* each code cell's output at 400 words a minute (skimmed), or the cell's run time when that is
  longer (you read while it runs); half a minute per figure;
* half a minute per quiz question it shows;
* each exercise by what it asks (:func:`exercise_minutes`): 3 minutes to read the task and run
  the checker, 1.5 minutes per line the reference solution writes, and 5 more for each
  distributed construct (a collective or point-to-point call, a hook, an autograd ``Function``,
  a DTensor placement) that the solution uses and no earlier cell of the course shows.

Outputs, figures and run times come from an executed copy (``build/executed/``, left by the
test command; see :mod:`labkit.grading.pytest_plugin`). Without one, the estimate is a lower
bound (words, questions and exercises only): the notebook rules test checks that every tag is
at least that. The command prints both beside the tag.
"""
from __future__ import annotations

import argparse
import math
import re
import sys
from dataclasses import dataclass, field
from pathlib import Path

__all__ = ["Section", "sections", "exercise_minutes", "estimate", "main", "TAG",
           "WORDS_PER_MINUTE", "SKIM_WORDS_PER_MINUTE"]

_ROOT = Path(__file__).resolve().parents[2]   # the repository: labkit/grading/ is two below
SOLUTIONS = _ROOT / "solutions"
EXECUTED = _ROOT / "build" / "executed"
TAG = re.compile(r"\[(core|deep dive) · (\d+) min\]\s*$")
WORDS_PER_MINUTE, SKIM_WORDS_PER_MINUTE = 200, 400
READ_TASK, PER_LINE, PER_NEW_CONSTRUCT = 3.0, 1.5, 5.0
BEGIN, END = "### BEGIN SOLUTION", "### END SOLUTION"

# What counts as a distributed construct in a solution: a call on ``dist`` (or
# ``torch.distributed``), a hook registration, an autograd Function, a DTensor placement or API.
_CONSTRUCT = re.compile(
    r"\b(?:dist|torch\.distributed)\.(\w+)\s*\("
    r"|\.(register_\w*hook)\s*\("
    r"|\b(autograd\.Function)\b"
    r"|\b(Shard|Replicate|Partial|distribute_tensor|DTensor\.from_local|full_tensor|to_local)\b")


@dataclass
class Section:
    """One ``##`` section: its title, route, tagged minutes and cells (nbformat nodes)."""

    title: str
    route: str | None
    minutes: int
    tagged: bool
    md: list[str] = field(default_factory=list)      # markdown lines, the heading first
    cells: list = field(default_factory=list)        # the code cells

    @property
    def code(self) -> list[str]:
        return [c.source for c in self.cells]


def sections(path_or_nb) -> list[Section]:
    """The notebook split at its ``##`` headings. Cells before the first ``##`` heading (title,
    imports) form a core "(preamble)" of 0 minutes."""
    import nbformat
    nb = (nbformat.read(path_or_nb, as_version=4) if isinstance(path_or_nb, (str, Path))
          else path_or_nb)
    out = [Section("(preamble)", "core", 0, True)]
    for cell in nb.cells:
        if cell.cell_type == "markdown":
            for line in cell.source.splitlines():
                if line.startswith("## "):
                    m = TAG.search(line)
                    out.append(Section(line[3:].strip(), m.group(1) if m else None,
                                       int(m.group(2)) if m else 0, bool(m)))
                out[-1].md.append(line)
        elif cell.cell_type == "code":
            out[-1].cells.append(cell)
    return out


def _split(source: str) -> tuple[list[str], list[str], bool]:
    """A code cell's lines outside and inside solution regions; whether a region is indented
    (inside a function body: something to write, not a quiz answer)."""
    outside, inside, indented, region = [], [], False, False
    for line in source.splitlines():
        if line.strip() == BEGIN:
            region, indented = True, indented or line[:1].isspace()
        elif line.strip() == END:
            region = False
        elif region:
            inside.append(line)
        else:
            outside.append(line)
    return outside, inside, indented


def _words(lines) -> int:
    text = "\n".join(re.sub(r"(^|\s)#.*$", "", ln) for ln in lines)
    return len(text.split())


def _written(lines) -> list[str]:
    """The lines that do something: no blank line, comment or import."""
    return [ln for ln in lines if ln.strip()
            and not ln.strip().startswith(("#", "import ", "from "))]


_QUERIES = {"get_rank", "get_world_size", "is_initialized", "is_available", "get_backend"}


def constructs(text: str) -> set[str]:
    """The distributed constructs a piece of code uses (see :data:`_CONSTRUCT`); asking for
    the rank or the world size is not one."""
    return {next(g for g in m.groups() if g) for m in _CONSTRUCT.finditer(text)} - _QUERIES


def exercise_minutes(solution_lines: list[str], shown: set[str]) -> float:
    """An exercise's minutes: 3 to read it and run the checker, 1.5 per line its reference
    solution writes, 5 per construct it uses that ``shown`` (what earlier cells showed) lacks."""
    written = _written(solution_lines)
    new = constructs("\n".join(written)) - shown
    return READ_TASK + PER_LINE * len(written) + PER_NEW_CONSTRUCT * len(new)


@dataclass
class Estimate:
    """A section's estimate: ``static`` from its words, questions and exercises alone (a lower
    bound), ``full`` with what its executed cells print and how long they run (None: no copy)."""

    section: Section
    static: float
    full: float | None
    exercises: list[tuple[str, float]]


def _questions(source: str) -> set[str]:
    return set(re.findall(r'lk\.quiz\.(?:ask|show)\((?:[^)]*?)"(\d\d\.\w+)"', source))


def estimate(path: Path, executed: Path | None = None,
             shown_before: dict[str, set[str]] | None = None) -> list[Estimate]:
    """Every section of the solved notebook ``path``, estimated by the method above.
    ``executed``: its executed copy (outputs, and each code cell's ``metadata.labkit.seconds``;
    ignored unless its code cells are this notebook's);
    ``shown_before``: the constructs earlier notebooks show, ``{"core": ..., "deep dive": ...}``
    (a core exercise counts only what the core path showed; a deep dive's, every earlier cell),
    updated in place with this notebook's."""
    import nbformat
    shown = shown_before if shown_before is not None else {"core": set(), "deep dive": set()}
    shown.setdefault("core", set()), shown.setdefault("deep dive", set())
    ran = None
    if executed is not None and executed.exists():
        ran = [c for c in nbformat.read(executed, as_version=4).cells if c.cell_type == "code"]
        now = [c.source for c in nbformat.read(path, as_version=4).cells
               if c.cell_type == "code"]
        if [c.source for c in ran] != now:        # a copy of an older version: not this one
            ran = None
    out, n = [], 0
    for sec in sections(path):
        table = [ln for ln in sec.md if ln.lstrip().startswith("|")]
        words = _words(ln for ln in sec.md if ln not in table)
        skimmed = _words(table)
        questions, exercises, extra = set(), [], 0.0
        for i, cell in enumerate(sec.cells):
            outside, inside, indented = _split(cell.source)
            words += _words(outside)
            questions |= _questions(cell.source)
            if indented:
                m = re.search(r'lk\.exercise\.check\("([^"]+)"', "\n".join(
                    c.source for c in sec.cells[i:]))
                exercises.append((m.group(1) if m else "(exercise)",
                                  exercise_minutes(inside, shown[sec.route or "core"])))
            used = constructs("\n".join(_written(outside)))
            shown["deep dive"] |= used
            if sec.route == "core":
                shown["core"] |= used
            if ran is not None:
                done = ran[n]
                printed = sum(len(_output_text(o).split()) for o in done.outputs)
                seconds = done.metadata.get("labkit", {}).get("seconds", 0.0)
                figures = sum("image/png" in o.get("data", {}) for o in done.outputs)
                extra += max(printed / SKIM_WORDS_PER_MINUTE, seconds / 60) + 0.5 * figures
            n += 1
        static = (words / WORDS_PER_MINUTE + skimmed / SKIM_WORDS_PER_MINUTE
                  + 0.5 * len(questions) + sum(m for _, m in exercises))
        out.append(Estimate(sec, static, None if ran is None else static + extra, exercises))
    return out[1:]


def _output_text(out) -> str:
    if out.get("output_type") == "stream":
        return out.get("text", "")
    data = out.get("data", {})
    return data.get("text/plain", "") if "image/png" not in data else ""


def course_estimates(folder: Path = SOLUTIONS, executed: Path | None = EXECUTED):
    """``{notebook stem: [Estimate...]}`` for every solved notebook in course order, each
    exercise's new constructs judged against every earlier cell of its route in the course."""
    shown, out = {"core": set(), "deep dive": set()}, {}
    for path in sorted(folder.glob("[0-9][0-9]_*.ipynb")):
        out[path.stem] = estimate(path, executed / path.name if executed else None, shown)
    return out


def rounded(minutes: float) -> int:
    """Minutes as a tag states them: rounded half up, at least 1."""
    return max(1, math.floor(minutes + 0.5))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m labkit minutes", description=__doc__.split(
        "\n\n")[0])
    parser.add_argument("lessons", nargs="*", help="two-digit numbers (default: every lesson)")
    parser.add_argument("--executed", type=Path, default=EXECUTED,
                        help="the executed copies (default: build/executed, from the tests)")
    args = parser.parse_args(argv)
    table = course_estimates(SOLUTIONS, args.executed)
    missing = [stem for stem, rows in table.items() if rows and rows[0].full is None]
    if missing:
        print(f"no executed copy of {', '.join(missing)} in {args.executed} that matches the "
              "notebook (run the test command, or `.venv/bin/python -m pytest "
              "solutions/NN_name.ipynb`): for those, the lower bound only (words, questions, "
              "exercises)", file=sys.stderr)
    for stem, rows in table.items():
        if args.lessons and stem[:2] not in args.lessons:
            continue
        print(f"\n{stem}")
        print(f"  {'tag':>4} {'lower':>6} {'full':>6}  section")
        for e in rows:
            full = "" if e.full is None else f"{e.full:6.1f}"
            flag = "  < lower bound" if e.section.minutes < rounded(e.static) else (
                "" if e.full is None or abs(e.section.minutes - rounded(e.full)) <= 1
                else f"  (method: {rounded(e.full)})")
            ex = "".join(f"  [{name}: {m:.0f} min]" for name, m in e.exercises)
            print(f"  {e.section.minutes:>4} {e.static:6.1f} {full:>6}  "
                  f"{TAG.sub('', e.section.title).strip()[:60]}{ex}{flag}")
        for route in ("core", "deep dive"):
            total = sum(e.section.minutes for e in rows if e.section.route == route)
            print(f"  {route}: {total} min tagged")
    return 0


if __name__ == "__main__":
    sys.exit(main())
