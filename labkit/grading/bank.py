"""Question banks: one TOML file per notebook in ``quizzes/``, read with the standard library.

The format is documented in :mod:`labkit.grading.quiz`; this module parses and
validates it, so a typo in a bank fails loudly (file, question, field, fix)
when the bank is loaded instead of silently marking every learner wrong.
Nothing here runs learner code.
"""
from __future__ import annotations

import importlib
import importlib.util
import os
import re
import tomllib
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

from ..runtime.errors import LabkitError

__all__ = ["BankError", "Question", "Bank", "bank_dir", "load_bank", "all_banks", "find",
           "resolve", "KINDS"]

KINDS = ("single", "multi", "numeric", "short", "exercise")
_ID = re.compile(r"^(\d\d)\.[A-Za-z_][A-Za-z0-9_]*$")
_FIELDS = {"id", "kind", "prompt", "points", "variable", "explanation", "hint", "choices",
           "answer", "tolerance", "rel_tolerance", "key", "inputs", "checker", "partial"}


class BankError(LabkitError):
    """A question bank is missing, unreadable or malformed (names the file, question and fix)."""


@dataclass(frozen=True)
class Question:
    """One question of a bank. ``answer`` is ``None`` when a ``key`` computes it."""

    id: str
    kind: str
    prompt: str
    variable: str
    points: float = 1.0
    explanation: str = ""
    hint: str = ""
    choices: tuple[str, ...] = ()
    answer: Any = None
    tolerance: float = 0.0
    rel_tolerance: float = 0.0
    key: str | None = None
    inputs: tuple[str, ...] = ()
    checker: str | None = None
    partial: bool = False
    bank: str = ""            # e.g. "03_ring_allreduce"
    source: str = ""          # the bank file, for error messages

    @property
    def letters(self) -> str:
        """The labels of the choices: ``"abcd"`` for four choices."""
        return "abcdefghijklmnopqrstuvwxyz"[:len(self.choices)]

    @property
    def runs_submission_code(self) -> bool:
        """Scoring it runs the submission's own objects: an exercise's function under its
        checker, or a key on the notebook's inputs (the grader does that in a sandbox)."""
        return self.kind == "exercise" or self.key is not None


@dataclass
class Bank:
    name: str                 # file stem, e.g. "03_ring_allreduce"
    path: Path
    questions: dict[str, Question] = field(default_factory=dict)

    @property
    def prefix(self) -> str:
        return self.name[:2]

    @property
    def names(self) -> list[str]:
        """Every notebook variable the grader reads for this bank (answers, functions, inputs)."""
        seen: dict[str, None] = {}
        for q in self.questions.values():
            seen[q.variable] = None
            for name in q.inputs:
                seen[name] = None
        return list(seen)

    @property
    def pickled(self) -> set[str]:
        """The variables that cannot cross as plain data: exercise functions and key inputs."""
        return {n for q in self.questions.values()
                for n in ([q.variable] if q.kind == "exercise" else []) + list(q.inputs)}

    @property
    def max_points(self) -> float:
        return sum(q.points for q in self.questions.values())


def bank_dir() -> Path:
    """Where banks live: ``$LABKIT_QUIZ_DIR``, else ``quizzes/`` next to the labkit package."""
    env = os.environ.get("LABKIT_QUIZ_DIR")
    return Path(env) if env else Path(__file__).resolve().parents[2] / "quizzes"


_cache: dict[Path, tuple[int, Bank]] = {}


