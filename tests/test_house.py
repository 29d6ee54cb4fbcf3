"""The package's layout keeps its promises: no import circles, no lesson importing a later one,
and every name written as a string (bank keys and checkers, notebook handles, ``-m`` modules in
the README and notebooks, ``python -m labkit`` commands) resolves to real code."""
from __future__ import annotations

import ast
import importlib
import importlib.util
import re
from pathlib import Path

import nbformat
import pytest

import labkit as lk
from labkit import syllabus
from labkit.__main__ import BENCHMARKS, COMMANDS
from labkit.grading.bank import all_banks, resolve

ROOT = Path(__file__).resolve().parents[1]
PKG = ROOT / "labkit"
# The layers, bottom up (labkit.syllabus); a module may import its own layer and the ones below.
LAYERS = list(syllabus.LAYERS)
LESSONS = [les.package for les in syllabus.LESSONS if les.package]


def _modules() -> dict[str, Path]:
    out = {}
    for path in PKG.rglob("*.py"):
        rel = path.relative_to(ROOT).with_suffix("")
        name = ".".join(rel.parts)
        out[name.removesuffix(".__init__")] = path
    return out


def _imports(name: str, path: Path, modules: dict[str, Path]) -> set[str]:
    """labkit modules that ``name`` imports: statements, and importlib calls with a literal."""
    package = name if path.name == "__init__.py" else name.rsplit(".", 1)[0]
    found: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        targets: list[str] = []
        if isinstance(node, ast.Import):
            targets = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                parts = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join(parts + ([node.module] if node.module else []))
            targets = [f"{base}.{a.name}" for a in node.names] + [base]
        elif (isinstance(node, ast.Call) and getattr(node.func, "attr", getattr(node.func, "id", ""))
              in ("import_module", "__import__") and node.args
              and isinstance(node.args[0], ast.Constant) and isinstance(node.args[0].value, str)):
            targets = [node.args[0].value]
        for t in targets:
            while t and t not in modules:
                t = t.rpartition(".")[0]
            if t.startswith("labkit.") and t != name:
                found.add(t)
    return found


def _graph() -> dict[str, set[str]]:
    modules = _modules()
    return {name: _imports(name, path, modules) for name, path in modules.items()
            if name != "labkit" and not name.endswith("__main__")}


def test_no_import_circles():
    graph = _graph()
    done: set[str] = set()
    circles: list[list[str]] = []

    def visit(node: str, path: list[str]) -> None:
        for nxt in sorted(graph.get(node, ())):
            if nxt in path:
                circles.append(path[path.index(nxt):] + [nxt])
            elif nxt not in done:
                visit(nxt, path + [nxt])
        done.add(node)
    for node in sorted(graph):
        if node not in done:
            visit(node, [node])
    assert not circles, "import circles:\n" + "\n".join(" -> ".join(c) for c in circles)


def _layer(module: str) -> int | None:
    part = module.split(".")[1] if module.count(".") else ""
    return LAYERS.index(part) if part in LAYERS else None


def test_no_module_imports_a_later_lesson_or_a_higher_layer():
    bad = []
    for module, deps in _graph().items():
        mine = _layer(module)
        for dep in deps:
            theirs = _layer(dep)
            if mine is not None and theirs is not None and theirs > mine:
                bad.append(f"{module} imports {dep}")
            if dep == "labkit" or dep.endswith("__main__"):
                bad.append(f"{module} imports the package face {dep}")
    assert not bad, "\n".join(sorted(bad))


def test_every_labkit_module_is_in_a_layer():
    loose = [m for m in _modules() if m.count(".") == 1 and _layer(m) is None
             and m not in ("labkit.__main__",)]
    assert not loose, f"modules outside every layer (put them in a subpackage): {loose}"


def test_every_bank_key_and_checker_resolves():
    banks = all_banks()
    assert banks, "no question banks found"
    refs = [(q.id, field, getattr(q, field), q.source) for b in banks.values()
            for q in b.questions.values() for field in ("key", "checker") if getattr(q, field)]
    assert refs
    for qid, field, path, source in refs:
        assert callable(resolve(path, source)), f"{qid}: {field} {path!r} is not a function"


def _notebook_sources() -> list[tuple[Path, str]]:
    out = []
    for folder in ("solutions", "notebooks"):
        for path in sorted((ROOT / folder).glob("*.ipynb")):
            nb = nbformat.read(path, as_version=4)
            out.append((path, "\n".join(c.source for c in nb.cells)))
    return out


def test_every_handle_and_attribute_the_notebooks_use_exists():
    missing = []
    for path, source in _notebook_sources():
        for handle, attr in set(re.findall(r"\blk\.([a-z_]+)(?:\.([A-Za-z_]\w*))?", source)):
            try:
                obj = getattr(lk, handle)
                if attr and not attr.startswith("__") and not hasattr(obj, attr):
                    importlib.import_module(f"{obj.__name__}.{attr}")   # a submodule
            except (AttributeError, ImportError) as exc:
                missing.append(f"{path.name}: lk.{handle}{'.' + attr if attr else ''} ({exc})")
    assert not missing, "\n".join(sorted(set(missing)))


def _texts() -> list[tuple[str, str]]:
    texts = [("README.md", (ROOT / "README.md").read_text()),
             ("pyproject.toml", (ROOT / "pyproject.toml").read_text())]
    texts += [(p.name, s) for p, s in _notebook_sources()]
    texts += [(str(p.relative_to(ROOT)), p.read_text()) for p in PKG.rglob("*.py")]
    return texts


