"""Checkpoint loads execute no code (issue: loads that cannot execute code).

A checkpoint folder is whatever ``--resume`` or ``checkpoint.dir`` points at. Each test plants a
pickle whose ``__reduce__`` would create a marker file when unpickled, loads it the way megarl
does, and asserts the named error and that the marker was never created:

- the RNG file (``rng_rankNNNNN.pt``): :func:`megarl.checkpoint_files.load_plain`;
- torch DCP's ``.metadata`` and a DCP byte item, through megatron_fixes M2; a real megatron
  checkpoint's metadata (written by megatron's dist_checkpointing here) still loads, and its
  types are exactly the allowlisted ones;
- the worker's mapping of a refusal wrapped by DCP into :class:`UnsafeCheckpointError`, which
  resume does not fall back from.
"""
import io
import os
import pickle
from pathlib import Path

import pytest
import torch

from megarl.compat import megatron_fixes
from megarl.compat.megatron_fixes import UnsafePickleError, find_unsafe, restricted_load
from megarl.checkpoint_files import UnsafeCheckpointError, load_plain
from megarl.driver.checkpoint import CheckpointManager


class _Planted:
    """Unpickling this runs ``os.system('touch MARKER')``."""

    def __init__(self, marker: Path):
        self.marker = marker

    def __reduce__(self):
        return os.system, (f"touch {self.marker}",)


@pytest.fixture
def marker(tmp_path):
    path = tmp_path / "code-ran"
    yield path
    assert not path.exists(), "the planted pickle ran code"


def test_rng_file_with_code_is_refused(tmp_path, marker):
    good = tmp_path / "rng_rank00000.pt"
    state = {"torch": torch.get_rng_state(), "tracker": {"model-parallel-rng": torch.get_rng_state()},
             "engine_step": 3, "critic_step": 0}
    torch.save(state, good)
    loaded = load_plain(good)
    assert torch.equal(loaded["torch"], state["torch"]) and loaded["engine_step"] == 3
    bad = tmp_path / "rng_rank00001.pt"
    torch.save({**state, "engine_step": _Planted(marker)}, bad)
    with pytest.raises(UnsafeCheckpointError, match=r"rng_rank00001.pt: refused to load: .*GLOBAL posix.system"):
        load_plain(bad)


def test_dcp_metadata_and_byte_items_with_code_are_refused(tmp_path, marker):
    megatron_fixes.apply()
    from torch.distributed.checkpoint import FileSystemReader
    from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner

    (tmp_path / ".metadata").write_bytes(pickle.dumps(_Planted(marker)))
    with pytest.raises(UnsafePickleError, match=r"unsafe GLOBAL posix.system"):
        FileSystemReader(str(tmp_path)).read_metadata()
    # a byte item (e.g. TE's _extra_state): weights_only
    planner = DefaultLoadPlanner()
    planner.flatten_state_dict, planner.state_dict = False, {}
    item = type("ReadItem", (), {"dest_index": type("Index", (), {"fqn": "layer._extra_state"})()})()
    buf = io.BytesIO()
    torch.save(_Planted(marker), buf)
    buf.seek(0)
    with pytest.raises(UnsafePickleError, match=r"byte item layer._extra_state"):
        planner.load_bytes(item, buf)
    buf = io.BytesIO()
    torch.save({"scale": torch.ones(2)}, buf)
    buf.seek(0)
    planner.load_bytes(item, buf)
    assert torch.equal(planner.state_dict["layer._extra_state"]["scale"], torch.ones(2))


