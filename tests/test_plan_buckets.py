"""The planner's buckets (plan/buckets.py, from the config alone) against the runtime's layout of
a built model (parallel/data/buffers.lay_out): the same sizes, padding, shards and tp-replicated
elements in rank 0's part, bucket by bucket, on every pipeline rank. One process, meta device."""

from __future__ import annotations

import types

import pytest
import torch

from conftest import tiny_config
from tetrad.config.sections import bucket_bytes, shard_ranks
from tetrad.dist.codec_shapes import INT8_BLOCK
from tetrad.model.execution import Execution
from tetrad.model.sharding import spec_of
from tetrad.parallel.data.buffers import lay_out
from tetrad.parallel.pipeline.stages import PipelineStages
from tetrad.plan.buckets import PlannedBucket, rank_buckets

CASES = [({"tp": 2, "dp": 2, "zero": 1, "grad_bucket_mb": 0.01}, {"qk_norm": True, "head_dim": 24}),
         ({"tp": 2, "pp": 2, "vpp": 2, "dp": 2, "zero": 3},
          {"tie_embeddings": True, "n_layers": 4, "norm": "layernorm", "pos": "learned", "qk_norm": True}),
         ({"tp": 2, "pp": 2, "dp": 2, "zero": 1, "grad_bucket_mb": 0.01},
          {"tie_embeddings": True, "qkv_bias": True, "mlp": "gelu"}),
         ({"dp": 4, "zero": 0, "grad_codec": "powersgd", "grad_bucket_mb": 0.002}, {"vocab_size": 257}),
         ({"tp": 2, "cp": 2, "zero": 2}, {"qkv_bias": True, "vocab_size": 257, "pos": "learned"}),
         ({"tp": 2, "cp": 2, "zero": 1, "grad_codec": "int8"}, {"norm": "layernorm", "tie_embeddings": True}),
         ({"pp": 2, "dp": 2, "zero": 3, "stage_layers": [1, 1]}, {"tie_embeddings": True}),
         ({"tp": 2, "pp": 2, "dp": 2, "zero": 1, "grad_bucket_mb": 0.01},  # Gemma 3: qk-norm and sandwich norms
          {"norm": "gemma_rmsnorm", "mlp": "geglu", "sandwich_norm": True, "qk_norm": True, "head_dim": 24,
           "tie_embeddings": True, "scale_embeddings": True})]
# MoE: the router (replicated, its gradient summed over tp as qk-norm's) and each [E, H, d] expert tensor
CASES += [({"tp": 2, "dp": 2, "zero": 1, "grad_bucket_mb": 0.01}, {"n_experts": 4, "expert_ffn_hidden": 96}),
          ({"tp": 2, "pp": 2, "dp": 2, "zero": 3}, {"n_experts": 3, "experts_per_token": 1, "mlp": "gelu"})]
# Expert parallelism: the experts' buckets after the dense ones, padded for dp*cp/ep (ZeRO-3: a bucket
# of each block's experts, gathered with it).
CASES += [({"dp": 4, "ep": 2, "zero": 1, "grad_bucket_mb": 0.01}, {"n_experts": 4, "expert_ffn_hidden": 96}),
          ({"pp": 2, "dp": 4, "ep": 2, "zero": 3}, {"n_experts": 4, "expert_ffn_hidden": 96, "dense_layers": [1]}),
            ({"tp": 2, "pp": 2, "vpp": 2, "dp": 2, "cp": 2, "ep": 2, "zero": 2, "grad_bucket_mb": 0.01},
             {"n_experts": 4, "n_layers": 4, "tie_embeddings": True, "qk_norm": True})]
# A shared expert (dense, split over tp) and its gate (replicated, summed over tp as the router's), a dense
# first layer: each pipeline rank's buckets follow the kinds of the layers it holds.
SHARED = {"n_experts": 4, "expert_ffn_hidden": 32, "shared_expert_ffn_hidden": 64, "shared_expert_gate": True,
          "dense_layers": [0], "n_layers": 4}
CASES += [({"tp": 2, "pp": 2, "dp": 2, "zero": 1, "grad_bucket_mb": 0.01}, SHARED),
          ({"pp": 2, "vpp": 2, "dp": 2, "zero": 3}, {**SHARED, "dense_layers": [0, 3]}),
          ({"dp": 4, "ep": 2, "zero": 1, "grad_bucket_mb": 0.01}, SHARED)]
