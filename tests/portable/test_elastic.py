"""labkit.portable.elastic: the lab's @record writes its error file whole (the agent's side of the
race is the claim test in tests/claims/test_claims_torchrun.py)."""
from __future__ import annotations

import os

import pytest


def test_the_labs_record_leaves_a_whole_error_file_or_none(tmp_path, monkeypatch):
    """labkit.portable.elastic.record: the file appears only by the rename, whole."""
    import json

    from labkit.portable import elastic

    target = tmp_path / "error.json"
    monkeypatch.setenv("TORCHELASTIC_ERROR_FILE", str(target))
    renamed = []
    real_replace = os.replace

    def replace(src, dst):
        assert not target.exists() and json.loads(open(src).read())["message"]   # whole, elsewhere
        renamed.append(dst)
        real_replace(src, dst)

    monkeypatch.setattr(elastic.os, "replace", replace)

    @elastic.record
    def fails():
        raise ValueError("a corrupt batch")

    with pytest.raises(ValueError):
        fails()
    assert renamed == [str(target)] and list(tmp_path.iterdir()) == [target]
    assert "ValueError: a corrupt batch" in json.loads(target.read_text())["message"]["message"]
