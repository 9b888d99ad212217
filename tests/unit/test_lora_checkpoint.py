"""A LoRA checkpoint's layout file (megarl.actors.roles.ShardCheckpoint): it loads only into a
policy with the same adapters at the same TP size, and a full checkpoint only without adapters;
every refusal names the config key and both values."""
from types import SimpleNamespace

import pytest

from megarl.actors.roles import LORA_FILE, ShardCheckpoint
from megarl.checkpoint_files import CheckpointError
from megarl.policy.lora import LoraOptions, lora_layout


def shard(rank: int = 0, tp: int = 1, targets=("linear_qkv", "linear_proj")) -> ShardCheckpoint:
    adapters = [SimpleNamespace(options=LoraOptions(rank=rank, alpha=16.0, targets=tuple(targets)))] if rank else []
    policy = SimpleNamespace(model=SimpleNamespace(adapters=adapters))
    return ShardCheckpoint(SimpleNamespace(rank=0, topology=SimpleNamespace(tp=tp)), policy)


def saved(tmp_path, rank=8, tp=2, targets=("linear_qkv", "linear_proj")):
    (tmp_path / LORA_FILE).write_text(__import__("json").dumps(lora_layout(
        LoraOptions(rank=rank, alpha=16.0, targets=tuple(targets)), tp)))
    return str(tmp_path)


def test_the_same_layout_loads(tmp_path):
    shard(8, 2)._check_lora(saved(tmp_path))
    shard()._check_lora(str(tmp_path / "full"))   # no layout file, no adapters: a full checkpoint


def test_other_tp_rank_or_targets_are_refused_naming_the_key(tmp_path):
    folder = saved(tmp_path)
    with pytest.raises(CheckpointError, match=r"topology.tp=1 \(saved: 2\)"):
        shard(8, 1)._check_lora(folder)
    with pytest.raises(CheckpointError, match=r"model.lora.rank=4 \(saved: 8\)"):
        shard(4, 2)._check_lora(folder)
    with pytest.raises(CheckpointError, match=r"model.lora.targets=\['linear_qkv'\]"):
        shard(8, 2, ["linear_qkv"])._check_lora(folder)


def test_full_and_lora_checkpoints_do_not_mix(tmp_path):
    with pytest.raises(CheckpointError, match="holds LoRA adapters but this run trains full weights"):
        shard()._check_lora(saved(tmp_path))
    with pytest.raises(CheckpointError, match="holds full weights but this run trains LoRA adapters"):
        shard(8, 2)._check_lora(str(tmp_path / "nowhere"))
