"""Atomic checkpoint folders: a writer killed mid-save leaves the previous checkpoint loadable."""
import json
import os
import signal
import subprocess
import sys
import textwrap

import pytest

from megarl.trainer.checkpoint import CheckpointManager


def write_state(value):
    def write(folder):
        (folder / "state.json").write_text(json.dumps({"value": value}))
    return write


def test_latest_and_keep_last(tmp_path):
    mgr = CheckpointManager(tmp_path, keep_last=2)
    assert mgr.latest() is None
    for step in (1, 2, 3):
        mgr.save(step, write_state(step * 10), {"note": f"s{step}"})
    assert [s for s, _ in mgr.complete()] == [2, 3]
    step, folder = mgr.latest()
    assert step == 3 and json.loads((folder / "state.json").read_text()) == {"value": 30}
    assert mgr.metadata(folder)["note"] == "s3"


def test_resave_same_step_replaces_it(tmp_path):
    mgr = CheckpointManager(tmp_path, keep_last=3)
    mgr.save(5, write_state(1))
    mgr.save(5, write_state(2))
    (step, folder), = mgr.complete()
    assert step == 5 and json.loads((folder / "state.json").read_text()) == {"value": 2}
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".")]


def test_writer_killed_mid_save_leaves_previous_checkpoint(tmp_path):
    mgr = CheckpointManager(tmp_path, keep_last=2)
    mgr.save(1, write_state(10))
    code = textwrap.dedent(f"""
        import os, signal
        from megarl.trainer.checkpoint import CheckpointManager
        mgr = CheckpointManager({str(tmp_path)!r}, keep_last=1)
        def write(folder):
            (folder / "shard0.bin").write_bytes(b"x" * 1000)
            os.kill(os.getpid(), signal.SIGKILL)          # dies half-way through its files
        mgr.save(2, write)
    """)
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True)
    assert proc.returncode == -signal.SIGKILL
    step, folder = mgr.latest()
    assert step == 1 and json.loads((folder / "state.json").read_text()) == {"value": 10}
    assert any(p.name.startswith(".partial-step_00000002") for p in tmp_path.iterdir())
    mgr.clean_partials()
    assert [p.name for p in tmp_path.iterdir()] == ["step_00000001"]


def test_folder_without_marker_is_ignored(tmp_path):
    (tmp_path / "step_00000009").mkdir()
    assert CheckpointManager(tmp_path).latest() is None


def test_keep_last_must_be_positive(tmp_path):
    with pytest.raises(ValueError, match=r"checkpoint.keep_last=0: expected an integer >= 1"):
        CheckpointManager(tmp_path, keep_last=0)
