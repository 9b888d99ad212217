"""Multi-turn agent rollouts with tools (``rollout.agent: tools``).

- :mod:`megarl.agent.parse`: tool calls in the model's own chat-template format, and the token ids
  of the tool results to insert after a model turn (no decode/re-encode of sampled tokens).
- :mod:`megarl.agent.tools`: the tool registry, the built-in tools (calculator, sandboxed python,
  local-corpus search) and a bounded pool that runs calls concurrently.
- :mod:`megarl.agent.loop`: the loop on the rollout fleet: turns of different trajectories
  interleave on the engines; trajectories are the exact sampled ids plus inserted tool-result ids,
  with a mask that gives loss to sampled tokens only.
"""
