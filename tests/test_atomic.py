"""``nemo_granular.atomic``: a write either replaces its target whole or leaves it as it was, with no temporary
file left behind either way."""

from __future__ import annotations

import os

import pytest

from nemo_granular import atomic


def test_write_text_replaces_the_target_and_leaves_no_temporary(tmp_path):
    target = tmp_path / "report.md"
    target.write_text("old\n")
    assert atomic.write_text(target, "new\n", fsync=True) == target
    assert target.read_text() == "new\n"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["report.md"]


def test_a_failed_write_keeps_the_target_and_removes_its_temporary(tmp_path):
    target = tmp_path / "evals.json"
    target.write_text('{"kept": true}')
    seen = []

    def half_then_fail(tmp):
        tmp.write_text('{"half')
        seen.append(tmp)
        raise OSError("disk full")

    with pytest.raises(OSError, match="disk full"):
        atomic.write_with(target, half_then_fail)
    assert target.read_text() == '{"kept": true}'
    assert seen and not seen[0].exists() and sorted(p.name for p in tmp_path.iterdir()) == ["evals.json"]


def test_the_temporary_sits_beside_the_target_keeps_its_extension_and_names_the_process(tmp_path):
    tmp = atomic.temporary_name(tmp_path / "clip_fraction.png")
    assert tmp.parent == tmp_path and tmp.suffix == ".png" and tmp.name.startswith(".clip_fraction.tmp-")
    assert tmp.name.endswith(f"-{os.getpid()}.png")
