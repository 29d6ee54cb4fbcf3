"""pytest plugin for running the lab's notebooks (loaded by ``-p labkit.pytest_plugin``).

Under nbval, a solved notebook must not only run: every quiz and exercise check in it must pass.
``LABKIT_EXPECT_SOLVED=1`` makes a check that is not correct raise instead of printing, and the
kernel inherits it from this process when nbval starts it. So this plugin sets it for notebooks
under ``solutions/`` and clears it for everything else (student notebooks must run clean with
nothing answered).
"""
from __future__ import annotations

import os
from pathlib import Path

import pytest


@pytest.hookimpl(tryfirst=True)
def pytest_runtest_setup(item):
    path = Path(str(item.fspath))
    if path.suffix == ".ipynb" and path.parent.name == "solutions":
        os.environ["LABKIT_EXPECT_SOLVED"] = "1"
    else:
        os.environ.pop("LABKIT_EXPECT_SOLVED", None)
