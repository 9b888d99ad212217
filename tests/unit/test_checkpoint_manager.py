"""Atomic, verified checkpoint folders: a writer killed mid-save or a failed write leaves the
previous checkpoint loadable; damaged checkpoints are detected, named and skipped on resume."""
import errno
import json
import logging
import os
import re
import signal
import subprocess
import sys
import textwrap
import zlib

import pytest

from megarl.driver.checkpoint import (MANIFEST, MARKER, CheckpointError, CheckpointManager, describe_error,
                                       hash_files)


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
        from megarl.driver.checkpoint import CheckpointManager
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


def test_a_save_into_a_disk_that_fills_up_names_the_disk(tmp_path):
    """A 3 MiB tmpfs: step 1's 1 MiB checkpoint fits, step 2's 4 MiB one fills the disk mid-save
    (torch's writer: "unexpected pos ..."). The error says the disk is full, with its free space,
    what the save had written and the last checkpoint's size; step 1's checkpoint still verifies."""
    import torch

    disk = tmp_path / "disk"
    disk.mkdir()
    mount = ["mount", "-t", "tmpfs", "-o", "size=3m", "tmpfs", str(disk)]
    if subprocess.run(mount if os.getuid() == 0 else ["sudo", "-n", *mount], capture_output=True).returncode:
        pytest.skip("cannot mount a small tmpfs here (needs root or passwordless sudo)")
    try:
        mgr = CheckpointManager(disk / "checkpoints")
        mgr.save(1, lambda folder: torch.save({"w": torch.zeros(2**18)}, folder / "shard.pt"))
        with pytest.raises(CheckpointError) as failed:
            mgr.save(2, lambda folder: torch.save({"w": torch.zeros(2**20)}, folder / "shard.pt"))
        message = str(failed.value)
        assert re.search(r"saving the checkpoint of step 2 into .*\.partial-step_00000002-\d+ failed: the disk is "
                         r"full: .*checkpoints has \d+(\.\d)? (B|KiB) free; the save had written \d\.\d MiB, the last "
                         r"complete checkpoint \(step_00000001\) takes 1\.0 MiB; free space or set checkpoint.dir",
                         message), message
        step, folder = mgr.latest()
        assert step == 1 and mgr.verify(folder) == []
    finally:
        umount = ["umount", "-l", str(disk)]   # lazy: torch may still hold the failed file open
        subprocess.run(umount if os.getuid() == 0 else ["sudo", "-n", *umount], check=True)


def test_folder_without_marker_is_ignored(tmp_path):
    (tmp_path / "step_00000009").mkdir()
    assert CheckpointManager(tmp_path).latest() is None


def test_keep_last_must_be_positive(tmp_path):
    with pytest.raises(ValueError, match=r"checkpoint.keep_last=0: expected an integer >= 1"):
        CheckpointManager(tmp_path, keep_last=0)


# -- integrity: manifest, verify, newest intact, failed saves, the CLI ---------------------------
def write_shards(folder):
    (folder / "__0_0.distcp").write_bytes(bytes(range(256)) * 40)
    (folder / ".metadata").write_bytes(b"meta" * 10)
    (folder / "sub").mkdir()
    (folder / "sub" / "rng_rank00000.pt").write_bytes(b"r" * 77)


def saved(tmp_path, steps=(1, 2), keep_last=3):
    mgr = CheckpointManager(tmp_path, keep_last=keep_last)
    for step in steps:
        mgr.save(step, write_shards, {"kl_coef": 0.1})
    return mgr


def test_manifest_lists_every_file_with_size_and_crc32(tmp_path):
    mgr = saved(tmp_path, steps=(3,))
    folder = tmp_path / "step_00000003"
    manifest = json.loads((folder / MANIFEST).read_text())
    assert manifest["checksum"] == "crc32"
    assert sorted(manifest["files"]) == [".metadata", "__0_0.distcp", "sub/rng_rank00000.pt"]
    data = (folder / "__0_0.distcp").read_bytes()
    assert manifest["files"]["__0_0.distcp"] == {"size": len(data), "crc32": f"{zlib.crc32(data):08x}"}
    assert mgr.verify(folder) == [] and mgr.metadata(folder)["step"] == 3