def load_bank(path: str | os.PathLike) -> Bank:
    """Parse and validate one bank file (cached until the file changes)."""
    path = Path(path).resolve()
    try:
        mtime = path.stat().st_mtime_ns
    except OSError as exc:
        raise BankError(f"question bank {path} cannot be read: {exc}.") from None
    hit = _cache.get(path)
    if hit and hit[0] == mtime:
        return hit[1]
    try:
        data = tomllib.loads(path.read_text(encoding="utf-8"))
    except (tomllib.TOMLDecodeError, UnicodeDecodeError) as exc:
        raise BankError(f"question bank {path} is not valid TOML: {exc}. "
                        f"Each question is a [[question]] table.") from None
    bank = Bank(path.stem, path)
    if not re.match(r"^\d\d_", bank.name):
        raise BankError(f"question bank {path}: the file name must start with the notebook "
                        f"number, like 03_ring_allreduce.toml.")
    extra = set(data) - {"question"}
    if extra:
        raise BankError(f"question bank {path}: unknown top-level key(s) {sorted(extra)}; "
                        f"a bank holds only [[question]] tables.")
    variables: dict[str, str] = {}
    for i, raw in enumerate(data.get("question", [])):
        q = _question(raw, bank, i)
        if q.id in bank.questions:
            raise BankError(f"question bank {path}: id {q.id!r} appears twice.")
        other = variables.get(q.variable)
        if other is not None and not (q.kind == bank.questions[other].kind == "exercise"):
            raise BankError(f"question bank {path}: {q.id} and {other} both use "
                            f"variable {q.variable!r}; give each question its own variable "
                            f"(only exercises may share one: rubric items graded on the same "
                            f"function, like notebook 08's).")
        variables[q.variable] = q.id
        bank.questions[q.id] = q
    _cache[path] = (mtime, bank)
    return bank


def all_banks(directory: str | os.PathLike | None = None) -> dict[str, Bank]:
    """Every bank in ``directory`` (default :func:`bank_dir`), by name."""
    directory = Path(directory) if directory is not None else bank_dir()
    if not directory.is_dir():
        raise BankError(f"no question banks: {directory} is not a folder. Run from the lab's "
                        f"repository or set LABKIT_QUIZ_DIR to the folder holding the .toml banks.")
    return {p.stem: load_bank(p) for p in sorted(directory.glob("*.toml"))}


def find(qid: str, directory: str | os.PathLike | None = None) -> Question:
    """The question ``qid`` ("03.ring_steps"), from the bank whose name starts with "03_"."""
    if not isinstance(qid, str) or not _ID.match(qid):
        raise BankError(f"{qid!r} is not a question id: ids look like '03.ring_steps' "
                        f"(notebook number, a dot, a name).")
    banks = [b for b in all_banks(directory).values() if b.prefix == qid[:2]]
    for bank in banks:
        if qid in bank.questions:
            return bank.questions[qid]
    where = ", ".join(str(b.path.name) for b in banks) or f"no {qid[:2]}_*.toml bank"
    raise BankError(f"no question {qid!r} in {where} (in {directory or bank_dir()}). Check the "
                    f"spelling, or add it to the bank.")


def resolve(path: str, bank_file: str = "") -> Callable:
    """Import the function named by ``"package.module:function"`` or ``"file.py:function"``.

    A ``.py`` path is relative to the bank's folder, so a private bank can ship its own keys.
    """
    module_name, _, attr = path.partition(":")
    if module_name.endswith(".py"):
        file = Path(bank_file).parent / module_name
        spec = importlib.util.spec_from_file_location(f"_labkit_bank_{file.stem}", file)
        if spec is None or not file.is_file():
            raise BankError(f"{path!r} (from {bank_file}): {file} does not exist.")
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
    else:
        module = importlib.import_module(module_name)
    fn = getattr(module, attr, None)
    if not callable(fn):
        raise BankError(f"{path!r} (from {bank_file}): {module_name} has no function {attr!r}.")
    return fn


