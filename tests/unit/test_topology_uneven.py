"""Uneven pipeline stages (topology.first_stage_layers / last_stage_layers): the split rules, the
layers of each stage and the stage of each layer, checked against megatron-core's own functions
(``get_num_layers_to_build``, ``get_transformer_layer_offset``, on a TransformerConfig built without
process groups), the error texts, and the way through the config, the engine's TransformerConfig
overrides and the conversion CLI. Plan and engine: tests/unit/test_bridge_plan.py,
tests/distributed/test_engine_parity.py, tests/distributed/test_conversion.py."""
import argparse
import itertools

import pytest
import torch

from megarl.config import ConfigError, load_config
from megarl.parallel import Topology, TopologyError
from megarl.parallel.topology import propose_uneven_stages


def megatron_chunks(num_layers, pp, vpp, first, last):
    """{(pp rank, vp stage): global layers} as megatron-core builds them; raises what megatron raises."""
    from megatron.core.transformer import TransformerConfig
    from megatron.core.transformer.transformer_block import get_num_layers_to_build
    from megatron.core.transformer.transformer_layer import get_transformer_layer_offset

    config = TransformerConfig(num_layers=num_layers, hidden_size=8, num_attention_heads=2,
                               pipeline_model_parallel_size=pp, virtual_pipeline_model_parallel_size=vpp,
                               pipeline_dtype=torch.float32, num_layers_in_first_pipeline_stage=first,
                               num_layers_in_last_pipeline_stage=last)
    out = {}
    for rank, vp in itertools.product(range(pp), range(vpp or 1)):
        vp_stage = vp if vpp else None
        offset = get_transformer_layer_offset(config, vp_stage=vp_stage, pp_rank=rank)
        count = get_num_layers_to_build(config, vp_stage=vp_stage, pp_rank=rank)
        out[(rank, vp)] = list(range(offset, offset + count))
    return out


def megatron_split(num_layers, pp, vpp, first, last):
    """Layers per stage and the stage of every layer by megatron-core, or None when megatron refuses
    the layout or builds no real split (a chunk without layers, layers missing or built twice:
    megatron's config accepts a negative middle-layer count that its divisibility checks pass)."""
    try:
        chunks = megatron_chunks(num_layers, pp, vpp, first, last)
    except (ValueError, AssertionError, ZeroDivisionError):   # the last: pp=2, vpp, first and last set
        return None
    built = sorted(layer for layers in chunks.values() for layer in layers)
    if built != list(range(num_layers)) or any(len(layers) < 1 for layers in chunks.values()):
        return None
    per_stage = tuple(sum(len(chunks[(r, v)]) for v in range(vpp or 1)) for r in range(pp))
    stage_of = {layer: rank for (rank, _), layers in chunks.items() for layer in layers}
    return per_stage, [stage_of[i] for i in range(num_layers)]


CASES = [  # (num_layers, pp, vpp, first, last)
    (61, 16, None, 3, 2),       # DeepSeek-V3 at PP16: 3 + 14 x 4 + 2
    (61, 12, None, 6, None),    # 6 + 11 x 5
    (61, 16, None, None, 1),    # 15 x 4 + 1
    (3, 2, None, 1, None), (3, 2, None, None, 1), (3, 2, None, 2, 1),
    (10, 4, 2, 2, 4),           # chunks of 1, 1, 1, 2 layers
    (14, 4, 2, 2, None),        # middle stages (the last included) 4 layers: chunks of 2
    (8, 2, 2, None, None), (12, 4, None, None, None), (61, 1, None, None, None),   # even splits
    (16, 4, 4, 4, 4),           # uneven fields equal to the even split
]


@pytest.mark.parametrize("num_layers,pp,vpp,first,last", CASES)
def test_stage_layers_and_stage_of_layer_are_megatrons(num_layers, pp, vpp, first, last):
    topo = Topology(world_size=pp, pp=pp, vpp=vpp, first_stage_layers=first, last_stage_layers=last)
    per_stage, stage_of = megatron_split(num_layers, pp, vpp, first, last)
    assert topo.stage_layers(num_layers) == per_stage
    assert [topo.stage_of_layer(i, num_layers) for i in range(num_layers)] == stage_of


def test_known_splits():
    dsv3 = Topology(world_size=256, pp=16, ep=16, etp=1, first_stage_layers=3, last_stage_layers=2)
    assert dsv3.stage_layers(61) == (3,) + (4,) * 14 + (2,)
    assert [dsv3.stage_of_layer(i, 61) for i in (0, 2, 3, 6, 7, 58, 59, 60)] == [0, 0, 1, 1, 2, 14, 15, 15]
    # vpp 2: chunk v of every stage before chunk v + 1 of any stage
    topo = Topology(world_size=4, pp=4, vpp=2, first_stage_layers=2, last_stage_layers=4)
    assert topo.stage_layers(10) == (2, 2, 2, 4)
    assert [topo.stage_of_layer(i, 10) for i in range(10)] == [0, 1, 2, 3, 3, 0, 1, 2, 3, 3]


