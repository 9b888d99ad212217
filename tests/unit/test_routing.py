"""Routing replay's trainer side without processes: config rules, the samples' routing through
Rollout and micro-batches, which pass gets which routing, the routing metrics and moe.jsonl, and
router-only weight noise. (The engine side: tests/distributed/test_engine_train.py; vLLM's
capture: tests/e2e/test_vllm_parity.py; the loop: tests/e2e/test_router_replay_e2e.py and
tests/e2e/test_deepseek_e2e.py.)"""
import math
from types import SimpleNamespace

import numpy as np
import pytest
import torch
from helpers import read_jsonl

from megarl.config import ConfigError, load_config
from megarl.data.batch import Rollout, TokenVersions, micro_batches_for, scatter_sequences
from megarl.driver.routing_replay import StepRouting


def routed(rows: int, layers: int = 2, k: int = 2, fill: int = 1) -> np.ndarray:
    out = np.full((rows, layers, k), fill, dtype=np.int16)
    out[-1] = -1
    return out


def test_config_refuses_replay_and_routing_for_a_dense_model_and_reads_yaml_off():
    for override, key in (("algorithm.router_replay=r3", "algorithm.router_replay"),
                          ("algorithm.router_replay=r2", "algorithm.router_replay"),
                          ("rollout.return_routing=true", "rollout.return_routing")):
        with pytest.raises(ConfigError) as err:
            load_config(None, ["model.path=fixture:tiny-qwen2", override])
        assert f"config key '{key}'" in str(err.value) and "no MoE layer" in str(err.value)
    cfg = load_config(None, ["model.path=fixture:tiny-qwen3_moe", "algorithm.router_replay=r3"])
    assert cfg.algorithm.router_replay == "r3"
    # YAML 1.1 reads a bare `off` as false: still the choice 'off'
    assert load_config(None, ["model.path=fixture:tiny-qwen3_moe", "algorithm.router_replay=off"]
                       ).algorithm.router_replay == "off"
    with pytest.raises(ConfigError, match="rollout.weight_noise_match"):
        load_config(None, ["rollout.weight_noise_match=(unclosed"])


def test_rollout_carries_routing_through_selection_and_micro_batches():
    gens = [[{"token_ids": [5, 6], "logprobs": [-1.0, -1.0], "clipped": False, "routed_experts": routed(5, fill=3)},
             {"token_ids": [7], "logprobs": [-1.0], "clipped": False, "routed_experts": routed(4, fill=4)}]]
    r = Rollout.from_generations([[1, 2, 3]], ["a"], gens)
    assert [x.shape for x in r.routed_experts] == [(5, 2, 2), (4, 2, 2)]
    assert r.select([1]).routed_experts[0][0, 0, 0] == 4
    plan = SimpleNamespace(micro_batches={0: [[1, 0]]})
    (mb,) = micro_batches_for(r, plan, 0, {}, routing=r.routed_experts)
    assert [tuple(x.shape) for x in mb.routing] == [(4, 2, 2), (5, 2, 2)] and int(mb.routing[0][0, 0, 0]) == 4
    (plain,) = micro_batches_for(r, plan, 0, {})
    assert plain.routing is None
    assert [int(x[0, 0, 0]) for x in scatter_sequences(r, plan, {0: [[mb.routing[0], mb.routing[1]]]})] == [3, 4]
    bad = [[{"token_ids": [5, 6], "logprobs": [-1.0, -1.0], "clipped": False, "routed_experts": routed(4)}]]
    with pytest.raises(ValueError, match="routed_experts for 4 tokens, expected 5"):
        Rollout.from_generations([[1, 2, 3]], ["a"], bad)
    mixed = [[gens[0][0], {"token_ids": [7], "logprobs": [-1.0], "clipped": False}]]
    with pytest.raises(ValueError, match="expected all or none"):
        Rollout.from_generations([[1, 2, 3]], ["a"], mixed)