def truncate(path):
    path.write_bytes(path.read_bytes()[: path.stat().st_size // 2])


def flip_one_byte(path):
    data = bytearray(path.read_bytes())
    data[100] ^= 0x01
    path.write_bytes(bytes(data))


@pytest.mark.parametrize("damage, expected", [
    (truncate, r"__0_0.distcp: 5120 bytes, the manifest says 10240 \(truncated\)"),
    (os.remove, r"__0_0.distcp: missing"),
    (flip_one_byte, r"__0_0.distcp: checksum \w{8}, the manifest says \w{8} \(the content changed\)"),
])
def test_verify_names_the_damaged_file(tmp_path, damage, expected):
    mgr = saved(tmp_path, steps=(1,))
    folder = tmp_path / "step_00000001"
    damage(folder / "__0_0.distcp")
    problem, = mgr.verify(folder)
    assert re.fullmatch(expected, problem)
    if damage is flip_one_byte:           # same size: only the checksum sees it
        assert mgr.verify(folder, checksums=False) == []


def test_verify_reports_marker_and_manifest_problems(tmp_path):
    mgr = saved(tmp_path, steps=(1, 2))
    (tmp_path / "step_00000001" / MARKER).unlink()
    (tmp_path / "step_00000002" / MANIFEST).write_text("{not json")
    assert mgr.verify(tmp_path / "step_00000001") == [
        "COMPLETE: missing (the save did not finish, or the marker was deleted)"]
    problem, = mgr.verify(tmp_path / "step_00000002")
    assert problem.startswith("MANIFEST.json: unreadable (JSONDecodeError:")
    os.replace(tmp_path / "step_00000002", tmp_path / "step_00000007")
    assert mgr.verify(tmp_path / "step_00000007")[0] == "COMPLETE: says step 2, the folder name says 7"


def test_resume_skips_a_damaged_newest_checkpoint_with_a_warning(tmp_path, caplog):
    mgr = saved(tmp_path, steps=(1, 2))
    truncate(tmp_path / "step_00000002" / "__0_0.distcp")
    loaded = []
    with caplog.at_level(logging.WARNING, logger="megarl"):
        assert mgr.newest_intact(loaded.append) == (1, tmp_path / "step_00000001")
    assert loaded == [tmp_path / "step_00000001"]
    warning, = [r.getMessage() for r in caplog.records if r.name == "megarl"]
    assert f"skipping damaged checkpoint {tmp_path / 'step_00000002'}" in warning
    assert "__0_0.distcp: 5120 bytes, the manifest says 10240 (truncated)" in warning


def test_resume_falls_back_when_loading_raises(tmp_path, caplog):
    """Damage the manifest cannot see (a worker's EOFError) also falls back to the older one."""
    mgr = saved(tmp_path, steps=(1, 2))
    newest = tmp_path / "step_00000002"

    def load(folder):
        if folder == newest:
            raise EOFError("Ran out of input")

    with caplog.at_level(logging.WARNING, logger="megarl"):
        assert mgr.newest_intact(load)[0] == 1
    assert f"{newest}: loading failed: EOFError: Ran out of input" in caplog.text.replace(
        "skipping damaged checkpoint ", "")


def test_none_intact_names_every_folder_and_problem(tmp_path):
    mgr = saved(tmp_path, steps=(1, 2))
    (tmp_path / "step_00000001" / "sub" / "rng_rank00000.pt").unlink()
    flip_one_byte(tmp_path / "step_00000002" / "__0_0.distcp")
    with pytest.raises(CheckpointError) as err:
        mgr.newest_intact()
    lines = str(err.value).splitlines()
    assert lines[0] == f"no intact checkpoint in {tmp_path} (2 found, newest first):"
    assert lines[1].startswith(f"  {tmp_path / 'step_00000002'}: __0_0.distcp: checksum ")
    assert lines[2] == f"  {tmp_path / 'step_00000001'}: sub/rng_rank00000.pt: missing"


def test_no_checkpoint_resumes_from_scratch(tmp_path):
    assert CheckpointManager(tmp_path / "absent").newest_intact(lambda folder: 1 / 0) is None


def test_checkpoint_without_manifest_is_used_unverified(tmp_path, caplog):
    """Written by an older megarl: its marker proves the save finished; accepted with a warning."""
    mgr = saved(tmp_path, steps=(4,))
    (tmp_path / "step_00000004" / MANIFEST).unlink()
    assert mgr.verify(tmp_path / "step_00000004") == []
    with caplog.at_level(logging.WARNING, logger="megarl"):
        assert mgr.newest_intact()[0] == 4
    assert f"checkpoint {tmp_path / 'step_00000004'} has no MANIFEST.json" in caplog.text
    assert "unverified" in caplog.text


def test_failed_write_keeps_the_previous_checkpoint(tmp_path):
    mgr = saved(tmp_path, steps=(1,))

    def disk_full(folder):
        (folder / "__0_0.distcp").write_bytes(b"x" * 10)
        raise OSError(errno.ENOSPC, "No space left on device", str(folder / "__0_0.distcp"))

    with pytest.raises(CheckpointError) as err:
        mgr.save(2, disk_full)
    partial = tmp_path / f".partial-step_00000002-{os.getpid()}"
    assert str(err.value) == (
        f"saving the checkpoint of step 2 into {partial} failed: OSError: [Errno 28] No space left on device: "
        f"'{partial / '__0_0.distcp'}'; the newest complete checkpoint is still {tmp_path / 'step_00000001'} "
        "(the partial folder is removed at the next start)")
    assert isinstance(err.value.__cause__, OSError)
    assert mgr.newest_intact() == (1, tmp_path / "step_00000001") and mgr.verify(tmp_path / "step_00000001") == []
    mgr.clean_partials()
    assert [p.name for p in tmp_path.iterdir()] == ["step_00000001"]


def test_failed_first_write_says_there_is_no_checkpoint(tmp_path):
    def too_large(folder):
        raise OSError(errno.EFBIG, "File too large")

    with pytest.raises(CheckpointError, match=r"step 5 .* OSError: \[Errno 27\] File too large; there is no "
                                              r"complete checkpoint in .* yet"):
        CheckpointManager(tmp_path).save(5, too_large)


def test_workers_hash_disjoint_slices_into_one_manifest(tmp_path):
    """The WorkerGroup hasher: rank r hashes files[r::world]; the manifest is their union."""
    slices = []

    def two_workers(folder, relpaths, sync):
        slices.extend(relpaths[r::2] for r in range(2))
        return {rel: entry for r in range(2) for rel, entry in hash_files(folder, relpaths[r::2], sync).items()}

    mgr = CheckpointManager(tmp_path)
    folder = mgr.save(1, write_shards, hasher=two_workers, tag="run")
    assert slices == [[".metadata", "sub/rng_rank00000.pt"], ["__0_0.distcp"]]
    assert mgr.verify(folder, hasher=two_workers) == []
    with pytest.raises(CheckpointError, match=r"step 2 .* the hasher returned no checksum for 3 files"):
        mgr.save(2, write_shards, hasher=lambda folder, relpaths, sync: {})


def test_prune_keeps_the_new_checkpoint_when_a_newer_one_is_damaged(tmp_path):
    """Resumed from step 4 because step 6 is damaged: saving step 5 with keep_last=1 must keep
    step 5 (not count the damaged step 6 as the one to keep)."""
    mgr = saved(tmp_path, steps=(4, 6), keep_last=2)
    truncate(tmp_path / "step_00000006" / "__0_0.distcp")
    mgr = CheckpointManager(tmp_path, keep_last=1)
    mgr.save(5, write_shards)
    assert [s for s, _ in mgr.complete()] == [5, 6]
    assert mgr.newest_intact() == (5, tmp_path / "step_00000005")


def test_prune_does_not_count_damaged_checkpoints(tmp_path):
    mgr = saved(tmp_path, steps=(1, 2), keep_last=2)
    (tmp_path / "step_00000002" / ".metadata").unlink()
    mgr.save(3, write_shards)                 # intact: 3 and 1 (2 is damaged and does not count)
    assert [s for s, _ in mgr.complete()] == [1, 2, 3]
    mgr.save(4, write_shards)
    assert [s for s, _ in mgr.complete()] == [3, 4]


def test_describe_error_unwraps_ray_and_dcp_errors():
    class RayTaskError(Exception):
        def __init__(self, cause):
            super().__init__("Traceback (most recent call last):\n  ...\nlong remote traceback")
            self.cause = cause

    class CheckpointException(BaseException):
        failures = {1: (OSError(errno.ENOSPC, "No space left on device", "/c/__1_0.distcp"), None)}

    assert describe_error(RayTaskError(EOFError("Ran out of input"))) == "EOFError: Ran out of input"
    assert describe_error(RayTaskError(CheckpointException())) == \
        "OSError: [Errno 28] No space left on device: '/c/__1_0.distcp' (rank 1)"


def run_cli(*args):
    code = ("import sys; from megarl.cli import main; rc = main(sys.argv[1:]); "
            "assert 'torch' not in sys.modules, 'megarl checkpoint imported torch'; sys.exit(rc)")
    return subprocess.run([sys.executable, "-c", code, "checkpoint", "verify", *map(str, args)],
                          capture_output=True, text=True, timeout=60)


def test_cli_checkpoint_verify_exit_codes(tmp_path):
    root = tmp_path / "run" / "checkpoints"
    saved(root, steps=(1, 2))
    ok = run_cli(root)
    assert ok.returncode == 0, ok.stderr
    lines = ok.stdout.splitlines()
    assert len(lines) == 2 and lines[0].startswith(f"{root / 'step_00000001'}  ok  3 files, 0.0 MB, checked in ")
    assert run_cli(tmp_path / "run").returncode == 0                       # a run dir: its checkpoints/
    truncate(root / "step_00000002" / "__0_0.distcp")
    bad = run_cli(root)
    assert bad.returncode == 1, bad.stderr
    assert bad.stdout.splitlines()[1] == (f"{root / 'step_00000002'}  DAMAGED  __0_0.distcp: 5120 bytes, "
                                          "the manifest says 10240 (truncated)")
    assert run_cli(root / "step_00000001").returncode == 0               # one checkpoint folder
    assert run_cli(root / "step_00000002").returncode == 1
    empty = run_cli(tmp_path / "empty")
    assert empty.returncode == 2 and "no checkpoint in" in empty.stderr
