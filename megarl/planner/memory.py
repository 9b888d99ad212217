"""Memory per device and per node of a recipe: the arithmetic, pure (no torch), unit-tested.

This module owns the byte counts the planner adds up: one rank's training state
(:func:`train_state`: parameters, fp32 main grads, distributed-optimizer state), the activations a
pipeline stage keeps for the backward (:func:`layer_activation_elements`, :func:`activation_bytes`,
:func:`in_flight_micro_batches`), a vLLM engine's weights and KV cache per GPU
(:func:`vllm_weight_bytes`, :func:`kv_bytes_per_token`), and the bytes one step moves between the
engines, the controller and the training ranks (:func:`data_plane_bytes`).

Choices: each count follows what megatron-core and vLLM allocate under megarl's settings (fp32
main grads, the distributed optimizer always on, flash attention, the 1F1B or interleaved
schedule), in closed form from the model's dimensions and the parallel sizes; what is not
modelled is named where it is left out (e.g. vLLM's profiling workspace).
"""
from __future__ import annotations

from dataclasses import dataclass

GIB = 1 << 30
DTYPE_BYTES = {"float32": 4, "bfloat16": 2}
LOGIT_BYTES_PER_ELEMENT = 10
"""bf16 logits (2) + fp32 log-softmax (4) + fp32 gradient (4)."""


@dataclass(frozen=True)
class TrainState:
    """Bytes of one rank's training state (device or host, depending on the phase)."""

    params: int
    grads: int
    optimizer: int

    @property
    def total(self) -> int:
        return self.params + self.grads + self.optimizer


