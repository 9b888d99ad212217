"""One validated object for every parallel size: tp, pp, vpp, ep, etp, cp, sp and the derived dp.

Megatron's layout (megatron-core ``initialize_model_parallel``): the dense part of the model uses
world = tp * cp * pp * dp; the MoE part re-folds the same ranks as world = etp * ep * pp * edp.
Every constraint is checked here, before any process group exists, and a failure names the
field, the value and the rule it breaks. Model-dependent rules (heads, layers, experts) are
checked by :meth:`Topology.check_model` against :class:`~megarl.models.dims.ModelDims`.

Rank order (megatron-core's ``RankGenerator`` with its default order ``tp-cp-ep-dp-pp``): a global
rank's dense coordinates vary fastest in tp, then cp, dp, pp; its expert coordinates in etp, then
ep, expert-dp, pp. :meth:`Topology.coords` computes them without any process group (the weight
bridge plans from them; ``tests/unit/test_bridge_plan.py`` checks them against ``RankGenerator``).
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
        stages = self.pp * self.vpp_size
        if dims.num_layers % stages:
            raise TopologyError("pp" if self.vpp_size == 1 else "vpp", self.pp if self.vpp_size == 1 else self.vpp,
                                f"pp*vpp (= {stages}) dividing num_hidden_layers={dims.num_layers}")
        if self.ep > 1 and dims.num_experts == 0:
            raise TopologyError("ep", self.ep, "1 for a dense model (expert parallelism needs a mixture-of-experts model)")
        if dims.num_experts and dims.num_experts % self.ep:
            raise TopologyError("ep", self.ep, f"a divisor of the number of experts ({dims.num_experts})")
        if self.etp is not None and self.etp > 1 and dims.num_experts == 0:
            raise TopologyError("etp", self.etp, "null or 1 for a dense model (expert tensor parallelism needs experts)")
