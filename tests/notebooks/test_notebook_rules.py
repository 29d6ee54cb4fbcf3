"""Rules every lesson notebook follows (CONVENTIONS.md "Notebooks"), checked statically.

* Every quiz question a notebook checks (``lk.quiz.check("NN.x", ...)``) is DISPLAYED — prompt and
  choices, by ``lk.quiz.ask("NN.x")`` or ``lk.quiz.show(..., "NN.x", ...)`` — in the same code cell
  or the code cell right before it; and every question of the notebook's bank is checked in it.
* Every ``##`` heading carries a route tag ``[core · N min]`` or ``[deep dive · N min]``; the core
  path through 00-05 adds up to 65-80 minutes (the seed lesson is 75); the last ``##`` section is
  ``## Evaluation [core · N min]`` and its rubric names every graded item of the bank with its
  points and the notebook's total.
* A core section never uses a name (variable, function, class) that only an earlier deep-dive
  section of the same notebook defines: a learner on the core path skips deep dives.
* No section is tagged below what the README's method gives for its words, questions and
  exercises (:mod:`labkit.grading.minutes`; outputs and run times only add to it).
* A key term (any notebook's "Key terms") that a core section's prose uses has been taught on
  the core path before: set in bold in a core section, where it is explained.

Pure logic on the notebook files (``ast``), no kernel: it runs in well under a second.
"""
from __future__ import annotations

import ast
import builtins
import re
import symtable
from pathlib import Path

import nbformat
import pytest

from labkit.grading import minutes as method
from labkit.grading.bank import all_banks

ROOT = Path(__file__).resolve().parents[2]
LESSONS = sorted(p for folder in ("solutions", "notebooks") for p in (ROOT / folder).glob("*.ipynb"))
IDS = [f"{p.parent.name}/{p.stem}" for p in LESSONS]
BANKS = all_banks(ROOT / "quizzes")
TAG = method.TAG
CORE_MINUTES = (65, 80)          # the seed lesson is 75 minutes (README: "How long it takes")


def code_of(source: str) -> str:
    """A code cell's source as Python: IPython magics and shell escapes blanked out."""
    return "\n".join("" if line.lstrip().startswith(("%", "!")) else line
                     for line in source.splitlines())


def quiz_calls(source: str) -> list[tuple[str, str]]:
    """``(verb, question id)`` for every ``lk.quiz.<verb>("id", ...)`` in a code cell."""
    out = []
    for node in ast.walk(ast.parse(code_of(source))):
        if (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute)
                and isinstance(node.func.value, ast.Attribute) and node.func.value.attr == "quiz"):
            verb = node.func.attr
            ids = node.args if verb == "show" else node.args[:1]
            out += [(verb, a.value) for a in ids
                    if isinstance(a, ast.Constant) and isinstance(a.value, str)]
    return out


def code_cells(path: Path) -> list[str]:
    nb = nbformat.read(path, as_version=4)
    return [c.source for c in nb.cells if c.cell_type == "code"]


def undisplayed(path: Path) -> list[str]:
    """Question ids checked in a code cell without being displayed there or in the cell before."""
    cells = [quiz_calls(src) for src in code_cells(path)]
    missing = []
    for i, calls in enumerate(cells):
        shown = {qid for verb, qid in calls + (cells[i - 1] if i else [])
                 if verb in ("ask", "show")}
        missing += [f"{qid} (code cell {i + 1})" for verb, qid in calls
                    if verb == "check" and qid not in shown]
    return missing


@pytest.mark.parametrize("path", LESSONS, ids=IDS)
def test_every_checked_question_is_displayed_where_it_is_answered(path):
    missing = undisplayed(path)
    assert not missing, (
        f"{path.relative_to(ROOT)} checks questions the learner never sees: {missing}. Put "
        f'lk.quiz.ask("<id>") or lk.quiz.show("<id>", ...) in the same cell or the cell above')


@pytest.mark.parametrize("path", LESSONS, ids=IDS)
def test_every_bank_question_is_checked_in_its_notebook(path):
    bank = BANKS[path.stem]
    checked = {qid for src in code_cells(path) for verb, qid in quiz_calls(src) if verb == "check"}
    checked |= set(re.findall(r'lk\.exercise\.check\("([^"]+)"', "\n".join(code_cells(path))))
    never = [qid for qid in bank.questions if qid not in checked]
    assert not never, f"{path.relative_to(ROOT)} never checks {never} from {bank.path.name}"


