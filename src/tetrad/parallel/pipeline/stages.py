"""The model chunks one pipeline rank holds, with their parameters under logical names.

The model is cut into pp·vpp global stages of consecutive layers; stage g = chunk·pp + rank
(Megatron's interleaved placement, as in schedules.py), the embedding on stage 0, the final
norm, head and loss (and multi-token prediction's depths, model/mtp.py) on the last. Layers are
split by split.py, as the planner splits them (balanced by FLOPs, the head counted as part of a
layer, unless `parallel.stage_layers` lists them).

`PipelineStages` registers the chunks' modules directly (`layers.<global index>`, `embed`,
`norm`, `head`, `mtp`), so a parameter has the same name in every layout and a single-process
model's state dict covers the union of every rank's; the chunks themselves are kept in a plain
list and only used to run forward.
"""

from __future__ import annotations

import torch
import torch.nn as nn

from tetrad.config import Config
from tetrad.model.documents import Documents
from tetrad.model.execution import Execution
from tetrad.model.llama import Transformer
from tetrad.parallel.pipeline.split import layer_split, rank_stages


class PipelineStages(nn.Module):
    """This pipeline rank's vpp model chunks (one, the whole model, when pp = vpp = 1)."""

    def __init__(self, cfg: Config, topo, execution: Execution | None = None):
        super().__init__()
        pp, vpp, rank = cfg.parallel.pp, cfg.parallel.vpp, topo.coords["pp"]
        self.execution = execution or Execution()  # how every chunk's layers run
        split = layer_split(cfg)
        self.stage_ids = rank_stages(pp, vpp, rank)
        # Not submodules: their parts are registered below, in the single model's order
        # (embedding, layers, norm and head), which is also the order of gradient buckets.
        self.chunks = [Transformer(cfg.model, topo, layers=split[g], first=g == 0, last=g == len(split) - 1,
                                   execution=self.execution) for g in self.stage_ids]
        # The embedding over several stages, where the last stage reads it too (tied embeddings:
        # the head's weight; multi-token prediction: its depths' inputs, and a tied head's weight):
        # the last stage holds a copy, its chunk's head or (MTP) its own embedding, registered
        # under the same logical name, so it starts equal; the reducer sums the two copies'
        # gradients over the "embed" group (data.py), so they stay equal.
        tied = (cfg.model.tie_embeddings or cfg.model.mtp_layers > 0) and len(split) > 1
        self.holds_tied_weight = False  # a copy of the embedding, kept equal over "embed"
        self.holds_tied_copy = False  # that copy is the last stage's (the norm counts it on the first stage)
        for chunk in self.chunks:
            if chunk.first:
                self.embed = chunk.embed
                if cfg.model.pos == "learned":
                    self.pos_embed = chunk.pos_embed
                self.holds_tied_weight = tied
            elif chunk.last and tied:
                self.embed = chunk.embed if chunk.mtp is not None else chunk.head
                self.holds_tied_weight = self.holds_tied_copy = True
        self.layers = nn.ModuleDict()
        for chunk in self.chunks:
            self.layers.update(chunk.layers)
            if chunk.last:
                self.norm = chunk.norm
                if chunk.head is not getattr(self, "embed", None):
                    self.head = chunk.head
                if chunk.mtp is not None:
                    self.mtp = chunk.mtp

    def _apply(self, fn, recurse=True):
        """`to_empty()` and `.to()` replace Parameters registered directly on a module: point the
        first chunk back at the container's learned-position table (its other parts are shared
        modules, which are updated in place)."""
        super()._apply(fn, recurse)
        for chunk in self.chunks:
            if chunk.first and "pos_embed" in self._parameters:
                chunk.pos_embed = self.pos_embed
        return self

    def forward(self, x: torch.Tensor, positions: torch.Tensor, labels: torch.Tensor | None = None,
                chunk: int = 0, docs: Documents | None = None) -> torch.Tensor:
        """Run local chunk `chunk` (see Transformer.forward for what goes in and out)."""
        return self.chunks[chunk](x, positions, labels, docs=docs)

    def tied_weight(self) -> nn.Parameter | None:
        """This rank's copy of the embedding tied across stages, if it holds one."""
        return self.embed.weight if self.holds_tied_weight else None

    def chunk_parameters(self) -> list[list[nn.Parameter]]:
        """Each chunk's parameters: gradient buckets never span two chunks, whose backwards run
        at different times in a pipeline schedule."""
        return [list(chunk.parameters()) for chunk in self.chunks]
