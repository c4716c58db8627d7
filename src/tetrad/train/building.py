"""How a run's model is built on its rank: its execution choices, its chunks on the meta device,
then their memory and shard of the starting weights."""

from __future__ import annotations

import torch

from tetrad.config import Config
from tetrad.dist.topology import Topology
from tetrad.model.execution import DeferredWeightGrads, Execution
from tetrad.model.moe import set_expert_biases
from tetrad.model.sharding import init_parameters, set_spec, spec_of
from tetrad.parallel.pipeline.registry import schedule_spec
from tetrad.parallel.pipeline.stages import PipelineStages
from tetrad.train.init_from import initial_weights, stored_expert_biases


def execution_for(cfg: Config, hold=None) -> Execution:
    """How the model runs under `cfg` (model/execution.py); `hold` counts zero-bubble's deferred
    tensors (an ActivationMeter's)."""
    p = cfg.parallel
    return Execution(cp_algo=p.cp_algo, sequence_parallel=p.sequence_parallel and p.tp > 1, sp_regather=p.sp_regather,
                     loss_chunk=cfg.train.loss_chunk_tokens,
                     split_backward=p.pp > 1 and schedule_spec(p.schedule).splits_backward,
                     weight_grads=DeferredWeightGrads(hold))


def build_model(cfg: Config, topo: Topology, execution: Execution | None = None,
                materialise: bool = True) -> PipelineStages:
    """This rank's model chunks, built on the meta device, then given device memory and their
    shard of the initial weights (the logical init, or `checkpoint.init_from`'s weights), one
    parameter at a time. Without `materialise` (ZeRO-3's start-up) parameters get no memory and
    no values here: GradReducer's `init` builds only this rank's ZeRO shard of the same weights,
    so the whole local model never exists at once."""
    with torch.device("meta"):
        model = PipelineStages(cfg, topo, execution or execution_for(cfg))
    specs = {name: spec_of(p) for name, p in model.named_parameters()}
    if materialise:
        model.to_empty(device=topo.device)  # makes new Parameter objects: re-attach their specs
    else:
        model._apply(lambda t: _without_storage(t, topo.device))  # to_empty, one tensor alive at a time
    for name, p in model.named_parameters():
        set_spec(p, *specs[name])
    if materialise:
        init_parameters(model, cfg.train.seed, starting_weights(cfg))
    # the weights' expert biases (a tetrad checkpoint's), else zero; never ZeRO-sharded
    set_expert_biases(model, stored_expert_biases(cfg.checkpoint.init_from) if cfg.checkpoint.init_from else {})
    return model


def starting_weights(cfg: Config):
    """`weights(name)` of `checkpoint.init_from`, or None: the logical init."""
    return initial_weights(cfg.checkpoint.init_from) if cfg.checkpoint.init_from else None


def _without_storage(t: torch.Tensor, device: torch.device) -> torch.Tensor:
    """A tensor of t's shape and dtype on `device` whose memory is already released (ZeRO-3
    points it into its gathered buffer later)."""
    out = torch.empty_like(t, device=device)
    out.untyped_storage().resize_(0)
    return out