def test_the_rule_catches_a_hidden_question(tmp_path):
    nb = nbformat.v4.new_notebook(cells=[
        nbformat.v4.new_code_cell('lk.quiz.show("00.all_reduce_twice")'),
        nbformat.v4.new_markdown_cell("text in between does not matter"),
        nbformat.v4.new_code_cell('q_all_reduce_twice = 18\n'
                                  'lk.quiz.check("00.all_reduce_twice", q_all_reduce_twice)\n'
                                  'lk.quiz.check("00.cpu_backend", "gloo")'),
        nbformat.v4.new_code_cell('%time x = 1\nlk.quiz.check("00.all_reduce_twice", 10)')])
    path = tmp_path / "00_setup.ipynb"
    nbformat.write(nb, path)
    assert undisplayed(path) == ["00.cpu_backend (code cell 2)",
                                 "00.all_reduce_twice (code cell 3)"]


# ------------------------------------------------------------------ routes: core and deep dives
def sections(path: Path) -> list[dict]:
    """The notebook split at its ``##`` headings (:func:`labkit.grading.minutes.sections`), as
    dicts: title, route, minutes, tagged, markdown lines and code sources."""
    return [{"title": s.title, "route": s.route, "minutes": s.minutes, "tagged": s.tagged,
             "md": s.md, "code": s.code} for s in method.sections(path)]


SOLVED = [p for p in LESSONS if p.parent.name == "solutions"]
SEED = [p for p in SOLVED if p.stem[:2] in ("00", "01", "02", "03", "04", "05")]   # the 75 min


@pytest.mark.parametrize("path", LESSONS, ids=IDS)
def test_every_section_heading_has_a_route_tag(path):
    untagged = [s["title"] for s in sections(path) if not s["tagged"]]
    assert not untagged, (f"{path.relative_to(ROOT)}: these ## headings need [core · N min] or "
                          f"[deep dive · N min] at the end: {untagged}")
    assert all(s["minutes"] >= 1 for s in sections(path)[1:]), "a section takes at least 1 minute"


def test_the_core_path_through_00_to_05_takes_about_75_minutes():
    per_notebook = {p.stem: sum(s["minutes"] for s in sections(p) if s["route"] == "core")
                    for p in SEED}
    assert len(per_notebook) == 6, per_notebook
    total = sum(per_notebook.values())
    assert CORE_MINUTES[0] <= total <= CORE_MINUTES[1], (
        f"the core path takes {total} min ({per_notebook}); the seed lesson is 75")


def test_each_lesson_beyond_the_seed_keeps_its_core_path_to_about_75_minutes():
    """06, 07, 08 (and any later lesson) are lessons of their own: each core path is at most
    about the seed lesson's length, its exercises counted by what they ask; the rest is deep
    dives."""
    long = {p.stem: total for p in SOLVED if p not in SEED
            for total in [sum(s["minutes"] for s in sections(p) if s["route"] == "core")]
            if total > CORE_MINUTES[1]}
    assert not long, f"core paths over {CORE_MINUTES[1]} minutes: {long}"


def route_row(path: Path) -> str:
    """The README's row for one notebook in "Two routes": each route's minutes and sections."""
    cells = []
    for route in ("core", "deep dive"):
        secs = [x for x in sections(path)[1:] if x["route"] == route]
        titles = (re.sub(r"^(\d+) · ", r"§\1 ", TAG.sub("", x["title"]).strip()) for x in secs)
        cells.append(f"**{sum(x['minutes'] for x in secs)} min**: "
                     + ", ".join(f"{t} ({x['minutes']})" for t, x in zip(titles, secs)))
    return f"| {path.stem} | {cells[0]} | {cells[1]} |"


@pytest.mark.parametrize("path", SOLVED, ids=[p.stem for p in SOLVED])
def test_the_notebooks_route_paragraph_states_its_own_minutes(path):
    """The introduction's "Route." paragraph says how long each route takes: the tags' sums."""
    intro = nbformat.read(path, as_version=4).cells[0].source
    para = next((p for p in intro.split("\n\n") if "route.**" in p.lower()), None)
    assert para, f"{path.name}: the first cell needs a **Route.** (or **Your route.**) paragraph"
    para = " ".join(para.split())
    minutes = {r: sum(s["minutes"] for s in sections(path)[1:] if s["route"] == r)
               for r in ("core", "deep dive")}
    core = re.search(r"core path.*? takes about (\d+) minutes", para)
    deep = re.search(r"deep dives.*? about (\d+) more", para)
    assert core and deep, f"{path.name}: say “the core path … takes about N minutes; the deep dives … about M more”"
    assert (int(core.group(1)), int(deep.group(1))) == (minutes["core"], minutes["deep dive"]), (
        f"{path.name}: its sections' tags add up to {minutes['core']} core and "
        f"{minutes['deep dive']} deep-dive minutes; the Route paragraph says {core.group(1)} and "
        f"{deep.group(1)}")


