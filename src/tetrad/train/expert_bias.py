"""DeepSeek-V3's auxiliary-loss-free load balancing (model.router_bias_update_rate; docs/design.md
"Mixture of experts"). Each MoE layer picks its top-k experts by score + expert_bias
(model/moe.py); after each optimizer step the bias moves toward balance,
bias_e += rate * sign(mean_e(count) - count_e), from the step's expert counts: every training
micro-batch's, taken in backward (once per micro-batch under any recompute or split backward),
summed over the gradient group dp x cp (tp ranks route alike; pp stages hold other layers; under ep
each rank routes its own tokens) by one all-reduce of the stage's [MoE layers, E] int64 counts.
The counts are exact, so every layout moves the biases one process does.
"""

from __future__ import annotations

import torch
import torch.nn as nn

from tetrad.dist.layout import GRAD
from tetrad.model.moe import MoE, expert_biases, set_expert_biases


class ExpertBias:
    """The expert biases of this rank's MoE layers: the step's update, the step's largest load
    (metrics' moe_max_load), and their checkpoint state as a `stateful` object
    (extra.expert_bias.LAYER, e.g. extra.expert_bias.layers.3.mlp: a layout with other pipeline
    stages restores its own layers'). Rate 0: no count, no collective, no update."""

    NAME = "expert_bias"

    def __init__(self, model: nn.Module, rate: float, topo):
        self.model, self.rate, self.topo = model, rate, topo
        self.layers = [m for m in model.modules() if isinstance(m, MoE)] if rate > 0 else []
        self.counts: torch.Tensor | None = None  # the step's, summed over GRAD: [layers, E]

    def state_dict(self) -> dict[str, torch.Tensor]:
        return expert_biases(self.model)

    def load_state_dict(self, state: dict[str, torch.Tensor]) -> None:
        set_expert_biases(self.model, state)

    def reduce(self) -> None:
        """The step's counts of this stage's MoE layers, summed over GRAD (after backward)."""
        if self.layers:
            counts = torch.stack([m.take_counts() for m in self.layers])
            self.topo.comm.all_reduce(counts, GRAD)
            self.counts = counts

    def loads(self) -> torch.Tensor:
        """[pp] fp32, for the step's sums over the job: at this stage's pipeline rank its largest
        count / mean count over its MoE layers, from one rank of the stage (GRAD and tp rank 0, as
        every rank of it has the same counts), zero elsewhere; a stage without MoE layers, 0."""
        topo = self.topo
        out = torch.zeros(topo.size("pp"), device=topo.device)
        if self.counts is not None and topo.local_rank(GRAD) == 0 and topo.tp_rank == 0:
            counts = self.counts.double()
            out[topo.coords["pp"]] = (counts.amax(dim=-1) / counts.mean(dim=-1)).max()
        return out

    @torch.no_grad()
    def update(self) -> None:
        """bias_e += rate * sign(mean - count_e), per layer: after the optimizer step."""
        if self.counts is None:
            return
        for moe, counts in zip(self.layers, self.counts.double()):
            moe.expert_bias.add_(torch.sign(counts.mean() - counts).float(), alpha=self.rate)
        self.counts = None