def test_rules_agree_with_megatron_on_a_grid():
    """Topology accepts a layout exactly when megatron-core builds a real split of it, and then
    says the same stages (layers 1..10, pp 2..4, vpp none / 2, first / last none or 1..4)."""
    checked = accepted = 0
    for num_layers, pp, vpp in itertools.product(range(1, 11), range(2, 5), (None, 2)):
        for first, last in itertools.product((None, 1, 2, 3, 4), repeat=2):
            try:
                topo = Topology(world_size=pp, pp=pp, vpp=vpp, first_stage_layers=first, last_stage_layers=last)
                ours = topo.stage_layers(num_layers), [topo.stage_of_layer(i, num_layers) for i in range(num_layers)]
            except TopologyError:
                ours = None
            assert ours == megatron_split(num_layers, pp, vpp, first, last), (num_layers, pp, vpp, first, last)
            checked, accepted = checked + 1, accepted + (ours is not None)
    assert (checked, accepted) == (1500, 287)


def test_proposed_pair_works_and_exists_only_when_a_pair_does():
    assert propose_uneven_stages(61, 16) == (3, 2)
    assert propose_uneven_stages(61, 12) == (6, 5)
    assert propose_uneven_stages(3, 2) == (2, 1)
    assert propose_uneven_stages(61, 16, 2) is None      # every count a multiple of 2: 61 is odd
    assert propose_uneven_stages(10, 4) == (2, 2)         # 2 + 3 + 3 + 2, not 1 + 4 + 4 + 1
    assert propose_uneven_stages(6, 2, 2) == (4, None)    # pp=2 with vpp: first alone (see the field errors)

    def valid(num_layers, pp, vpp, first, last):
        try:
            Topology(world_size=pp, pp=pp, vpp=vpp, first_stage_layers=first,
                     last_stage_layers=last).stage_layers(num_layers)
            return True
        except TopologyError:
            return False

    for num_layers, pp, vpp in itertools.product(range(1, 30), range(2, 6), (1, 2, 3)):
        pair = propose_uneven_stages(num_layers, pp, vpp)
        counts = (None, *range(1, num_layers + 1))
        exists = any(valid(num_layers, pp, vpp, first, last) for first, last in itertools.product(counts, repeat=2)
                     if (first, last) != (None, None))
        assert (pair is not None) == exists, (num_layers, pp, vpp)
        assert pair is None or valid(num_layers, pp, vpp, *pair), (num_layers, pp, vpp, pair)


@pytest.mark.parametrize("kw,num_layers,text", [
    (dict(world_size=16, pp=16), 61,
     "topology.pp=16 is invalid: expected pp*vpp (= 16) dividing num_hidden_layers=61; or let "
     "topology.first_stage_layers / last_stage_layers take the remainder, e.g. first_stage_layers=3, "
     "last_stage_layers=2 (3 + 14 x 4 + 2 = 61)"),
    (dict(world_size=2, pp=2), 3,
     "topology.pp=2 is invalid: expected pp*vpp (= 2) dividing num_hidden_layers=3; or let "
     "topology.first_stage_layers / last_stage_layers take the remainder, e.g. first_stage_layers=2, "
     "last_stage_layers=1 (2 + 1 = 3)"),
    (dict(world_size=16, pp=16, vpp=2), 61,
     "topology.vpp=2 is invalid: expected pp*vpp (= 32) dividing num_hidden_layers=61; no "
     "topology.first_stage_layers / last_stage_layers pair splits 61 layers over pp=16 either (every stage "
     "needs a positive multiple of vpp=2 layers)"),
    (dict(world_size=4, pp=4), 2,
     "topology.pp=4 is invalid: expected pp*vpp (= 4) dividing num_hidden_layers=2; no "
     "topology.first_stage_layers / last_stage_layers pair splits 2 layers over pp=4 either (every stage "
     "needs at least one layer)"),
    (dict(world_size=16, pp=16, first_stage_layers=3, last_stage_layers=3), 61,
     "topology.last_stage_layers=3 is invalid: expected a count leaving num_hidden_layers=61 - "
     "(first_stage_layers=3 + last_stage_layers=3) = 55 layers that split evenly over the 14 middle stage(s), "
     "at least 1 on each; or let topology.first_stage_layers / last_stage_layers take the remainder, e.g. "
     "first_stage_layers=3, last_stage_layers=2 (3 + 14 x 4 + 2 = 61)"),
    (dict(world_size=4, pp=4, vpp=2, first_stage_layers=2), 12,
     "topology.first_stage_layers=2 is invalid: expected a count leaving num_hidden_layers=12 - "
     "(first_stage_layers=2) = 10 layers that split evenly over the 3 middle stage(s), a positive multiple of "
     "vpp=2 on each; or let topology.first_stage_layers / last_stage_layers take the remainder, e.g. "
     "first_stage_layers=2, last_stage_layers=2 (2 + 2 x 4 + 2 = 12)"),
    (dict(world_size=2, pp=2, first_stage_layers=2, last_stage_layers=2), 3,
     "topology.last_stage_layers=2 is invalid: expected num_hidden_layers - first_stage_layers = 3 - 2 = 1 "
     "(with pp=2 the first and last stages hold every layer); or let topology.first_stage_layers / "
     "last_stage_layers take the remainder, e.g. first_stage_layers=2, last_stage_layers=1 (2 + 1 = 3)"),
])
def test_split_errors_name_the_field_and_propose_a_pair(kw, num_layers, text):
    topo = Topology(**kw)
    with pytest.raises(TopologyError) as err:
        topo.stage_layers(num_layers)
    assert str(err.value) == text
    with pytest.raises(TopologyError):
        topo.stage_of_layer(0, num_layers)