def test_the_readme_route_table_is_the_notebooks_own():
    readme = (ROOT / "README.md").read_text()
    stale = [route_row(p) for p in SOLVED if route_row(p) not in readme]
    assert not stale, "README.md, “Two routes”: replace the notebook's row by\n" + "\n".join(stale)
    core = sum(s["minutes"] for p in SEED for s in sections(p) if s["route"] == "core")
    assert f"takes about **{core} minutes**" in readme


def bound_and_used(source: str) -> tuple[set[str], set[str]]:
    """Names a code cell binds at top level (assignments, defs, imports, loop targets) and the
    global names it reads anywhere, function bodies and comprehensions included (``symtable``:
    a function's own arguments and locals are not globals)."""
    top = symtable.symtable(code_of(source), "<cell>", "exec")
    bound = {s.get_name() for s in top.get_symbols() if s.is_assigned() or s.is_imported()}
    used, todo = set(), [top]
    while todo:
        table = todo.pop()
        todo += table.get_children()
        for sym in table.get_symbols():
            if sym.is_referenced() and (table is top or sym.is_global()):
                used.add(sym.get_name())
    return bound, used


def deep_dive_leaks(path: Path) -> list[str]:
    """Names a core section uses that only an earlier deep-dive section defines."""
    core_names, deep_names, leaks = set(dir(builtins)), set(), []
    for s in sections(path):
        for src in s["code"]:
            bound, used = bound_and_used(src)
            if s["route"] == "core":
                leaks += [f"{name!r} in “{s['title']}”" for name in sorted(
                    (used - bound - core_names) & deep_names)]
                core_names |= bound
            else:
                deep_names |= bound
    return leaks


@pytest.mark.parametrize("path", LESSONS, ids=IDS)
def test_no_core_section_needs_a_deep_dive(path):
    leaks = deep_dive_leaks(path)
    assert not leaks, (f"{path.relative_to(ROOT)}: a learner on the core path skips deep dives, "
                       f"but these names are defined only in one: {leaks}")


def test_the_leak_rule_catches_a_name_from_a_deep_dive(tmp_path):
    nb = nbformat.v4.new_notebook(cells=[
        nbformat.v4.new_code_cell("import torch\nx = 1"),
        nbformat.v4.new_markdown_cell("## A [deep dive · 2 min]"),
        nbformat.v4.new_code_cell("def helper(t):\n    return t + x\nmeasured = helper(2)"),
        nbformat.v4.new_markdown_cell("## B [core · 1 min]"),
        nbformat.v4.new_code_cell("y = [measured for _ in range(2)]\nprint(torch, x, y, len(y))\n"
                                  "def f(measured):\n    return measured")])
    path = tmp_path / "00_setup.ipynb"
    nbformat.write(nb, path)
    assert deep_dive_leaks(path) == ["'measured' in “B [core · 1 min]”"]


# ------------------------------------------------------------------ evaluation rubric
def check_routes(path: Path) -> dict[str, str]:
    """The route of the section in which each bank question is checked."""
    out = {}
    for s in sections(path):
        for src in s["code"]:
            for qid in re.findall(r'lk\.(?:quiz|exercise)\.check\("([^"]+)"', src):
                out[qid] = s["route"]
    return out


@pytest.mark.parametrize("path", LESSONS, ids=IDS)
def test_the_last_section_is_an_evaluation_rubric_of_every_graded_item(path):
    last = sections(path)[-1]
    assert last["title"].startswith("Evaluation") and last["route"] == "core", (
        f"{path.relative_to(ROOT)}: the last ## section must be “## Evaluation [core · N min]”")
    bank, text = BANKS[path.stem], "\n".join(last["md"])
    rows = {m.group(1): m for m in re.finditer(
        r"^\| [^|]+ \| `(\d\d\.\w+)`[^|]* \| ([\d.]+)[^|]* \| (core|deep dive) \|$", text, re.M)}
    assert sorted(rows) == sorted(bank.questions), "the rubric must list every graded item once"
    routes = check_routes(path)
    for qid, q in bank.questions.items():
        assert float(rows[qid].group(2)) == q.points, f"{qid}: points differ from the bank"
        assert rows[qid].group(3) == routes[qid], f"{qid}: checked in a {routes[qid]} section"
    core = sum(q.points for qid, q in bank.questions.items() if routes[qid] == "core")
    assert f"**{bank.max_points:g}**" in text and f"core: {core:g}" in text
    assert f"**{bank.max_points:g} / {bank.max_points:g}**" in text


