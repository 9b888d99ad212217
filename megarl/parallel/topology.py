"""One validated object for every parallel size: tp, pp, vpp, ep, etp, cp, sp and the derived dp.

Megatron's layout (``initialize_model_parallel``): the dense part uses world = tp * cp * pp * dp,
the MoE part re-folds the same ranks as world = etp * ep * pp * edp. Every constraint is checked
here before any process group exists, and a failure names the field, value and rule; model rules
(heads, layers, experts) are in :meth:`Topology.check_model`.

Pipeline split (megatron-core's ``get_num_layers_to_build`` / ``get_transformer_layer_offset``):
num_layers / pp per stage in vpp chunks, or, where pp*vpp does not divide the layers
(DeepSeek-V3: 61 at pp=16), ``first_stage_layers`` / ``last_stage_layers`` on the end stages and
the rest even. Layers are numbered chunk 0 of stages 0..pp-1, then chunk 1, ...
(:meth:`Topology.stage_of_layer`). Rank order (``RankGenerator``, ``tp-cp-ep-dp-pp``): dense
coordinates vary fastest in tp, then cp, dp, pp; expert ones in etp, ep, edp, pp
(:meth:`Topology.coords`, without a process group, for the weight bridge's plan). Both are checked
against megatron-core (tests/unit/test_topology_uneven.py, test_bridge_plan.py).
"""
from __future__ import annotations

from dataclasses import dataclass


class TopologyError(ValueError):
    """A parallel layout that cannot work; ``field`` names the offending topology field."""

    def __init__(self, field: str, value, expected: str):
        self.field, self.value, self.expected = field, value, expected
        super().__init__(f"topology.{field}={value!r} is invalid: expected {expected}")


