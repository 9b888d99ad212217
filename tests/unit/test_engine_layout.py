"""Engine layout checks and option validation, without any process group (the family registry and
the mbridge fixes: ``test_engine_registry.py``).

Bad layouts raise the documented errors from the public build API before any process starts
(``check_layout`` / ``check_train_layout`` read only config.json)."""
import json

import pytest

from megarl.policy.build import ModelOptions, check_layout
from megarl.policy.model import check_train_layout
from megarl.policy.train import OptimOptions
from megarl.models.fixtures import ensure_fixture
from megarl.models.registry import get_family
from megarl.parallel import Topology, TopologyError


@pytest.fixture(scope="module")
def qwen2():
    return str(ensure_fixture("tiny-qwen2"))


@pytest.fixture(scope="module")
def moe():
    return str(ensure_fixture("tiny-qwen3_moe"))


@pytest.mark.parametrize("topo, text", [
    (Topology(world_size=3, tp=3), "topology.tp=3 is invalid: expected a divisor of num_attention_heads=8"),
    (Topology(world_size=2, ep=2), "topology.ep=2 is invalid: expected 1 for a dense model"),
    (Topology(world_size=4, pp=4), "topology.pp=4 is invalid: expected pp*vpp (= 4) dividing num_hidden_layers=2"),
    (Topology(world_size=2, pp=2, vpp=2), "topology.vpp=2 is invalid: expected pp*vpp (= 4) dividing"),
])
def test_bad_dense_layouts(qwen2, topo, text):
    with pytest.raises(TopologyError) as err:
        check_layout(qwen2, topo)
    assert text in str(err.value)


def test_uneven_pipeline_stages(qwen2):
    """The 2-layer fixture at pp=2 with explicit 1 + 1 stages passes; 2 + 1 names the field (the
    rules and megatron agreement: test_topology_uneven.py)."""
    check_layout(qwen2, Topology(world_size=2, pp=2, first_stage_layers=1, last_stage_layers=1))
    with pytest.raises(TopologyError, match=r"^topology.last_stage_layers=1 is invalid: expected num_hidden_layers - "
                                            r"first_stage_layers = 2 - 2 = 0 "):
        check_layout(qwen2, Topology(world_size=2, pp=2, first_stage_layers=2, last_stage_layers=1))


def test_bad_moe_layouts(moe):
    with pytest.raises(TopologyError, match="a divisor of the number of experts \\(8\\)"):
        check_layout(moe, Topology(world_size=3, ep=3))
    with pytest.raises(TopologyError, match="topology.sp=False is invalid: expected true for training a "
                                            "mixture-of-experts model with tp=2"):
        check_train_layout(moe, Topology(world_size=2, tp=2))
    check_layout(moe, Topology(world_size=2, tp=2))              # forward-only is fine
    check_train_layout(moe, Topology(world_size=2, tp=2, sp=True))


def test_topology_errors_before_process_groups():
    with pytest.raises(TopologyError, match="topology.world_size=3 is invalid: expected a multiple of tp\\*cp\\*pp"):
        Topology(world_size=3, tp=2)


def test_unknown_model_type(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "gpt2", "num_hidden_layers": 2}))
    with pytest.raises(ValueError, match="unsupported model_type 'gpt2'; supported model types: "
                                         "deepseek_v3, llama, qwen2, qwen3, qwen3_moe"):
        check_layout(str(tmp_path), Topology())
    with pytest.raises(ValueError, match="supported model types"):
        get_family("mistral")
    with pytest.raises(ValueError, match="has no config.json"):
        check_layout(str(tmp_path / "nowhere"), Topology())


def test_options_validation():
    with pytest.raises(ValueError, match="ModelOptions.dtype='float16'"):
        ModelOptions(path="x", dtype="float16")
    with pytest.raises(ValueError, match="OptimOptions.optimizer='lion'"):
        OptimOptions(optimizer="lion")


def test_lr_schedule():
    o = OptimOptions(lr=1.0, min_lr=0.1, warmup_steps=4, decay_steps=10, decay_style="cosine")
    assert [o.lr_at(s) for s in range(4)] == [0.25, 0.5, 0.75, 1.0]
    assert o.lr_at(14) == pytest.approx(0.1) and o.lr_at(100) == pytest.approx(0.1)
    assert OptimOptions(lr=2.0, min_lr=0.0, decay_steps=4, decay_style="linear").lr_at(2) == pytest.approx(1.0)
