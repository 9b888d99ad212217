"""Execute the plan: Megatron shards -> destination buffers -> vLLM's own loader, bucket by bucket.

The vLLM layout lists every TP rank of every engine (``devices[k * tp + r]``); the rank on engine
k's first device holds its ``llm`` and drives it. Per bucket, collectively over Megatron ranks:
each destination device creates its :class:`megarl.bridge.buffer.DestBuffer`; the transport
writes every transfer; the manifests are gathered (ordering every write before any load); every
driver calls ``rpc.LOAD_BUCKET`` on its engine, all at once, and the workers load through vLLM's
reload path (:mod:`megarl.rollout.worker_ext`); the buffers are freed. After the last bucket each
driver resets its engine's prefix cache and the weight version moves on.

Every rank names its node when the bridge is built (the Ray node id, else the host name), so
whether two ranks share a node is known, not guessed: ``auto`` uses shared memory within a node
and point to point (gloo / NCCL) between nodes; ``shm`` across nodes is refused at build time.
``stats`` reports ``bytes_by_path`` and ``peak_extra_bytes`` (bucket buffer plus one slice in
flight). ``verify=True`` (``bridge.verify``) compares checksums computed from the shards through a
``vllm_shard`` plan with every worker's (:mod:`megarl.bridge.verify`), raising
:class:`WeightSyncError` naming the engine and the parameter.
"""
from __future__ import annotations

import os
import re
import socket
import time
import uuid
from dataclasses import dataclass
from typing import Callable, Optional

import torch
import torch.distributed as dist

from megarl.bridge import rpc
from megarl.bridge.buffer import DestBuffer, buffer_layout, shm_name, sweep_stale_buffers
from megarl.bridge.mapping import get_mapping, slices
from megarl.bridge.transfers import FORMATS, MegatronLayout, Planner, VllmLayout
from megarl.bridge.transport import get_transport
from megarl.bridge.verify import is_readable, weighted_checksum

_EXPERT_ID = re.compile(r"^(.*\.weight)(\d+)$")


class WeightSyncError(RuntimeError):
    """vLLM's weights differ from the Megatron weights after a sync (verification mode)."""


@dataclass
class SyncOptions:
    """How the bridge syncs; a run builds it from the ``bridge:`` config section
    (:meth:`megarl.config.schema.BridgeConfig.sync_options`)."""

    bucket_bytes: int = 256 << 20
    """Budget of destination bytes per device per bucket (a load group larger than this is
    sent alone)."""
    transport: str = "auto"
    """A name of :data:`megarl.bridge.transport.TRANSPORTS`: auto (shared memory within a node,
    point to point between nodes), shm (one node only), gloo or nccl (point to point), cuda_ipc
    (device buffers handed to the colocated vLLM worker)."""
    format: str = "hf_full"
    """Destination layout: hf_full (vLLM's CPU loader slices full HF tensors itself) or
    vllm_shard (vLLM's fused TP shards, for direct writes)."""
    verify: bool = False
    """After each sync, compare checksums of vLLM's readable parameters with the expected ones."""
    dtype: str = "float32"
    """vLLM's parameter dtype (the buffers are cast to it)."""

    def __post_init__(self):
        if self.bucket_bytes <= 0:
            raise ValueError(f"SyncOptions.bucket_bytes={self.bucket_bytes!r}, expected > 0")
        get_transport(self.transport)
        if self.format not in FORMATS:
            raise ValueError(f"SyncOptions.format={self.format!r}, expected one of {', '.join(FORMATS)}")


