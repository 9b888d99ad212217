"""The bridge's public surface for vLLM workers: destination buffers and their manifests
(megarl.bridge.buffer), the RPC names both sides use (megarl.bridge.rpc), the transport registry."""
import inspect
import os
import typing

import pytest
import torch

from megarl.bridge import rpc
from megarl.bridge.buffer import DestBuffer, buffer_layout, open_manifest
from megarl.bridge.transport import TRANSPORTS, get_transport
from megarl.config.schema import BridgeConfig
from megarl.rollout.worker_ext import BridgeWorkerExtension

SHAPES = {"model.norm.weight": (5,), "model.layers.0.mlp.experts.*.up_proj.weight": (3, 2, 4)}


@pytest.mark.parametrize("name", rpc.RPC_METHODS)
def test_worker_extension_defines_every_rpc_method(name):
    assert callable(getattr(BridgeWorkerExtension, name, None)), f"BridgeWorkerExtension lacks rpc {name}"


def test_bridge_calls_workers_only_through_the_rpc_names():
    from megarl.bridge import sync

    source = inspect.getsource(sync)
    assert "collective_rpc(rpc." in source and 'collective_rpc("' not in source


def test_layout_is_aligned_and_sized():
    layout, nbytes = buffer_layout(SHAPES, torch.float32)
    assert layout == {"model.norm.weight": (0, (5,)), "model.layers.0.mlp.experts.*.up_proj.weight": (64, (3, 2, 4))}
    assert nbytes == 64 + 128 and buffer_layout({}, torch.float32)[1] == 64


def test_shm_buffer_written_by_two_ranks_read_through_its_manifest():
    import msgspec

    name = f"megarl-test-{os.getpid()}"
    buf = DestBuffer.create(name, SHAPES, torch.float32)
    other = DestBuffer.open(name, SHAPES, torch.float32)       # another rank of the host
    buf.view("model.norm.weight").copy_(torch.arange(5.0))
    experts = torch.arange(24.0).view(3, 2, 4)
    other.view("model.layers.0.mlp.experts.*.up_proj.weight")[1:].copy_(experts[1:])
    buf.view("model.layers.0.mlp.experts.*.up_proj.weight")[0].copy_(experts[0])
    other.close()
    manifest = buf.manifest()
    manifest = msgspec.msgpack.decode(msgspec.msgpack.encode(manifest))   # vLLM's RPC hop
    got = dict(open_manifest(manifest))
    assert list(got) == ["model.norm.weight"] + [f"model.layers.0.mlp.experts.{e}.up_proj.weight" for e in range(3)]
    assert torch.equal(got["model.norm.weight"], torch.arange(5.0))
    for e in range(3):
        assert torch.equal(got[f"model.layers.0.mlp.experts.{e}.up_proj.weight"], experts[e])
    buf.view("model.norm.weight")[0] = 7.0                    # the reader maps the same memory
    assert got["model.norm.weight"][0] == 7.0
    assert os.path.exists(manifest["path"])
    buf.close()
    assert not os.path.exists(manifest["path"])


def test_unknown_storage_names_the_known_ones():
    with pytest.raises(ValueError, match="storage='disk'; known: shm, cuda"):
        DestBuffer.create("x", SHAPES, torch.float32, storage="disk")


def test_transport_registry_and_formats_match_the_config_choices():
    from megarl.bridge.transfers import FORMATS

    hints = typing.get_type_hints(BridgeConfig)
    assert set(typing.get_args(hints["transport"])) == set(TRANSPORTS)
    assert set(typing.get_args(hints["format"])) == set(FORMATS)
    assert get_transport("cuda_ipc").storage == "cuda" and get_transport("shm").storage == "shm"
    assert {n for n, t in TRANSPORTS.items() if getattr(t, "device", "cpu") == "cuda"} == {"nccl", "cuda_ipc"}
    with pytest.raises(ValueError, match="unknown transport 'tcp'; known: shm, gloo, nccl, cuda_ipc"):
        get_transport("tcp")


def test_sweep_removes_only_the_buffers_of_gone_processes(tmp_path):
    import subprocess
    import sys

    from megarl.bridge.buffer import shm_name, sweep_stale_buffers

    child = subprocess.Popen([sys.executable, "-c", "pass"])
    child.wait()   # reaped: its pid names no process (until reused, which only keeps a file)
    gone = tmp_path / shm_name(child.pid, "abc-v3-b0-d1")
    gone.write_bytes(b"\0" * 1000)
    live = tmp_path / shm_name(os.getpid(), "abc-v3-b0-d0")
    live.write_bytes(b"\0" * 10)
    other = tmp_path / "megarl-ws-0123abc-v1-b0-d0"   # no creator pid in the name: not ours to judge
    other.write_bytes(b"\0")
    assert gone.name == f"megarl-ws-p{child.pid}-abc-v3-b0-d1"
    assert sweep_stale_buffers(str(tmp_path)) == (1, 1000)
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted([live.name, other.name])
    assert sweep_stale_buffers(str(tmp_path)) == (0, 0)
    assert sweep_stale_buffers(str(tmp_path / "missing")) == (0, 0)