@pytest.mark.parametrize("kw,text", [
    (dict(world_size=2, pp=2, first_stage_layers=0), "topology.first_stage_layers=0 is invalid: expected null or "
                                                     "an integer >= 1"),
    (dict(world_size=2, pp=2, last_stage_layers=True), "topology.last_stage_layers=True is invalid: expected null "
                                                       "or an integer >= 1"),
    (dict(first_stage_layers=1), "topology.first_stage_layers=1 is invalid: expected null when pp == 1 (uneven "
                                 "pipeline stages need pp > 1)"),
    (dict(world_size=2, pp=2, vpp=2, last_stage_layers=3), "topology.last_stage_layers=3 is invalid: expected a "
                                                          "multiple of vpp=2 (each of the stage's 2 virtual chunks "
                                                          "holds the same number of layers)"),
    (dict(world_size=2, pp=2, vpp=2, first_stage_layers=4, last_stage_layers=2),
     "topology.last_stage_layers=2 is invalid: expected null when pp == 2 with vpp > 1 and first_stage_layers set "
     "(megatron-core's layer offset needs a middle stage there; first_stage_layers alone gives the same split)"),
])
def test_field_errors_before_any_model(kw, text):
    with pytest.raises(TopologyError) as err:
        Topology(**kw)
    assert str(err.value) == text


def test_stage_of_layer_outside_the_model():
    with pytest.raises(ValueError, match="layer 3 is outside the model's num_hidden_layers=3"):
        Topology(world_size=2, pp=2, first_stage_layers=1).stage_of_layer(3, 3)


def test_config_keys_reach_the_topology_and_are_checked_against_the_model():
    base = ["model.path=fixture:tiny-llama", "topology.world_size=2", "topology.pp=2"]
    topo = load_config(None, base + ["topology.first_stage_layers=1", "topology.last_stage_layers=1"]) \
        .topology.to_topology()
    assert (topo.first_stage_layers, topo.last_stage_layers, topo.stage_layers(2)) == (1, 1, (1, 1))
    with pytest.raises(ConfigError) as err:
        load_config(None, base + ["topology.first_stage_layers=2"])
    assert str(err.value) == (
        "invalid value for config key 'topology.first_stage_layers': got 2, expected a count leaving "
        "num_hidden_layers=2 - (first_stage_layers=2) = 0 layers that split evenly over the 1 middle stage(s), "
        "at least 1 on each; or let topology.first_stage_layers / last_stage_layers take the remainder, e.g. "
        "first_stage_layers=1, last_stage_layers=1 (1 + 1 = 2) (model fixture:tiny-llama)")
    with pytest.raises(ConfigError) as err:
        load_config(None, ["topology.last_stage_layers=1"])
    assert str(err.value) == ("invalid value for config key 'topology.last_stage_layers': got 1, expected null "
                              "when pp == 1 (uneven pipeline stages need pp > 1)")


def test_engine_passes_uneven_stages_to_megatron_only_when_set():
    from megarl.policy.build import ModelOptions, _config_overrides

    options = ModelOptions(path="fixture:tiny-llama")
    uneven = _config_overrides(options, Topology(world_size=16, pp=16, first_stage_layers=3, last_stage_layers=2))
    assert (uneven["num_layers_in_first_pipeline_stage"], uneven["num_layers_in_last_pipeline_stage"]) == (3, 2)
    only_last = _config_overrides(options, Topology(world_size=2, pp=2, last_stage_layers=1))
    assert only_last["num_layers_in_last_pipeline_stage"] == 1 and "num_layers_in_first_pipeline_stage" not in only_last
    even = _config_overrides(options, Topology(world_size=2, pp=2))
    assert not {"num_layers_in_first_pipeline_stage", "num_layers_in_last_pipeline_stage"} & set(even)


def test_conversion_cli_flags(monkeypatch):
    from megarl.conversion.cli import _layout_args, _topology

    parser = argparse.ArgumentParser()
    _layout_args(parser)
    monkeypatch.setenv("WORLD_SIZE", "256")
    topo = _topology(parser.parse_args(["--pp", "16", "--ep", "16", "--etp", "1", "--first-stage-layers", "3",
                                        "--last-stage-layers", "2"]))
    assert topo == Topology(world_size=256, pp=16, ep=16, etp=1, first_stage_layers=3, last_stage_layers=2)
    assert _topology(parser.parse_args(["--pp", "16"])).uneven is False