# ------------------------------------------------------------- validation
def _question(raw: Any, bank: Bank, index: int) -> Question:
    where = f"question bank {bank.path}, question #{index + 1}"
    if not isinstance(raw, dict):
        raise BankError(f"{where}: each question must be a [[question]] table.")
    qid = raw.get("id")
    if not isinstance(qid, str) or not _ID.match(qid):
        raise BankError(f"{where}: id must look like '{bank.prefix}.ring_steps', got {qid!r}.")
    where = f"question bank {bank.path}, question {qid}"

    def bad(msg: str) -> BankError:
        return BankError(f"{where}: {msg}")

    if qid[:2] != bank.prefix:
        raise bad(f"the id must start with this bank's number '{bank.prefix}.'.")
    unknown = set(raw) - _FIELDS
    if unknown:
        raise bad(f"unknown field(s) {sorted(unknown)}; allowed: {sorted(_FIELDS)}.")
    kind = raw.get("kind")
    if kind not in KINDS:
        raise bad(f"kind must be one of {', '.join(KINDS)}, got {kind!r}.")
    for name in ("prompt", "variable"):
        if not isinstance(raw.get(name), str) or not raw[name].strip():
            raise bad(f"{name} is required (a non-empty string).")
    if not raw["variable"].isidentifier():
        raise bad(f"variable {raw['variable']!r} is not a Python name.")
    points = raw.get("points", 1)
    if isinstance(points, bool) or not isinstance(points, (int, float)) or points <= 0:
        raise bad(f"points must be a positive number, got {points!r}.")
    choices = raw.get("choices", [])
    if not isinstance(choices, list) or not all(isinstance(c, str) for c in choices):
        raise bad("choices must be a list of strings.")
    inputs = raw.get("inputs", [])
    if not isinstance(inputs, list) or not all(isinstance(n, str) and n.isidentifier()
                                               for n in inputs):
        raise bad("inputs must be a list of notebook variable names.")
    for name in ("tolerance", "rel_tolerance"):
        v = raw.get(name, 0.0)
        if isinstance(v, bool) or not isinstance(v, (int, float)) or v < 0:
            raise bad(f"{name} must be a number >= 0, got {v!r}.")
    for name in ("key", "checker"):
        v = raw.get(name)
        if v is not None and (not isinstance(v, str) or v.count(":") != 1):
            raise bad(f"{name} must name a function as 'labkit.module:function', got {v!r}.")
    if not isinstance(raw.get("partial", False), bool):
        raise bad("partial must be true or false.")
    _check_kind(raw, kind, choices, bad)
    return Question(
        id=qid, kind=kind, prompt=raw["prompt"].strip(), variable=raw["variable"],
        points=float(points), explanation=str(raw.get("explanation", "")).strip(),
        hint=str(raw.get("hint", "")).strip(), choices=tuple(choices), answer=raw.get("answer"),
        tolerance=float(raw.get("tolerance", 0.0)),
        rel_tolerance=float(raw.get("rel_tolerance", 0.0)), key=raw.get("key"),
        inputs=tuple(inputs), checker=raw.get("checker"),
        partial=raw.get("partial", kind == "exercise"), bank=bank.name, source=str(bank.path))


def _check_kind(raw: dict, kind: str, choices: list, bad) -> None:
    answer, key = raw.get("answer"), raw.get("key")
    if kind == "exercise":
        if not raw.get("checker"):
            raise bad("an exercise needs checker = 'labkit.module:check_function'.")
        if answer is not None or key is not None:
            raise bad("an exercise is scored by its checker: remove answer/key.")
        return
    if raw.get("checker"):
        raise bad("only kind = 'exercise' takes a checker.")
    if (answer is None) == (key is None):
        raise bad("give exactly one of answer (fixed) or key (computed from notebook inputs).")
    if raw.get("inputs") and key is None:
        raise bad("inputs are passed to a key function: add key = 'module:function'.")
    if kind in ("single", "multi"):
        if len(choices) < 2 or len(set(choices)) != len(choices) or len(choices) > 26:
            raise bad("give 2 to 26 distinct choices.")
        if answer is not None:
            given = [answer] if kind == "single" else answer
            if kind == "multi" and (not isinstance(answer, list) or not answer):
                raise bad("a multi-choice answer is a non-empty list of choice texts.")
            missing = [a for a in given if a not in choices]
            if missing:
                raise bad(f"answer {missing[0]!r} is not one of the choices (copy the text "
                          f"exactly).")
    elif choices:
        raise bad(f"kind {kind!r} takes no choices.")
    if kind == "numeric" and answer is not None and (
            isinstance(answer, bool) or not isinstance(answer, (int, float))):
        raise bad(f"a numeric answer must be a number, got {answer!r}.")
    if kind == "short" and answer is not None and not (
            isinstance(answer, str) or (isinstance(answer, list) and answer
                                        and all(isinstance(a, str) for a in answer))):
        raise bad("a short answer is a string or a list of accepted strings.")
