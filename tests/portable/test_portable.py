"""labkit/portable/: what the learner's projects take with them imports nothing of the lab."""
from __future__ import annotations

import ast
import sys
from pathlib import Path

import labkit.portable

FOLDER = Path(labkit.portable.__file__).parent


def test_the_portable_files_import_only_torch_and_the_standard_library():
    files = sorted(FOLDER.glob("*.py"))
    assert [p.name for p in files] == ["__init__.py", "checkpoints.py", "elastic.py", "ending.py"]
    for path in files:
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom):
                assert node.level == 0, f"{path.name}: a relative import"
                names = [node.module or ""]
            elif isinstance(node, ast.Import):
                names = [a.name for a in node.names]
            else:
                continue
            for name in names:
                top = name.split(".")[0]
                assert top in ("torch", "__future__") or top in sys.stdlib_module_names, \
                    f"{path.name} imports {name}"