# ------------------------------------------------------------------ the cheat sheet
CHEATSHEET = ROOT / "notebooks" / "cheatsheet.md"
TERM = re.compile(r"^[*-] \*\*(.+?)\*\*\s*(\([^)]*\))?\s*(?:—|:)", re.M)


def key_terms(path: Path) -> list[str]:
    """The terms a notebook's "Key terms" section defines, e.g. ``all-gather`` or
    ``channel (NCCL)``."""
    text = "\n".join("\n".join(s["md"]) for s in sections(path) if "Key terms" in s["title"])
    return [m.group(1) + (f" {m.group(2)}" if m.group(2) else "") for m in TERM.finditer(text)]


@pytest.mark.parametrize("path", SOLVED, ids=[p.stem for p in SOLVED])
def test_every_key_term_is_in_the_cheat_sheet_glossary(path):
    glossary = CHEATSHEET.read_text().split("## Glossary", 1)[1]
    terms = key_terms(path)
    assert terms, f"{path.name} has no Key terms section"
    missing = [t for t in terms if f"**{t}**" not in glossary]
    assert not missing, f"add to notebooks/cheatsheet.md's glossary (from {path.name}): {missing}"
    assert f"]({path.stem}.ipynb)" in glossary


def test_the_readme_links_the_cheat_sheet():
    assert "(notebooks/cheatsheet.md)" in (ROOT / "README.md").read_text()


# ------------------------------------------------------------------ claim tests' quotes

def test_a_claim_the_notebook_no_longer_says_fails_the_quote_check():
    import sys
    import types

    sys.path.insert(0, str(ROOT / "tests" / "claims"))
    import _claims

    fake = types.ModuleType("fake_claims")

    def test_something():
        """02 "Step 2 · Scatter": “the shards never overlap”."""

    test_something.__module__ = fake.__name__
    fake.test_something = test_something
    with pytest.raises(AssertionError, match="no longer says"):
        _claims.check_quotes(fake)


# ------------------------------------------------------------------ honest minutes
def test_no_section_is_tagged_below_what_the_method_gives():
    """Every tag is at least the README's method without run times: the section's words,
    questions and exercises (``python -m labkit minutes`` adds outputs and run times)."""
    short = [f"{stem}: “{e.section.title}” is tagged {e.section.minutes} min; its words, "
             f"questions and exercises alone take {e.static:.1f}"
             + "".join(f" ({name}: {m:.1f} by what it asks)" for name, m in e.exercises)
             for stem, rows in method.course_estimates(ROOT / "solutions", None).items()
             for e in rows if e.section.minutes < method.rounded(e.static)]
    assert not short, "\n".join(short)


def _exercise_notebook(tmp_path, body: str, route: str = "core", before: str = "x = 1"):
    nb = nbformat.v4.new_notebook(cells=[
        nbformat.v4.new_markdown_cell(f"## Warm-up [{route} · 1 min]"),
        nbformat.v4.new_code_cell(before),
        nbformat.v4.new_markdown_cell(f"## Build it [{route} · 1 min]\nWrite it."),
        nbformat.v4.new_code_cell("def f(t):\n    import torch\n    ### BEGIN SOLUTION\n"
                                  + body + "\n    ### END SOLUTION\n"),
        nbformat.v4.new_code_cell('lk.exercise.check("00.f", f)')])
    path = tmp_path / "00_x.ipynb"
    nbformat.write(nb, path)
    return path


def test_an_exercise_is_estimated_by_what_it_asks(tmp_path):
    body = ("    # a comment is not a line\n    from os import sep\n"
            "    dist.all_gather_into_tensor(out, t)\n    out /= 2\n\n    return out")
    # 3 lines written; one construct not shown before: 3 + 3 * 1.5 + 5
    [_, build] = method.estimate(_exercise_notebook(tmp_path, body))
    assert build.exercises == [("00.f", 12.5)]
    # the construct shown earlier on the same route: no extra 5 minutes
    [_, build] = method.estimate(_exercise_notebook(
        tmp_path, body, before="dist.all_gather_into_tensor(a, b)"))
    assert build.exercises == [("00.f", 7.5)]
    # shown only in a deep dive: new to a learner on the core path, not to one in a deep dive
    shown = {"core": set(), "deep dive": {"all_gather_into_tensor"}}
    [_, build] = method.estimate(_exercise_notebook(tmp_path, body), shown_before=shown)
    assert build.exercises == [("00.f", 12.5)]
    assert method.rounded(build.static) >= 13


