"""The two projects a learner takes away, as plain folders: ``python -m labkit export``.

    python -m labkit export train DEST      # notebook 05's script: DDP, snapshots, resume
    python -m labkit export capstone DEST   # notebook 08's GPT: DDP or FSDP2, DCP checkpoints

Inside the lab the projects are modules of the package (``labkit/torchrun/train.py``;
``labkit/capstone/`` less its lab-side ``runs.py`` and ``check/``) that import the three small
plain-Python files of :mod:`labkit.portable` (:data:`SUPPORT`). ``export`` writes the project's
files and those three side by side into ``DEST``, their package imports made plain (``from
..portable.elastic import record`` becomes ``from elastic import record``) and the commands in
their help named as the folder runs them (``python train.py``), so the folder runs on its own
with torch alone: ``torchrun --nproc-per-node=2 DEST/train.py`` (``tests/common/test_projects.py``
trains both exports, one process each, with no ``labkit`` module imported).
"""
from __future__ import annotations

import argparse
import re
import sys
from pathlib import Path

__all__ = ["PROJECTS", "SUPPORT", "export", "main"]

_PKG = Path(__file__).resolve().parents[1]
# What every project imports from the lab: labkit/portable/, plain Python (tested).
SUPPORT = tuple(f"portable/{p.name}" for p in sorted((_PKG / "portable").glob("*.py"))
                if p.name != "__init__.py")
PROJECTS = {
    "train": ("notebook 05's training script: one process or DDP under torchrun, snapshots, "
              "bit-identical resume", ("torchrun/train.py",)),
    "capstone": ("notebook 08's small GPT: DDP or FSDP2 under torchrun, DCP checkpoints, "
                 "distributed evaluation",
                 ("capstone/train_gpt.py", "capstone/model.py", "capstone/data.py",
                  "capstone/evaluate.py", "capstone/sharded_checkpoint.py")),
}
_RELATIVE = re.compile(r"^(\s*)from \.+(?:[\w]+\.)*(\w+) import ", re.M)
# The lab's own way to name a script, and how the learner's folder names it.
# ("python -m labkit.torchrun.train" becomes "python train.py", torchrun's "-m ..." its file.)
_COMMANDS = (("-m labkit.torchrun.train", "train.py"),
             ("labkit/torchrun/train.py", "train.py"),
             ("-m labkit.capstone.train_gpt", "train_gpt.py"),
             ("labkit/capstone/train_gpt.py", "train_gpt.py"))


def export(project: str, dest: str | Path) -> list[Path]:
    """Write ``project``'s files and :data:`SUPPORT` into ``dest``; return the files written.

    Refuses a project it does not know, and a destination that already holds one of the files
    (nothing is overwritten).
    """
    if project not in PROJECTS:
        raise ValueError(f"no project {project!r}: choose one of {', '.join(PROJECTS)}")
    dest = Path(dest)
    files = [*PROJECTS[project][1], *SUPPORT]
    taken = [dest / Path(f).name for f in files if (dest / Path(f).name).exists()]
    if taken:
        raise FileExistsError(f"{dest} already holds {', '.join(p.name for p in taken)}: "
                              f"export into an empty folder (nothing was written)")
    dest.mkdir(parents=True, exist_ok=True)
    written = []
    for rel in files:
        text = _RELATIVE.sub(r"\1from \2 import ", (_PKG / rel).read_text())
        for lab, own in _COMMANDS:
            text = text.replace(lab, own)
        out = dest / Path(rel).name
        out.write_text(text)
        written.append(out)
    return written


def main(argv: list[str] | None = None) -> int:
    """``python -m labkit export PROJECT DEST``."""
    parser = argparse.ArgumentParser(
        prog="python -m labkit export",
        description="Write a project of the lab, with the three small files it needs, into a "
                    "folder of its own that runs with torch alone.",
        epilog="\n".join(f"  {name:<9} {what}" for name, (what, _) in PROJECTS.items()),
        formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("project", choices=list(PROJECTS))
    parser.add_argument("dest", type=Path, help="a new or empty folder")
    args = parser.parse_args(argv)
    try:
        written = export(args.project, args.dest)
    except (ValueError, FileExistsError, OSError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
    script = written[0].name
    print(f"wrote {len(written)} files into {args.dest}: {', '.join(p.name for p in written)}\n"
          f"run:  torchrun --standalone --nproc-per-node=2 {args.dest / script}   "
          f"(or: python {args.dest / script})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