def lora_params(dims, layers: list[int], *, rank: int, targets, tp: int) -> int:
    """Adapter parameters one TP rank holds for ``layers`` (``model.lora``; sharded as in
    megarl/policy/lora.py: a column-parallel layer (qkv, fc1) holds A ``[r, in]`` whole and its
    rows of B, a row-parallel one (proj, fc2) its columns of A and B ``[out, r]`` whole)."""
    h, f = dims.hidden_size, dims.intermediate_size
    q, kv = dims.num_attention_heads * dims.head_dim, dims.num_kv_heads * dims.head_dim
    per_rank_unit = {"linear_qkv": h + (q + 2 * kv) // tp, "linear_proj": q // tp + h,
                     "linear_fc1": h + 2 * f // tp, "linear_fc2": f // tp + h}
    return len(layers) * rank * sum(per_rank_unit[t] for t in targets)


def train_state(dense: int, expert: int, *, dtype: str, optimizer: str, dp_cp: int, expert_dp: int,
                adapters: int = 0) -> TrainState:
    """Parameters, fp32 main grads and distributed-optimizer state of a rank holding ``dense``
    and ``expert`` parameters (counts from :class:`megarl.planner.ranks.RankCount`):

    * **parameters**: ``(dense + expert) x bytes(model.dtype)``;
    * **gradients**: ``(dense + expert) x 4``: megatron-core DDP keeps fp32 main grads in one
      contiguous buffer on every rank (:func:`megarl.policy.build.wrap_ddp`: ``grad_reduce_in_fp32``);
    * **optimizer state** (megatron's distributed optimizer, always on in megarl): per parameter
      an fp32 master copy (4 bytes; none when the model is fp32 already) plus Adam's two fp32
      moments (8; SGD: none, megarl's SGD has no momentum), sharded over the ranks that hold the
      same parameter: dense over ``dp_cp`` (``dp x cp``), routed experts over ``expert_dp``, the
      expert-data-parallel size ``world / (etp x ep x pp)``.

    With LoRA (``adapters`` > 0: :func:`lora_params`) the base parameters are frozen: they keep
    their bytes but have no main grads and no optimizer state; the adapters have all three
    (sharded over ``dp_cp`` like dense parameters)."""
    if dtype not in DTYPE_BYTES:
        raise ValueError(f"dtype={dtype!r}, expected one of {sorted(DTYPE_BYTES)}")
    master = 4 if dtype != "float32" else 0
    moments = {"adam": 8, "sgd": 0}[optimizer]
    per_param = master + moments
    n = dense + expert
    if adapters:
        return TrainState(params=(n + adapters) * DTYPE_BYTES[dtype], grads=adapters * 4,
                          optimizer=-(-adapters * per_param // dp_cp))
    return TrainState(params=n * DTYPE_BYTES[dtype], grads=n * 4,
                      optimizer=-(-dense * per_param // dp_cp) + -(-expert * per_param // expert_dp))


def layer_activation_elements(dims, layer: int, tp: int, etp: int, sp: bool) -> float:
    """bf16 elements per token that layer ``layer`` keeps for the backward.

    Per token of a micro-batch on one device (``trainer.max_tokens_per_micro_batch``, the
    per-device packed row), in bf16 elements (2 bytes): ``s = 1/tp`` with sequence parallelism,
    else 1 (the h-wide tensors), ``t = 1/tp`` (head- and ffn-split tensors), ``e = 1/etp``
    (expert tensors):

    * attention, GQA: ``2h*s`` (norm input, QKV input) ``+ (2*heads*hd + 2*kv*hd)*t`` (q, k, v and
      the attention output; flash attention keeps no score matrix);
      MLA: ``2h*s + 2*q_lora + (kv_lora + rope) + kv_lora`` (the latent tensors, not split)
      ``+ heads*(2*(nope + rope) + 2*v)*t`` (q, k, v, output);
    * dense MLP (gated): ``2h*s`` (norm input, fc1 input) ``+ 3*ffn*t`` (fc1 output: gate and up;
      fc2 input);
    * MoE layer: ``2h*s`` (norm input, router input) ``+ topk*(h + 3*ffn_e)*e`` (each routed copy
      of the token: expert input, fc1 output, fc2 input) ``+ 3*ffn_shared*t`` (shared expert)
      ``+ 2*experts`` (fp32 router scores)."""
    s = 1 / tp if sp else 1.0
    t, e = 1 / tp, 1 / etp
    h, heads = dims.hidden_size, dims.num_attention_heads
    if dims.kv_lora_rank:
        qk = dims.qk_nope_head_dim + dims.qk_rope_head_dim
        attention = (2 * h * s + 2 * dims.q_lora_rank + dims.kv_lora_rank + dims.qk_rope_head_dim + dims.kv_lora_rank
                     + heads * (2 * qk + 2 * dims.v_head_dim) * t)
    else:
        attention = 2 * h * s + (2 * heads * dims.head_dim + 2 * dims.num_kv_heads * dims.head_dim) * t
    if dims.is_moe_layer(layer):
        mlp = (2 * h * s + dims.num_experts_per_tok * (h + 3 * dims.moe_intermediate_size) * e
               + 3 * dims.shared_expert_intermediate_size * t + 2 * dims.num_experts)
    else:
        mlp = 2 * h * s + 3 * dims.intermediate_size * t
    return attention + mlp


def in_flight_micro_batches(stage: int, pp: int, vpp: int, micro_batches: int) -> float:
    """Micro-batches whose activations stage ``stage`` holds at its peak, in units of the whole
    stage's layers (chunk micro-batches / vpp under the interleaved schedule).

    1F1B keeps the activations of several micro-batches in flight on a stage: stage ``p`` of
    ``pp`` holds ``min(M, pp - p)`` micro-batches' worth of its layers; with vpp chunks
    (megatron's interleaved schedule) ``min(M*vpp, 2*(pp - p - 1) + (vpp - 1)*pp + 1)`` chunk
    micro-batches of ``layers/vpp`` layers each; ``M`` (``micro_batches``) is the micro-batch count
    of one training step on one data-parallel rank."""
    if vpp <= 1:
        return float(min(micro_batches, pp - stage))
    chunks = min(micro_batches * vpp, 2 * (pp - stage - 1) + (vpp - 1) * pp + 1)
    return chunks / vpp


def activation_bytes(dims, layers: list[int], *, tokens: int, tp: int, etp: int, sp: bool, recompute: str,
                     in_flight: float, last_stage: bool) -> int:
    """Peak activation bytes of a stage holding decoder ``layers`` for micro-batches of ``tokens``
    tokens per device, ``in_flight`` of them at once (:func:`in_flight_micro_batches`).

    Recompute: ``none`` and ``selective`` keep every layer's activations
    (:func:`layer_activation_elements`; megatron's selective recompute re-runs core attention only,
    whose flash-attention activations are the q, k, v already counted, so it saves nothing here);
    ``full`` (uniform, one layer per checkpoint) keeps each layer's input (``h*s`` elements per
    token) and, during the backward, one layer's full activations. The last stage also holds the
    logits of one micro-batch: ``tokens * vocab/tp * 10`` bytes (:data:`LOGIT_BYTES_PER_ELEMENT`)."""
    if recompute not in ("none", "selective", "full"):
        raise ValueError(f"recompute={recompute!r}, expected none, selective or full")
    per_layer = [layer_activation_elements(dims, i, tp, etp, sp) for i in layers]
    if recompute == "full":
        s = 1 / tp if sp else 1.0
        elements = in_flight * len(layers) * dims.hidden_size * s + (max(per_layer) if per_layer else 0)
    else:
        elements = in_flight * sum(per_layer)
    total = 2 * tokens * elements
    if last_stage:
        total += tokens * (dims.vocab_size / tp) * LOGIT_BYTES_PER_ELEMENT
    return int(total)


def kv_bytes_per_token(dims, rollout_tp: int, dtype_bytes: int = 2) -> int:
    """KV-cache bytes one token takes on one GPU of a vLLM engine, all layers: MLA keeps one
    latent vector ``(kv_lora + rope) x 2`` bytes on every rank (not split by TP), GQA
    ``2 x max(1, kv/tp) x hd x 2`` bytes (KV heads split, or replicated when tp > kv). vLLM takes
    ``rollout.gpu_memory_utilization`` of the device; its KV cache gets what the weights
    (:func:`vllm_weight_bytes`) leave of that (its profiling run's activation workspace is not
    modelled)."""
    if dims.kv_lora_rank:
        per_layer = (dims.kv_lora_rank + dims.qk_rope_head_dim) * dtype_bytes
    else:
        heads = max(1, dims.num_kv_heads // rollout_tp)
        per_layer = 2 * heads * dims.head_dim * dtype_bytes
    return per_layer * dims.num_layers


def vllm_weight_bytes(total_params: int, rollout_tp: int, dtype_bytes: int = 2) -> int:
    """bf16 weights of one GPU of a vLLM engine of ``rollout_tp`` GPUs: ``total params x 2 /
    rollout.tp`` (experts sharded over the engine's ranks either way)."""
    return -(-total_params * dtype_bytes // rollout_tp)


@dataclass(frozen=True)
class DataPlane:
    """Bytes one step moves between the engines, the controller and the training ranks.

    The engines put each sample's token ids (int32, prompt and response) and vLLM's log-probs
    (float64) into Ray's object store; the controller receives the sample's metadata (its
    response text, :data:`TEXT_BYTES_PER_TOKEN`, and :data:`METADATA_BYTES`) and two handles, or
    a copy of the ids and log-probs where a mode keeps them (``samples_copy``: speculative
    rollouts, the agent loop), and sends each rank its share as handles plus the small per-sample
    tensors as runs of equal values (:mod:`megarl.data.wire`: an outcome reward's advantages one
    run a sample, 8 B; the loss mask one, 5 B). Routing replay's experts (``moe_layers x top-k``
    int16 per prompt and response token) go from the engines to the ranks through the object store.
    The forward passes before the update (``passes``: old log-probs 4 B a response token, the
    reference's 4 B, the rollout correction's weights 4 B, a critic's values and returns 8 B) go
    from the ranks that computed them to the ranks of the update; the controller gets per-sample
    read-outs (:data:`READOUT_BYTES`). Per-token advantages (a critic's GAE, a KL reward) are
    computed on rank 0 where their inputs are, and travel as a handle a sample. Each training
    rank receives its data-parallel share (every rank of a model-parallel group the same)."""

    controller_in: int
    controller_out: int
    routing: int
    """The routing replay's bytes per step (0 without it), engines to ranks."""
    passes: int
    """The forward passes' bytes per step the update's ranks read (0 without the passes)."""
    per_rank: int
    per_node: int
    samples_copy: bool = False
    """The controller receives the samples' ids and log-probs from the engines (else their
    metadata: the response text, its length and digest)."""
    advantages_rank0: int = 0
    """With per-token advantages (GAE, a KL reward): what rank 0 reads of the passes to compute
    them (the whole step's, not a data-parallel share) and writes back (advantages, and returns
    with a critic)."""

    @property
    def controller(self) -> int:
        return self.controller_in + self.controller_out


READOUT_BYTES = 128
"""What the controller gets of a forward pass per sample (megarl/data/readout.py: about a dozen float64 sums, maxima and counts, and a handle)."""


TEXT_BYTES_PER_TOKEN = 4
"""A decoded response's UTF-8 bytes per token, about: 3.4 pickled, measured with SmolLM2's
tokenizer on this repository's docs/architecture.md and README.md (markdown and code); English
prose runs nearer 4."""


METADATA_BYTES = 16 + 8 + 8
"""A stored sample's metadata besides its text: the digest of its ids, its length, and its
``clipped`` flag with the dict's keys, about."""


HANDLE_BYTES = 160
"""A pickled object-store handle (:class:`megarl.data.store.Stored`: Ray's reference with its
owner's address, shape, dtype, size), about."""


def data_plane_bytes(*, samples: int, mean_prompt: float, mean_response: float, moe_layers: int, topk: int,
                     routing: bool, dp: int, ranks_per_node: int, old_pass: bool = False, reference: bool = False,
                     correction: bool = False, token_advantages: bool = False, critic: bool = False,
                     kl_reward: bool = False, samples_copy: bool = False) -> DataPlane:
    """The step's :class:`DataPlane` (means per sample, sizes in bytes). ``old_pass``
    (:func:`megarl.config.passes.needs_old_logprob_pass`), ``reference`` (a reference model) and
    ``correction`` (a rollout correction's weights, with the old pass): the forward passes before
    the update; ``token_advantages``: advantages that differ token by token (GAE, a KL reward),
    else one run a sample; ``critic``: a PPO critic's values pass and update; ``kl_reward`` (with
    ``token_advantages``): the advantages read the old and reference log-probs; ``samples_copy``:
    the controller also receives the samples' ids and log-probs (an async sample resumed after a
    sync brings its own too, not counted)."""
    tokens = mean_prompt + mean_response
    route = samples * tokens * moe_layers * topk * 2 if routing else 0
    base_in = samples * (4 * tokens + 8 * mean_response if samples_copy else
                         TEXT_BYTES_PER_TOKEN * mean_response + METADATA_BYTES + 2 * HANDLE_BYTES)
    advantages = 4 * mean_response if token_advantages else 4 + 4   # per token, or one run (value, length)
    small = advantages + 1 + 4                                      # and the loss mask's run
    small_out = (HANDLE_BYTES if token_advantages else advantages) + 1 + 4
    base_out = samples * (2 * HANDLE_BYTES + small_out)             # handles on the engines' ids and log-probs
    to_ranks = samples * (4 * tokens + 8 * mean_response + small)
    passes = samples * mean_response * (4 * old_pass + 4 * reference + 4 * (correction and old_pass) + 8 * critic)
    readouts = samples * READOUT_BYTES if old_pass or reference or critic else 0
    # rank 0 reads the old and reference log-probs (a KL reward) and the values, writes advantages and returns
    rank0 = samples * mean_response * (8 * kl_reward + 4 * critic + 4 + 4 * critic) if token_advantages else 0
    per_rank = int(to_ranks + route + passes) // max(1, dp)
    return DataPlane(controller_in=int(base_in + readouts), controller_out=int(base_out), routing=int(route),
                     passes=int(passes), per_rank=per_rank, per_node=per_rank * ranks_per_node,
                     advantages_rank0=int(rank0), samples_copy=samples_copy)