def test_stored_routing_handles_pass_through_the_controller_as_metadata():
    """The samples carry handles (megarl/data/store.py); the
    controller checks their row counts, plans and hands them to the ranks without the arrays
    (the ranks' fetch and the handles' lifetime: tests/e2e/test_fleet_controller.py)."""
    import pickle

    from megarl.data.store import Stored, stored_bytes
    from megarl.policy import SequenceBatch

    handle = lambda rows: Stored(None, (rows, 2, 2), "int16", rows * 8)   # noqa: E731
    gens = [[{"token_ids": [5, 6], "logprobs": [-1.0, -1.0], "clipped": False, "routed_experts": handle(5)},
             {"token_ids": [7], "logprobs": [-1.0], "clipped": False, "routed_experts": handle(4)}]]
    r = Rollout.from_generations([[1, 2, 3]], ["a"], gens)
    assert stored_bytes(r.routed_experts) == 72
    plan = SimpleNamespace(micro_batches={0: [[1, 0]]})
    (mb,) = micro_batches_for(r, plan, 0, {}, routing=r.routed_experts)
    assert mb.routing == [r.routed_experts[1], r.routed_experts[0]]   # the handles themselves
    assert repr(pickle.loads(pickle.dumps(mb.routing[0]))) == "Stored(int16[4, 2, 2], 32 B)"
    bad = [[{"token_ids": [5, 6], "logprobs": [-1.0, -1.0], "clipped": False, "routed_experts": handle(4)}]]
    with pytest.raises(ValueError, match="routed_experts for 4 tokens, expected 5"):
        Rollout.from_generations([[1, 2, 3]], ["a"], bad)
    with pytest.raises(ValueError, match=r"routing of shape \(4, 2, 2\); expected \[5, MoE layers, top-k\]"):
        SequenceBatch([torch.arange(5)], [3], routing=[handle(4)])
    # one data plane: the key of a second one is refused, named
    with pytest.raises(ConfigError, match="unknown config key 'trainer.data_plane'"):
        load_config(None, ["trainer.data_plane=controller"])


def test_each_pass_gets_the_routing_of_its_mode(tmp_path):
    r = Rollout.from_generations([[1, 2]], ["a"], [[{"token_ids": [5], "logprobs": [-1.0], "clipped": False,
                                                      "routed_experts": routed(3)}]])
    plain = Rollout.from_generations([[1, 2]], ["a"], [[{"token_ids": [5], "logprobs": [-1.0], "clipped": False}]])
    cfg = lambda mode: SimpleNamespace(algorithm=SimpleNamespace(router_replay=mode))   # noqa: E731
    off, r2, r3 = (StepRouting(cfg(m), tmp_path, 1) for m in ("off", "r2", "r3"))
    assert off.old_pass(plain) == {"record_routing": False} and off.reference_pass(r) == {}
    assert off.old_pass(r)["routing_action"] == "compare" and off.train_routing(r, {}) is None
    assert r2.old_pass(plain) == {"record_routing": True}
    assert r2.train_routing(plain, {"recorded": ["own"]}) == ["own"]
    assert r3.old_pass(r)["routing_action"] == "replay" and r3.reference_pass(r)["routing_action"] == "replay"
    assert r3.train_routing(r, {}) is r.routed_experts
    with pytest.raises(RuntimeError, match="router_replay='r3' but the samples carry no routed_experts"):
        r3.old_pass(plain)


