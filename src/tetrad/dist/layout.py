"""The parallel dimensions and where every rank sits in their grid (dist/sequence.py: which tokens
a cp rank holds).

The dimensions are data (DIMENSIONS): each says whether the ranks along it hold the same weights
(then gradients are summed over it: the gradient group is the flattened product of those) and
which comm_bytes key its traffic is reported under. Adding one is a field of `Layout` and an
entry here; the topology's groups, the gradient group, the clipping norm's groups and the metrics
follow from it. Expert parallelism is not one: it splits dp (`Layout.ep`, EP and EXPERT_GRAD).

Pure arithmetic, no process groups and no torch (tested over every factorisation). world = pp x dp x cp x tp
with tp fastest, then cp, then dp, pp slowest (Megatron's order), so tensor-parallel groups are
consecutive ranks inside one node and pipeline stages are the outermost dimension. Nothing else
in tetrad computes ranks by hand.
"""

from __future__ import annotations

import itertools
import math
from dataclasses import dataclass



@dataclass(frozen=True)
class Dim:
    name: str
    replicated: bool  # every rank along it holds the same weights: gradients are summed over it
    reported_as: str  # the metrics.jsonl comm_bytes key (contract: tp, cp, pp, dp)


# Slowest first: the mesh order.
DIMENSIONS = (Dim("pp", False, "pp"), Dim("dp", True, "dp"), Dim("cp", True, "cp"), Dim("tp", False, "tp"))
DIMS = tuple(d.name for d in DIMENSIONS)
# The gradient group: every replicated dimension flattened into one ("dp_cp"); its traffic is
# reported under its first dimension's key. Summing over it gives the whole replica's gradient.
GRAD_DIMS = tuple(d.name for d in DIMENSIONS if d.replicated)
GRAD = "_".join(GRAD_DIMS)
# Groups a global sum over distinct weights runs over (the clipping norm): the dimensions that
# split the weights, fastest first.
WEIGHT_SPLIT_DIMS = tuple(d.name for d in reversed(DIMENSIONS) if not d.replicated)
# Expert parallelism (parallel.ep) splits dp, not the mesh: its "ep" groups are blocks of ep
# consecutive dp ranks, each holding 1/ep of every MoE layer's experts, and EXPERT_GRAD groups the
# ranks that hold the same experts (the same dp % ep, every dp // ep and every cp): expert
# gradients are summed over it as dense ones over GRAD.
EP = "ep"
EXPERT_GRAD = f"e{GRAD}"
# The comm_bytes keys, one per dimension, fastest first, then the experts' all-to-alls.
REPORTED = tuple(dict.fromkeys(d.reported_as for d in reversed(DIMENSIONS))) + (EP,)