# Hybrid ZeRO with ep: the dense buckets over the block, the experts' over its zero_shard/ep ranks (one
# rank; two, a dp rank's cp pair; three, which pad the experts' tensors of 2 x 97 x 64 elements).
CASES += [({"dp": 4, "ep": 2, "zero": 2, "zero_shard": 2, "grad_bucket_mb": 0.01}, {"n_experts": 4, "expert_ffn_hidden": 96}),
          ({"dp": 4, "cp": 2, "ep": 2, "zero": 3, "zero_shard": 4}, {"n_experts": 4, "expert_ffn_hidden": 96}),
          ({"dp": 12, "ep": 2, "zero": 1, "zero_shard": 6, "grad_bucket_mb": 0.01}, {"n_experts": 4, "expert_ffn_hidden": 97})]

# Latent attention (plan/latent.py): the down projections and latent norms replicated over tp (summed
# under SP), the up projections split by heads; with and without a query latent
LATENT = {"kv_lora_rank": 16, "q_lora_rank": 24, "qk_nope_head_dim": 12, "qk_rope_head_dim": 4, "v_head_dim": 12,
          "n_kv_heads": 4}
CASES += [({"tp": 2, "dp": 2, "zero": 1, "grad_bucket_mb": 0.01}, LATENT),
          ({"tp": 2, "pp": 2, "dp": 2, "zero": 3}, {**LATENT, "q_lora_rank": 0, "n_experts": 4, "dense_layers": [0]})]

# Multi-token prediction (model/mtp.py): each depth's norms, eh_proj (replicated over tp) and block after
# the last stage's head, the block one of ZeRO-3's after the main layers'; over several stages the last
# one's copy of the untied embedding in a bucket of its own, as a tied head's
MTP_MOE = {"mtp_layers": 1, "n_experts": 4, "expert_ffn_hidden": 96, "dense_layers": [0]}
CASES += [({"tp": 2, "pp": 2, "dp": 2, "zero": 1, "grad_bucket_mb": 0.01}, {"mtp_layers": 2}),
          ({"tp": 2, "pp": 2, "dp": 2, "zero": 3}, {"mtp_layers": 2, "tie_embeddings": True, "norm": "layernorm"}),
          ({"pp": 2, "dp": 4, "ep": 2, "zero": 3}, MTP_MOE),
          ({"tp": 2, "dp": 2, "zero": 2, "grad_bucket_mb": 0.01}, {**MTP_MOE, "mtp_layers": 2})]


def _runtime(cfg, rank: int) -> list[PlannedBucket]:
    """lay_out of pipeline rank `rank`'s model (tp rank 0, ep rank 0), summarised as rank_buckets does."""
    p = cfg.parallel
    topo = types.SimpleNamespace(tp_size=p.tp, tp_rank=0, ep_size=p.ep, ep_rank=0, coords={"pp": rank},
                                 device=torch.device("cpu"))
    with torch.device("meta"):
        model = PipelineStages(cfg, topo, Execution())
    n = shard_ranks(p)  # hybrid ZeRO's block, its EP groups' chunk of the experts' group
    experts = {"experts": ("experts", n // p.ep, 0)} if p.ep > 1 else {}
    layout = lay_out(list(model.parameters()), model, p.zero, n, 0,
                     INT8_BLOCK if p.grad_codec == "int8" else 1, bucket_bytes(p), **experts)
    expert = {id(q) for name, q in model.named_parameters() if ".experts." in name and p.ep > 1}
    out = []
    for b in layout.buckets:
        counts = [0, 0]  # replicated, of them qk-norm's
        for i, lo, hi in b.slices(0, b.padded if p.zero == 0 else b.hi):
            spec = spec_of(b.params[i])[0]
            if spec.shard_dim is None:
                counts[spec.grad_split_over_tp] += hi - lo
        out.append(PlannedBucket(b.padded, b.shard_size, *counts, p.zero == 3 and b not in layout.roots,
                                 b is layout.tied, b.size, id(b.params[0]) in expert))
    return out


@pytest.mark.parametrize("parallel,model", CASES, ids=lambda c: "-".join(f"{k}{v}" for k, v in c.items()))
def test_planned_buckets_are_the_runtime_layout(parallel, model):
    cfg = tiny_config(parallel=parallel, model=model, train={"global_batch": 8 * parallel.get("dp", 1)})
    for rank in range(cfg.parallel.pp):
        assert list(rank_buckets(cfg)[rank].buckets) == _runtime(cfg, rank), rank