def test_metrics_split_the_gap_by_agreement_and_moe_jsonl_survives_resume(tmp_path):
    r = Rollout.from_generations([[1]], ["a"], [[{"token_ids": [5, 6, 7], "logprobs": [-1.0, -1.0, -1.0],
                                                  "clipped": False, "routed_experts": routed(4)}]])
    routing = StepRouting(SimpleNamespace(algorithm=SimpleNamespace(router_replay="off")), tmp_path, 1)
    out = {"misses": [torch.tensor([0, 2, 0], dtype=torch.int16)],
           "report": {"routing_agree": 0.75, "routing_agree_per_layer": [1.0, 0.5]}}
    m = routing.metrics(r, [torch.tensor([-1.1, -1.5, -1.0])], out, None)
    assert m["routing/agree"] == 0.75 and m["routing/agree_layer1"] == 0.5
    assert m["routing/disagree_tokens"] == pytest.approx(1 / 3)
    assert m["routing/logprob_diff_agree_mean"] == pytest.approx(0.05)
    assert m["routing/logprob_diff_disagree_mean"] == pytest.approx(0.5)
    r.token_versions = [TokenVersions.of([0, 1, 1])]   # off-policy: only the trained version's tokens count
    m = routing.metrics(r, [torch.tensor([-1.1, -1.5, -1.0])], out, 1)
    assert m["routing/logprob_diff_agree_mean"] == pytest.approx(0.0) and m["routing/disagree_tokens"] == pytest.approx(1 / 3)
    assert math.isnan(routing.metrics(r, [torch.tensor([-1.1, -1.5, -1.0])],
                                      {"misses": [torch.zeros(3, dtype=torch.int16)], "report": out["report"]},
                                      None)["routing/logprob_diff_disagree_mean"])
    assert routing.metrics(r, [torch.zeros(3)], {"misses": None, "report": {}}, None) == {}
    for step in (1, 2, 3):
        routing.write(step, [[4, 0], [2, 2]], out)
    routing.write(4, None, out)   # a dense model writes nothing
    StepRouting(SimpleNamespace(algorithm=SimpleNamespace(router_replay="off")), tmp_path, 3)   # resumed at 3
    rows = read_jsonl(tmp_path / "moe.jsonl")
    assert [row["step"] for row in rows] == [1, 2] and rows[0]["routing_agree_per_layer"] == [1.0, 0.5]


def test_weight_noise_can_be_limited_to_the_routers():
    from megarl.rollout.worker_ext import with_noise

    named = [("model.layers.1.mlp.gate.weight", torch.ones(4, 4)), ("model.layers.1.mlp.experts.0.up_proj.weight",
                                                                     torch.ones(4, 4))]
    out = dict(with_noise(named, 0.1, 7, 1, match=r"mlp\.gate\.weight"))
    assert not torch.equal(out["model.layers.1.mlp.gate.weight"], torch.ones(4, 4))
    assert out["model.layers.1.mlp.experts.0.up_proj.weight"] is named[1][1]
    assert torch.equal(dict(with_noise(named, 0.1, 7, 1))["model.layers.1.mlp.gate.weight"],
                       out["model.layers.1.mlp.gate.weight"])


def test_streamed_routing_is_claimed_by_key_from_its_engine(monkeypatch):
    """Engines stream Pending keys, never object references (a reference nested in a Ray
    streaming-generator item can lose its count: megarl/data/store.py); the controller claims the
    handles of each message's samples with one ordinary call to the engine that made them."""
    import pickle

    import ray

    from megarl.data.store import Pending, RoutingLost, Stored, claim
    from megarl.rollout.fleet import samples_in

    monkeypatch.setattr(ray, "get", lambda x: x)   # the fake actor answers at once

    class Engine:
        def __init__(self):
            self.held, self.calls = {1: Stored("ref1", (5, 2, 2), "int16", 40), 2: Stored("ref2", (4, 2, 2), "int16", 32)}, []
            self.take_stored = SimpleNamespace(remote=self._take)

        def _take(self, keys):
            self.calls.append(list(keys))
            return [self.held.pop(k, None) for k in keys]

    a, b = Pending(1, (5, 2, 2), "int16", 40), Pending(2, (4, 2, 2), "int16", 32)
    assert "ref" not in repr(pickle.loads(pickle.dumps(a))) and pickle.loads(pickle.dumps(a)).key == 1
    plain = {"token_ids": [7]}
    by_prompt = {"done": [(0, [{"routed_experts": a}, plain])], "busy_s": 0.1}       # generate_stream
    by_request = {"done": [("r0", {"routed_experts": b})], "partial": [("r1", plain)]}   # generate_requests
    assert len(samples_in(by_prompt)) == 2 and len(samples_in(by_request)) == 2
    engine = Engine()
    claim(engine, samples_in(by_prompt) + samples_in(by_request))
    assert engine.calls == [[1, 2]]                         # one call for the message's keys
    assert by_prompt["done"][0][1][0]["routed_experts"].ref == "ref1"
    assert by_request["done"][0][1]["routed_experts"].ref == "ref2"
    claim(engine, [plain])
    assert engine.calls == [[1, 2]]                         # nothing pending: no call
    with pytest.raises(RoutingLost, match="no longer holds"):
        claim(engine, [{"routed_experts": Pending(1, (5, 2, 2), "int16", 40)}])   # claimed twice