class LocalSource:
    """This rank's Megatron shards by logical name; expert stacks read per expert."""

    def __init__(self, shards, num_experts: int):
        self.dense: dict = {}
        self.experts: dict = {}
        for s in shards:
            m = _EXPERT_ID.match(s.name) if s.is_expert else None
            if m is None:
                self.dense[s.name] = s.tensor
                continue
            per = num_experts // s.ep_size
            self.experts.setdefault(m.group(1), {})[int(m.group(2)) - s.ep_rank * per] = s.tensor

    def names(self) -> set:
        return set(self.dense) | set(self.experts)

    def read_box(self, name: str, box) -> torch.Tensor:
        if name in self.dense:
            return self.dense[name][slices(box)]
        stack = self.experts[name]
        return torch.stack([stack[e][slices(box[1:])] for e in range(box[0][0], box[0][1])])

    def copy_box(self, name: str, box, out: torch.Tensor) -> None:
        if name in self.dense:
            out.copy_(self.dense[name][slices(box)])
            return
        stack = self.experts[name]
        for i, e in enumerate(range(box[0][0], box[0][1])):
            out[i].copy_(stack[e][slices(box[1:])])


class WeightBridge:
    """Megatron -> vLLM weight sync for one (model, Megatron layout, vLLM engine).

    ``shards``: a callable returning this rank's ``LocalShard`` list
    (``PolicyModel.local_shards``). ``vllm_devices``: the Megatron rank colocated with (or writing
    the buffers of) each vLLM TP rank of each engine, ``[k * tp + r]`` (default 0..tp-1: one
    engine). ``llm``: on the rank of an engine's first device, that engine (``vllm.LLM`` or a
    :class:`megarl.rollout.engine.RemoteEngine`); None elsewhere. ``node``: a name of the node this
    rank runs on (the Ray node id; default: the host name), gathered into ``nodes`` (by group
    rank): ranks with equal names share memory. Collective to build (every rank of ``group``).
    """

    def __init__(self, shards: Callable, hf_config, topology, vllm_tp: int, llm=None,
                 options: Optional[SyncOptions] = None, vllm_devices: Optional[tuple] = None, group=None,
                 node: Optional[str] = None):
        self.options = options or SyncOptions()
        self.shards_fn, self.llm, self.group = shards, llm, group
        self.rank = dist.get_rank() if dist.is_initialized() else 0
        self.src = MegatronLayout(topology)
        devices = tuple(vllm_devices or range(vllm_tp))
        self.dst = VllmLayout(vllm_tp, devices, self.options.format)
        shards_now = shards()
        padded = 0
        for s in shards_now:
            if s.name == "embedding.word_embeddings.weight":
                padded = s.tensor.shape[0] * s.tp_size
        self.mapping = get_mapping(hf_config, padded_vocab=padded)
        self.planner = Planner(self.mapping, self.src, self.dst)
        self.buckets = self.planner.buckets(self.options.bucket_bytes, itemsize=self._itemsize)
        node = socket.gethostname() if node is None else node
        ranks = [(node, os.getpid())]
        if dist.is_initialized():
            ranks = [None] * dist.get_world_size(group)
            dist.all_gather_object(ranks, (node, os.getpid()), group=group)
        self.nodes = [n for n, _ in ranks]
        self.pids = [pid for _, pid in ranks]   # each rank's process: it names (and unlinks) its buffers
        if self.options.transport == "shm":
            self._check_one_node()
        self.transport = get_transport(self.options.transport)(self.rank, group, self.nodes)
        if self.transport.storage == "shm":
            sweep_stale_buffers()   # a killed run's buffers would hold host memory until reboot
        self.engine_index = None   # the engine this rank drives
        if llm is not None:
            firsts = devices[::vllm_tp]
            if self.rank not in firsts:
                raise ValueError(f"rank {self.rank} holds a vLLM engine but is not the first device of any engine "
                                 f"(vllm_devices={devices}, tp={vllm_tp})")
            self.engine_index = firsts.index(self.rank)
        box = [uuid.uuid4().hex[:12]]
        if dist.is_initialized():
            dist.broadcast_object_list(box, src=0, group=group)
        self.uid = box[0]
        # continue the engine's weight version (a new bridge per layout must not go back in time)
        box = [max(llm.collective_rpc(rpc.WEIGHT_VERSION)) if llm is not None else 0]
        if dist.is_initialized():
            dist.all_reduce(t := torch.tensor(box, dtype=torch.int64), op=dist.ReduceOp.MAX, group=group)
            box = t.tolist()
        self.version = int(box[0])
        self.largest_bucket = max((buffer_layout(shapes, self._dtype)[1] for b in self.buckets
                                   for shapes in b.dst_shapes.values()), default=0)
        self.largest_slice = max((tr.numel for b in self.buckets for tr in b.transfers), default=0) * self._itemsize
        self._check_source(LocalSource(shards_now, self.mapping.cfg.num_experts))

    @property
    def _dtype(self):
        return getattr(torch, self.options.dtype)

    @property
    def _itemsize(self) -> int:
        return torch.empty((), dtype=getattr(torch, self.options.dtype)).element_size()

    def _check_source(self, source: LocalSource) -> None:
        """The plan's view of what this rank holds must match the engine's real shards."""
        planned = {tr.tensor for b in self.buckets for tr in b.transfers if tr.src_rank == self.rank}
        missing = planned - source.names()
        if missing:
            raise ValueError(f"rank {self.rank}: the plan reads {sorted(missing)[:5]} which this rank does not hold "
                             "(Megatron layout or names differ from the mapping)")

    def _check_one_node(self) -> None:
        """Shared memory does not reach another node: every transfer must stay within one."""
        for b in self.buckets:
            for tr in b.transfers:
                src, dst = self.nodes[tr.src_rank], self.nodes[tr.dst_rank]
                if src != dst:
                    raise ValueError(f"transport 'shm': rank {tr.src_rank} (node {src!r}) writes to rank "
                                     f"{tr.dst_rank} (node {dst!r}), but shared memory only reaches processes on "
                                     "the same node; use transport auto, gloo or nccl")

    def _barrier(self):
        if dist.is_initialized():
            dist.barrier(group=self.group)

    def _buffer_name(self, bucket: int, device: int) -> str:
        return shm_name(self.pids[device], f"{self.uid}-v{self.version}-b{bucket}-d{device}")

    def _gather_manifests(self, buffers: dict) -> dict:
        """``{device: manifest}`` of every rank's buffers, on every rank. Each rank contributes
        after its writes, so this also orders them before any engine's load."""
        mine = {device: buf.manifest() for device, buf in buffers.items()}
        if not dist.is_initialized():
            return mine
        out = [None] * dist.get_world_size(self.group)
        dist.all_gather_object(out, mine, group=self.group)
        return {device: m for part in out for device, m in part.items()}

    def _engine_devices(self, k: int) -> tuple:
        """The devices of engine ``k``'s vLLM TP ranks, in rank order."""
        return self.dst.devices[k * self.dst.tp:(k + 1) * self.dst.tp]

    def sync(self, engine: Optional[int] = None) -> dict:
        """Push the current Megatron weights into vLLM (collective). Returns timings and sizes.

        ``engine``: only into that engine, at the current version (a restarted engine catching
        up; the others are left alone, they may be generating)."""
        t0 = time.perf_counter()
        if engine is None:
            self.version += 1
        only = set(self._engine_devices(engine)) if engine is not None else None
        source = LocalSource(self.shards_fn(), self.mapping.cfg.num_experts)
        peak, messages, load_s, engine_bytes, by_path = 0, 0, 0.0, 0, {}
        for b, bucket in enumerate(self.buckets):
            buffers = {}
            transfers = bucket.transfers if only is None else [tr for tr in bucket.transfers if tr.dst_rank in only]
            if self.rank in bucket.dst_shapes and (only is None or self.rank in only):
                buffers[self.rank] = DestBuffer.create(self._buffer_name(b, self.rank), bucket.dst_shapes[self.rank],
                                                       self._dtype, storage=self.transport.storage)
            self._barrier()
            remote: dict = {}

            def open_remote(device, b=b, bucket=bucket, remote=remote):
                if device not in remote:
                    remote[device] = DestBuffer.open(self._buffer_name(b, device), bucket.dst_shapes[device],
                                                     self._dtype)
                return remote[device]

            largest, sent = self.transport.run(transfers, source, buffers, open_remote)
            own = sum(buf.nbytes for buf in buffers.values())
            peak, messages = max(peak, own + largest), messages + sent
            for tr in transfers:
                if tr.src_rank == self.rank:
                    path = self.transport.path(tr)
                    by_path[path] = by_path.get(path, 0) + tr.numel * self._itemsize
            for buf in remote.values():
                buf.close()
            manifests = self._gather_manifests(buffers)
            if self.llm is not None and engine in (None, self.engine_index):
                t = time.perf_counter()
                by_vllm_rank = {str(r): manifests[d] for r, d in enumerate(self._engine_devices(self.engine_index))
                                if d in manifests}
                engine_bytes += sum(m["nbytes"] for m in by_vllm_rank.values())
                self.llm.collective_rpc(rpc.LOAD_BUCKET, args=(by_vllm_rank, self.version, self.options.format))
                load_s += time.perf_counter() - t
            self._barrier()
            for buf in buffers.values():
                buf.close()
        if self.llm is not None and engine in (None, self.engine_index):
            self.llm.reset_prefix_cache()
        stats = {"version": self.version, "seconds": time.perf_counter() - t0, "vllm_load_seconds": load_s,
                 "buckets": len(self.buckets), "bytes_sent_by_rank": sum(by_path.values()),
                 "bytes_by_path": by_path, "peak_extra_bytes": peak,
                 "bucket_bytes": self.options.bucket_bytes, "largest_slice_bytes": self.largest_slice,
                 "largest_bucket_bytes": self.largest_bucket, "transport": self.options.transport,
                 "p2p_messages": messages}
        if self.llm is not None and engine in (None, self.engine_index):   # its load time and bytes received
            stats.update(engine_index=self.engine_index, engine_load_seconds=load_s, engine_bytes=engine_bytes)
        if self.options.verify:
            stats["verified_params"] = len(self.verify(source, engine))
        return stats

    # ------------------------------------------------------------------ verification
    def verify(self, source: Optional[LocalSource] = None, engine: Optional[int] = None) -> list[str]:
        """Compare weighted checksums of vLLM's readable parameters with the Megatron weights
        (every engine's, or only ``engine``'s).

        Returns the checked vLLM parameter names; raises WeightSyncError on a mismatch."""
        source = source or LocalSource(self.shards_fn(), self.mapping.cfg.num_experts)
        shard_layout = VllmLayout(self.dst.tp, self.dst.devices, "vllm_shard")
        planner = Planner(self.mapping, self.src, shard_layout)
        shapes = self.mapping.vllm_shapes(self.dst.tp)
        names = sorted(n for n in shapes if is_readable(n))
        # one expected checksum per (device, parameter): every engine is checked on its own
        index = {(d, n): i for i, (d, n) in enumerate((d, n) for d in self.dst.devices for n in names)}
        expected = torch.zeros(len(index), dtype=torch.float64)
        for t in self.mapping.megatron_tensors():
            for tr in planner.tensor_transfers(t):
                if tr.src_rank == self.rank and (tr.dst_rank, tr.dst_name) in index:
                    values = source.read_box(tr.tensor, tr.src_box).to(self._dtype)
                    expected[index[(tr.dst_rank, tr.dst_name)]] += weighted_checksum(
                        values, shapes[tr.dst_name], tr.dst_box)
        if dist.is_initialized():
            dist.all_reduce(expected, group=self.group)
        error = None
        if self.llm is not None and engine in (None, self.engine_index):
            devices = self._engine_devices(self.engine_index)
            for reply in self.llm.collective_rpc(rpc.CHECKSUMS, args=(names,)):
                r = reply["rank"]
                for n in names:
                    want, have = float(expected[index[(devices[r], n)]]), reply["checksums"].get(n)
                    if have is None or abs(have - want) > 1e-6 * max(1.0, abs(want)):
                        error = (f"weight sync verification failed: engine {self.engine_index} vLLM rank {r} "
                                 f"parameter {n}: expected checksum {want!r}, got {have!r}")
                        break
                if error:
                    break
        errors = [error]
        if dist.is_initialized():
            errors = [None] * dist.get_world_size(self.group)
            dist.all_gather_object(errors, error, group=self.group)
        first = next((e for e in errors if e), None)
        if first:
            raise WeightSyncError(first)
        return names