@dataclass(frozen=True)
class Topology:
    world_size: int = 1
    tp: int = 1
    pp: int = 1
    vpp: int | None = None
    ep: int = 1
    etp: int | None = None
    cp: int = 1
    sp: bool = False
    first_stage_layers: int | None = None
    """Decoder layers on the first pipeline stage, all its virtual chunks together (megatron's
    ``num_layers_in_first_pipeline_stage``); None: the stage is split like the middle ones."""
    last_stage_layers: int | None = None
    """Decoder layers on the last pipeline stage (``num_layers_in_last_pipeline_stage``)."""

    def __post_init__(self):
        for name in ("world_size", "tp", "pp", "ep", "cp"):
            value = getattr(self, name)
            if not isinstance(value, int) or value < 1:
                raise TopologyError(name, value, "an integer >= 1")
        for name in ("vpp", "etp"):
            value = getattr(self, name)
            if value is not None and (not isinstance(value, int) or value < 1):
                raise TopologyError(name, value, "null or an integer >= 1")
        if not isinstance(self.sp, bool):
            raise TopologyError("sp", self.sp, "true or false")
        if self.sp and self.tp == 1:
            raise TopologyError("sp", self.sp, "false when tp == 1 (sequence parallelism needs tp > 1)")
        if self.vpp is not None and self.vpp > 1 and self.pp == 1:
            raise TopologyError("vpp", self.vpp, "null or 1 when pp == 1 (virtual pipeline stages need pp > 1)")
        for name in ("first_stage_layers", "last_stage_layers"):
            value = getattr(self, name)
            if value is None:
                continue
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise TopologyError(name, value, "null or an integer >= 1")
            if self.pp == 1:
                raise TopologyError(name, value, "null when pp == 1 (uneven pipeline stages need pp > 1)")
            if value % self.vpp_size:
                raise TopologyError(name, value, f"a multiple of vpp={self.vpp} (each of the stage's {self.vpp} "
                                    "virtual chunks holds the same number of layers)")
        if self.pp == 2 and self.vpp_size > 1 and self.first_stage_layers is not None \
                and self.last_stage_layers is not None:
            # get_transformer_layer_offset divides by the number of middle stages (ZeroDivisionError)
            raise TopologyError("last_stage_layers", self.last_stage_layers,
                                "null when pp == 2 with vpp > 1 and first_stage_layers set (megatron-core's layer "
                                "offset needs a middle stage there; first_stage_layers alone gives the same split)")
        dense = self.tp * self.cp * self.pp
        if self.world_size % dense:
            raise TopologyError("world_size", self.world_size,
                                f"a multiple of tp*cp*pp = {self.tp}*{self.cp}*{self.pp} = {dense}")
        expert = self.expert_tp * self.ep * self.pp
        if self.world_size % expert:
            raise TopologyError("ep", self.ep, f"a size for which world_size={self.world_size} is a multiple of "
                                f"etp*ep*pp = {self.expert_tp}*{self.ep}*{self.pp} = {expert}")

    @property
    def dp(self) -> int:
        return self.world_size // (self.tp * self.cp * self.pp)

    @property
    def expert_tp(self) -> int:
        return self.tp if self.etp is None else self.etp

    @property
    def expert_dp(self) -> int:
        return self.world_size // (self.expert_tp * self.ep * self.pp)

    @property
    def vpp_size(self) -> int:
        return self.vpp or 1

    def megatron_sizes(self) -> dict:
        """The sizes as keyword arguments of megatron-core's ``initialize_model_parallel``."""
        return dict(tensor_model_parallel_size=self.tp, pipeline_model_parallel_size=self.pp,
                    virtual_pipeline_model_parallel_size=self.vpp if self.vpp_size > 1 else None,
                    context_parallel_size=self.cp, expert_model_parallel_size=self.ep,
                    expert_tensor_parallel_size=self.expert_tp)

    def coords(self, rank: int) -> dict:
        """Megatron coordinates of global rank ``rank``: tp, cp, dp, pp (dense) and etp, ep, edp."""
        if not 0 <= rank < self.world_size:
            raise ValueError(f"rank {rank} is outside topology.world_size={self.world_size}")
        tp_r, rest = rank % self.tp, rank // self.tp
        cp_r, rest = rest % self.cp, rest // self.cp
        dp_r, pp_r = rest % self.dp, rest // self.dp
        etp_r, rest = rank % self.expert_tp, rank // self.expert_tp
        ep_r, edp_r = rest % self.ep, (rest // self.ep) % self.expert_dp
        return dict(tp=tp_r, cp=cp_r, dp=dp_r, pp=pp_r, etp=etp_r, ep=ep_r, edp=edp_r)

    def check_model(self, dims) -> None:
        """Raise :class:`TopologyError` if this layout cannot shard a model of ``dims`` (a
        :class:`~megarl.models.dims.ModelDims`; not imported: parallel sits below models)."""
        if dims.num_attention_heads % self.tp:
            raise TopologyError("tp", self.tp,
                                f"a divisor of num_attention_heads={dims.num_attention_heads}")
        if dims.num_kv_heads % self.tp:
            raise TopologyError("tp", self.tp, f"a divisor of num_key_value_heads={dims.num_kv_heads} "
                                "(megatron does not replicate KV heads)")
        self.stage_layers(dims.num_layers)
        if self.ep > 1 and dims.num_experts == 0:
            raise TopologyError("ep", self.ep, "1 for a dense model (expert parallelism needs a mixture-of-experts model)")
        if dims.num_experts and dims.num_experts % self.ep:
            raise TopologyError("ep", self.ep, f"a divisor of the number of experts ({dims.num_experts})")
        if self.etp is not None and self.etp > 1 and dims.num_experts == 0:
            raise TopologyError("etp", self.etp, "null or 1 for a dense model (expert tensor parallelism needs experts)")

    @property
    def uneven(self) -> bool:
        """Whether the first or the last pipeline stage has its own layer count."""
        return self.first_stage_layers is not None or self.last_stage_layers is not None

    def stage_layers(self, num_layers: int) -> tuple[int, ...]:
        """Decoder layers on each pipeline stage (all its virtual chunks together), megatron's split
        of ``num_layers``; a :class:`TopologyError` naming the field when no split is possible."""
        pp, vpp = self.pp, self.vpp_size
        if not self.uneven:
            if num_layers % (pp * vpp):
                field, value = ("pp", self.pp) if vpp == 1 else ("vpp", self.vpp)
                raise TopologyError(field, value, f"pp*vpp (= {pp * vpp}) dividing num_hidden_layers={num_layers}"
                                    + self._uneven_hint(num_layers))
            return (num_layers // pp,) * pp
        first, last = self.first_stage_layers, self.last_stage_layers
        ends = [n for n in (first, last) if n is not None]
        middle_stages, middle_layers = pp - len(ends), num_layers - sum(ends)
        field = "last_stage_layers" if last is not None else "first_stage_layers"
        value = getattr(self, field)
        taken = " + ".join(f"{name}={n}" for name, n in (("first_stage_layers", first), ("last_stage_layers", last))
                           if n is not None)
        if middle_stages == 0:
            if middle_layers:
                raise TopologyError(field, value, f"num_hidden_layers - first_stage_layers = {num_layers} - {first} = "
                                    f"{num_layers - first} (with pp=2 the first and last stages hold every layer)"
                                    + self._uneven_hint(num_layers))
            return (first, last)
        per_stage = middle_layers // middle_stages
        if middle_layers < middle_stages * vpp or middle_layers % middle_stages or per_stage % vpp:
            each = f"a positive multiple of vpp={vpp}" if vpp > 1 else "at least 1"
            raise TopologyError(field, value, f"a count leaving num_hidden_layers={num_layers} - ({taken}) = "
                                f"{middle_layers} layers that split evenly over the {middle_stages} middle "
                                f"stage(s), {each} on each" + self._uneven_hint(num_layers))
        return (first if first is not None else per_stage,) + (per_stage,) * (pp - 2) + \
            (last if last is not None else per_stage,)

    def stage_of_layer(self, layer: int, num_layers: int) -> int:
        """The pipeline stage holding global decoder layer ``layer`` (0-based) of ``num_layers``: the
        stages' chunks in order, virtual chunk 0 of every stage first (see the module docstring)."""
        if not 0 <= layer < num_layers:
            raise ValueError(f"layer {layer} is outside the model's num_hidden_layers={num_layers}")
        counts = self.stage_layers(num_layers)
        rest = layer % (num_layers // self.vpp_size)   # position within its virtual chunk round
        for stage, n in enumerate(counts):
            rest -= n // self.vpp_size
            if rest < 0:
                return stage
        raise AssertionError("unreachable: the stages' chunks cover num_layers // vpp layers")

    def _uneven_hint(self, num_layers: int) -> str:
        """The message tail of a failed split: a working first/last pair, or that there is none."""
        if self.pp == 1:
            return ""
        pair = propose_uneven_stages(num_layers, self.pp, self.vpp_size)
        if pair is None:
            need = "at least one layer" if self.vpp_size == 1 else f"a positive multiple of vpp={self.vpp} layers"
            return (f"; no topology.first_stage_layers / last_stage_layers pair splits {num_layers} layers over "
                    f"pp={self.pp} either (every stage needs {need})")
        first, last = pair
        fields = f"first_stage_layers={first}" + ("" if last is None else f", last_stage_layers={last}")
        last = num_layers - first if last is None else last    # pp=2 only
        middle = (num_layers - first - last) // (self.pp - 2) if self.pp > 2 else 0
        split = " + ".join([str(first)] + ([f"{self.pp - 2} x {middle}"] if self.pp > 2 else []) + [str(last)])
        return (f"; or let topology.first_stage_layers / last_stage_layers take the remainder, e.g. "
                f"{fields} ({split} = {num_layers})")


def propose_uneven_stages(num_layers: int, pp: int, vpp: int = 1) -> tuple[int, int | None] | None:
    """A (first_stage_layers, last_stage_layers) pair splitting ``num_layers`` over ``pp`` stages
    by megatron's rules, or None: the pair whose largest stage is smallest, then the lightest ends
    (they also hold the embedding / the output layer and loss), the most even first/last, the
    larger first (e.g. DeepSeek-V3's 61 layers at pp=16: (3, 2), stages 3 + 14 x 4 + 2). At pp=2
    with vpp > 1 the last count is None (megatron takes the rest)."""
    if pp < 2:
        return None
    best = None
    for middle in ([0] if pp == 2 else range(vpp, num_layers + 1, vpp)):
        ends = num_layers - (pp - 2) * middle
        if ends < 2 * vpp:
            break
        for first in range(vpp, ends, vpp):
            last = ends - first
            if last % vpp:
                continue
            key = (max(first, last, middle), first + last, abs(first - last), -first)
            if best is None or key < best[0]:
                best = (key, first, last)
    if best is None:
        return None
    _, first, last = best
    return (first, None) if pp == 2 and vpp > 1 else (first, last)