@dataclass(frozen=True)
class Layout:
    pp: int = 1
    dp: int = 1
    cp: int = 1
    tp: int = 1
    ep: int = 1  # expert parallelism: a split of dp, not a dimension of the mesh (`expert_groups`)

    @property
    def sizes(self) -> tuple[int, ...]:
        return tuple(getattr(self, d) for d in DIMS)

    @property
    def world_size(self) -> int:
        return math.prod(self.sizes)

    def grid(self) -> list:
        """Rank of every coordinate, as lists nested in DIMS order (grid[pp][dp][cp][tp]); the
        DeviceMesh is built from this."""
        ranks: list = list(range(self.world_size))
        for size in reversed(self.sizes[1:]):  # tp's runs first, then cp's, then dp's
            ranks = [ranks[i:i + size] for i in range(0, len(ranks), size)]
        return ranks

    def coords(self, rank: int) -> dict[str, int]:
        """The coordinate of `rank` along every dimension."""
        out, rest = {}, rank
        for name, size in reversed(list(zip(DIMS, self.sizes))):
            out[name] = rest % size
            rest //= size
        return {name: out[name] for name in DIMS}

    def rank_at(self, coords: dict[str, int]) -> int:
        """The rank at `coords` (the inverse of `coords`; `grid`'s order), in plain arithmetic:
        point-to-point calls ask it per transfer, where building the grid cost a tensor each."""
        rank = 0
        for name, size in zip(DIMS, self.sizes):
            rank = rank * size + coords[name]
        return rank

    def groups(self, dims: tuple[str, ...]) -> list[list[int]]:
        """Every group spanning `dims` (the other coordinates fixed), each as a sorted rank list;
        the groups in the order of their fixed coordinates."""
        fixed, kept = [d for d in DIMS if d not in dims], [d for d in DIMS if d in dims]

        def every(names):
            return [dict(zip(names, at)) for at in itertools.product(*(range(getattr(self, d)) for d in names))]
        return [[self.rank_at({**outer, **inner}) for inner in every(kept)] for outer in every(fixed)]

    @classmethod
    def of(cls, parallel) -> "Layout":
        """The layout a config's [parallel] section asks for (a key per dimension)."""
        return cls(**{d: getattr(parallel, d) for d in DIMS}, ep=parallel.ep)

    def group_of(self, rank: int, dims: tuple[str, ...]) -> list[int]:
        return next(g for g in self.groups(dims) if rank in g)

    def split_in_blocks(self, dims: tuple[str, ...], size: int) -> tuple[list, list]:
        """(shard, replica): every `dims` group cut into consecutive blocks of `size` ranks (hybrid
        ZeRO's shard groups: a block fits a node when `size` divides its ranks) and into the ranks
        at the same position in every block (the replicas of one shard)."""
        return _blocks(self.groups(dims), size)

    def expert_groups(self) -> tuple[list, list]:
        """(ep, EXPERT_GRAD): every dp group cut into blocks of `ep` consecutive ranks (a rank's
        place in its block is its ep rank, dp % ep), and, for each (pp, tp), the ranks of one ep
        rank over every block and every cp coordinate (who hold the same experts)."""
        ep = self.split_in_blocks(("dp",), self.ep)[0]
        grad = [[r for r in group if self.coords(r)["dp"] % self.ep == e]
                for group in self.groups(GRAD_DIMS) for e in range(self.ep)]
        return ep, grad

    def expert_shards(self, zero_shard: int) -> list:
        """EXPERT_SHARD under hybrid ZeRO with blocks of `zero_shard` dp x cp ranks, a multiple of
        ep x cp: every EXPERT_GRAD group cut into consecutive chunks of zero_shard/ep ranks, those
        of its ranks inside one shard block (the block holds whole EP groups). The ranks at one
        position of every chunk are those at one position of every block, so the experts' shards
        are replicated over the dense REPLICA groups (tests/test_ep.py checks it)."""
        return _blocks(self.expert_groups()[1], zero_shard // self.ep)[0]

    def split_by_node(self, dims: tuple[str, ...], ranks_per_node: int) -> tuple[list, list] | None:
        """(intra, inter): every `dims` group cut into its ranks on one node (node = rank //
        ranks_per_node) and into the ranks at the same position on every node; None when some
        group is spread unevenly over nodes (hierarchical reduction then cannot run)."""
        intra = []
        for group in self.groups(dims):
            nodes: dict[int, list[int]] = {}
            for r in group:
                nodes.setdefault(r // ranks_per_node, []).append(r)
            if len({len(g) for g in nodes.values()}) != 1:
                return None
            intra.append(list(nodes.values()))
        inter = [list(ranks) for per_group in intra for ranks in zip(*per_group)]
        return [g for per_group in intra for g in per_group], inter


def _blocks(groups: list[list[int]], size: int) -> tuple[list, list]:
    """Each group cut into consecutive blocks of `size` ranks, and into the ranks at one position
    in every block."""
    return ([group[i:i + size] for group in groups for i in range(0, len(group), size)],
            [group[i::size] for group in groups for i in range(size)])


def factorisations(world: int) -> list[Layout]:
    """Every layout with `world` ranks."""
    divs = [d for d in range(1, world + 1) if world % d == 0]
    return [Layout(**dict(zip(DIMS, sizes))) for sizes in itertools.product(divs, repeat=len(DIMS))
            if math.prod(sizes) == world]