def test_an_executed_copy_adds_outputs_and_run_time(tmp_path):
    path = _exercise_notebook(tmp_path, "    return t")
    nb = nbformat.read(path, as_version=4)
    nb.cells[1].outputs = [nbformat.v4.new_output("stream", name="stdout", text="w " * 400)]
    nb.cells[1].metadata["labkit"] = {"seconds": 90.0}      # longer than reading 400 words
    ran = tmp_path / "ran.ipynb"
    nbformat.write(nb, ran)
    [warm, _] = method.estimate(path, ran)
    assert warm.full - warm.static == pytest.approx(1.5)
    [warm, _] = method.estimate(path)
    assert warm.full is None
    nb.cells[1].source = "x = 2"                             # a copy of an older version
    nbformat.write(nb, ran)
    [warm, _] = method.estimate(path, ran)
    assert warm.full is None


# ------------------------------------------------------------------ concepts before use
NOT_TEACHING = ("Key terms", "Interview framing", "Sources", "Evaluation")


def _term_pattern(term: str) -> str:
    """A key term as it appears in prose: any case, plural allowed, not inside a longer word."""
    return r"(?<![\w-])" + re.escape(term) + r"(?:s|es)?(?![\w-])"


def untaught_terms(paths: list[Path]) -> list[str]:
    """Key terms (of any notebook of the course) that a core section's prose uses before the
    core path has taught them. A term is taught where a core section sets it in bold
    (``**term**``, the sentence that says what it is); a deep dive's teaching does not count:
    a learner on the core path skips it. A core "Key terms" section uses every term it lists."""
    strip = lambda t: re.sub(r"\s*\([^)]*\)$", "", t)        # "channel (NCCL)" -> "channel"
    ordered = sorted({strip(t) for path in paths for t in key_terms(path)}, key=len, reverse=True)
    taught, found = set(), []
    for path in paths:
        own = [strip(t) for t in key_terms(path)]
        for s in sections(path)[1:]:
            if s["route"] == "core" and s["title"].startswith("Key terms"):
                found += [f"{path.stem}: “{t}” in “Key terms”" for t in own
                          if t.lower() not in taught]
            if s["route"] != "core" or s["title"].startswith(NOT_TEACHING):
                continue
            text = "\n".join(s["md"][1:])
            for bold in re.findall(r"\*\*(.+?)\*\*", text):
                taught |= {t.lower() for t in ordered if re.search(_term_pattern(t), bold, re.I)}
            found += [f"{path.stem}: “{t}” in “{TAG.sub('', s['title']).strip()}”"
                      for t in ordered if t.lower() not in taught
                      and re.search(_term_pattern(t), text, re.I)]
    return found


def test_every_key_term_a_core_section_uses_is_taught_on_the_core_path():
    found = untaught_terms(SOLVED)
    assert not found, ("set the term in bold where a core section says what it is (or say it "
                       "there), before these uses:\n" + "\n".join(found))


def test_the_concept_rule_catches_a_term_taught_only_in_a_deep_dive(tmp_path):
    nb = nbformat.v4.new_notebook(cells=[
        nbformat.v4.new_markdown_cell("# 00\n## 1 · Split it [core · 1 min]\n"
                                      "Micro-batches fill the pipeline bubble."),
        nbformat.v4.new_markdown_cell("## 2 · Pipelines [deep dive · 1 min]\n"
                                      "The **bubble** is the time a stage waits."),
        nbformat.v4.new_markdown_cell("## 3 · Again [core · 1 min]\nThe **micro-batch** is a "
                                      "slice of the batch; it shrinks the bubble."),
        nbformat.v4.new_markdown_cell("## Key terms [deep dive · 1 min]\n- **bubble** — idle "
                                      "time.\n- **micro-batch** — a slice of the batch.")])
    path = tmp_path / "00_setup.ipynb"
    nbformat.write(nb, path)
    assert untaught_terms([path]) == ["00_setup: “micro-batch” in “1 · Split it”",
                                      "00_setup: “bubble” in “1 · Split it”",
                                      "00_setup: “bubble” in “3 · Again”"]