def test_real_dcp_metadata_loads_through_the_allowlist(tmp_path):
    """A distributed checkpoint as megatron writes it (torch_dist: DCP), one process under gloo."""
    import torch.distributed as dist
    from megatron.core import dist_checkpointing
    from megatron.core.dist_checkpointing import ShardedTensor

    from megarl.compat import setup_cpu

    setup_cpu()   # megatron's dist_checkpointing on the CPU (P-patches)
    megatron_fixes.apply()
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", "29531")
    dist.init_process_group("gloo", rank=0, world_size=1)
    try:
        weight = torch.arange(12, dtype=torch.bfloat16).reshape(3, 4)
        state = {"w": ShardedTensor.from_rank_offsets("w", weight, replica_id=0),
                 "step": torch.tensor(7, dtype=torch.int64)}
        dist_checkpointing.save(state, str(tmp_path))
        seen = set()

        class Recorder(pickle.Unpickler):
            def find_class(self, module, name):
                seen.add(module.rsplit(".", 1)[-1] if module.startswith("torch.distributed") else f"{module}.{name}")
                return super().find_class(module, name)

        with open(tmp_path / ".metadata", "rb") as f:
            Recorder(f).load()
        with open(tmp_path / ".metadata", "rb") as f:
            restricted_load(f)   # the same file through M2's allowlist
        assert seen <= {"metadata", "planner", "filesystem", "torch.Size", "torch.bfloat16", "torch.int64",
                        "torch.float32", "torch.serialization._get_layout"}, seen
        out = dist_checkpointing.load({"w": ShardedTensor.from_rank_offsets("w", torch.zeros(3, 4, dtype=torch.bfloat16),
                                                                          replica_id=0),
                                       "step": torch.tensor(0)}, str(tmp_path))
        assert torch.equal(out["w"], weight) and int(out["step"]) == 7
    finally:
        dist.destroy_process_group()


def test_refusal_is_found_through_dcp_wrapping_and_stops_resume(tmp_path):
    from torch.distributed.checkpoint.api import CheckpointException

    inner = UnsafePickleError("unsafe GLOBAL posix.system")
    wrapped = CheckpointException("read_metadata", {0: (inner, None)})
    outer = RuntimeError("megatron load failed")
    outer.__cause__ = wrapped
    assert find_unsafe(outer) is inner and find_unsafe(RuntimeError("other")) is None
    # resume: a refused load is not damage to fall back from (an older intact checkpoint exists)
    manager = CheckpointManager(tmp_path)
    for step in (1, 2):
        folder = manager.partial_dir(step)
        (folder / "data.bin").write_bytes(b"x" * step)
        manager.commit(step, folder)
    calls = []

    def load(folder):
        calls.append(folder.name)
        raise UnsafeCheckpointError(f"{folder}: refused to load the distributed checkpoint: {inner}")

    with pytest.raises(UnsafeCheckpointError, match=r"step_00000002: refused"):
        manager.newest_intact(load)
    assert calls == ["step_00000002"]


def test_optimizer_classes_load_by_name_and_code_is_still_refused(tmp_path, marker):
    """trainer.optimizer_offload: HybridDeviceOptimizer's parameter groups name its host and device
    optimizer classes, so its checkpoint state (common.pt, byte items) holds torch.optim.AdamW:
    allowed by name, while a pickle that runs code beside it is still refused."""
    from megarl.compat.megatron_fixes import load_weights_only, optimizer_classes

    groups = {"param_groups": [{"lr": 1e-3, "cpu_optimizer_cls": torch.optim.AdamW,
                                "gpu_optimizer_cls": torch.optim.Adam}]}
    good = tmp_path / "common.pt"
    torch.save(groups, good)
    assert load_weights_only(good, "common.pt") == groups
    with pytest.raises(pickle.UnpicklingError):   # the same file through plain weights_only torch.load
        torch.load(good, weights_only=True)
    with torch.serialization.safe_globals(optimizer_classes()):   # as the worker reads common.pt
        assert torch.load(good, weights_only=True) == groups
    bad = tmp_path / "bad.pt"
    torch.save({**groups, "x": _Planted(marker)}, bad)
    with pytest.raises(UnsafePickleError, match="GLOBAL posix.system"):
        load_weights_only(bad, "bad.pt")
