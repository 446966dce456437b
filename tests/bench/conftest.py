"""Shared by the `s4kv bench` tests: a stand-in engine module that bench starts instead of vLLM's."""

import os

import pytest

from s4kv.runtime.bench import runner as bench


@pytest.fixture
def stand_in(tmp_path, monkeypatch):
    """Install an engine module under tmp_path and make bench start it instead of vLLM."""
    def install(source: str, name: str) -> None:
        (tmp_path / f"{name}.py").write_text(source)
        monkeypatch.setattr(bench, "ENGINE_MODULE", name)
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join([str(tmp_path), os.environ.get("PYTHONPATH", "")]))
    return install