def test_every_module_named_in_commands_and_docs_exists():
    bad = []
    for where, text in _texts():
        for mod in set(re.findall(r"(?:-m|-p)\s+(labkit(?:\.\w+)+)", text)):
            if importlib.util.find_spec(mod) is None:
                bad.append(f"{where}: {mod}")
    assert not bad, "modules that do not exist:\n" + "\n".join(sorted(bad))



# Dotted names that are not references: notebook metadata keys and placeholders in messages.
NOT_REFERENCES = {"labkit.bank",                      # the notebook metadata key the grader reads
                  "labkit.module"}                    # 'labkit.module:function' in bank errors


def _resolves(name: str) -> bool:
    """``labkit.a.b.c``: the longest importable module prefix, then attributes for the rest."""
    parts = name.split(".")
    for i in range(len(parts), 0, -1):
        try:
            obj = importlib.import_module(".".join(parts[:i]))
        except ImportError:
            continue
        for attr in parts[i:]:
            if not hasattr(obj, attr):
                return False
            obj = getattr(obj, attr)
        return True
    return False


def test_every_dotted_labkit_name_in_docs_and_code_resolves():
    """A docstring, comment or README line naming ``labkit.x.y`` names something that exists
    (modules move; their old names stay behind in prose)."""
    texts = _texts() + [(str(p.relative_to(ROOT)), p.read_text())
                        for p in [*(ROOT / "notebooks").glob("*.md"), *PKG.rglob("*.md")]]
    bad = sorted({f"{where}: {name}" for where, text in texts
                  for name in re.findall(r"(?<![\w/.-])labkit(?:\.[A-Za-z_]\w*)+", text)
                  if name not in NOT_REFERENCES and not _resolves(name)})
    assert not bad, "dotted names that resolve to nothing:\n" + "\n".join(bad)

def test_every_python_m_labkit_command_is_a_command():
    bad = []
    for where, text in _texts():
        for cmd, sub in re.findall(r"-m labkit ([\w-]+|[\[{]\S*)(?: (\w+))?", text):
            if cmd.startswith(("[", "{", "COMMAND", "NAME")):
                continue
            if cmd not in COMMANDS:
                bad.append(f"{where}: python -m labkit {cmd}")
            elif cmd == "bench" and sub and sub not in BENCHMARKS and sub != "NAME":
                bad.append(f"{where}: python -m labkit bench {sub}")
    assert not bad, "\n".join(sorted(set(bad)))


@pytest.mark.parametrize("module", sorted({m for m, _ in COMMANDS.values() if m} |
                                          {m for m, _ in BENCHMARKS.values()}))
def test_every_command_module_has_a_main(module):
    assert callable(getattr(importlib.import_module(module), "main", None))


def test_every_test_file_named_in_docs_and_code_exists():
    """The docs and the notebooks cite the tests that back their claims: those paths must exist."""
    texts = _texts() + [(str(p.relative_to(ROOT)), p.read_text()) for p in
                        [*(ROOT / "tests").rglob("*.py"), *(ROOT / "tests").rglob("*.sh"),
                         *(ROOT / "notebooks").glob("*.md"), *PKG.rglob("*.md")]]
    bad = sorted({f"{where}: {path}" for where, text in texts
                  for path in re.findall(r"tests/[\w/]+\.py", text) if not (ROOT / path).exists()})
    assert not bad, "test files that do not exist:\n" + "\n".join(bad)



def test_every_lesson_of_the_syllabus_has_its_notebook_solution_and_bank_and_nothing_else():
    names = [les.notebook for les in syllabus.LESSONS]
    assert names == sorted(names) and len({les.number for les in syllabus.LESSONS}) == len(names)
    for folder, ext in (("notebooks", "ipynb"), ("solutions", "ipynb"), ("quizzes", "toml")):
        assert sorted(p.stem for p in (ROOT / folder).glob(f"*.{ext}")) == names, folder
    for les in syllabus.LESSONS:
        assert les.package is None or (PKG / les.package / "__init__.py").is_file(), les
        assert les.package is None or les.package in LAYERS


def test_each_lesson_grades_in_one_place_its_check_package():
    """A lesson's exercise checkers, quiz keys and what only they use (oracles, rank jobs,
    probes) live in its ``check/`` package; nothing checker-only sits beside the content."""
    for pkg in LESSONS:
        folder = PKG / pkg
        assert (folder / "check" / "__init__.py").is_file(), f"{pkg}: no check/ package"
        loose = [p.name for p in folder.glob("*.py")
                 if p.stem == "check" or p.stem.startswith("_check") or p.stem in ("oracle", "probes")]
        assert not loose, f"{pkg}: checker-only modules outside check/: {loose}"


def test_the_readme_maps_the_notebooks_in_the_syllabus_order():
    readme = (ROOT / "README.md").read_text()
    rows = re.findall(r"^\| \[(\d\d_\w+)\]\(notebooks/\1\.ipynb\)", readme, re.M)
    assert rows == [les.notebook for les in syllabus.LESSONS]


def test_the_face_hands_out_every_handle_of_the_syllabus():
    assert lk.HANDLES == syllabus.handles()
    for name, module in lk.HANDLES.items():
        assert importlib.util.find_spec(f"labkit.{module}") is not None, (name, module)
