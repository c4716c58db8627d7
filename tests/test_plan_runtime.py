"""The planner against real gloo runs of tetrad: collective bytes per group, and peak memory per
rank on CPU (a rank's resident-set growth) within 15%."""

from __future__ import annotations

import pytest
import torch

from tetrad.plan.comm_bytes import comm_bytes_per_step
from tetrad.plan.cost import estimate
from tetrad.plan.hardware import load_cluster
from tetrad.plan.memory import rank_model_states
from tetrad.train.trainer import Trainer

from conftest import rank_histories, run_ranks, tiny_config, train_layout

# (parallel, train, model). tools/fuzz_estimate.py found: selective recompute repeats cp's
# collectives inside the attention core; hierarchical reduction within a node (ranks_per_node 2:
# intra 2, inter 1) and across two (dp 4: intra 2, inter 2); a vocabulary padded to tp rows;
# recompute under residual dropout repeating the layer's last tp reduction (the mask follows it).
GEMMA3 = {"norm": "gemma_rmsnorm", "mlp": "geglu", "scale_embeddings": True, "sandwich_norm": True, "qk_norm": True,
          "head_dim": 24, "query_pre_attn_scalar": 20.0, "sliding_window": 5,
          "layer_types": ["sliding_attention", "full_attention"], "rope_local_base_freq": 100.0, "tie_embeddings": True}
LAYOUTS = [({"tp": 2, "sequence_parallel": True}, {}, {}), ({"dp": 2, "zero": 3}, {}, {}), ({"cp": 2}, {}, {}),
           ({"cp": 2, "cp_algo": "alltoall"}, {}, {}), ({"dp": 2, "tp": 2, "sequence_parallel": True, "zero": 1}, {}, {}),
           ({"tp": 2, "sequence_parallel": True, "sp_regather": True}, {}, {}),
           ({"cp": 2}, {"recompute": "selective"}, {}), ({"cp": 2, "cp_algo": "alltoall"}, {"recompute": "selective"}, {}),
           ({"cp": 2, "cp_algo": "alltoall"}, {"recompute": "full"}, {}),
           ({"dp": 2, "zero": 1, "hierarchical": True, "ranks_per_node": 2}, {}, {}),
           ({"dp": 4, "hierarchical": True, "ranks_per_node": 2}, {"micro_batch": 1, "global_batch": 8}, {}),
           ({"dp": 2, "tp": 2, "zero": 1}, {}, {"vocab_size": 257}), ({"dp": 2, "tp": 2, "zero": 2}, {}, {"vocab_size": 251}),
           ({"tp": 2, "sequence_parallel": True}, {"recompute": "full"}, {"dropout": 0.1}),
           ({"tp": 2}, {"recompute": "selective-op"}, {"dropout": 0.1}),
           # zero-bubble's BI makes the gradients of a bucket of no linear (embedding and learned
           # positions): reduced once a micro-batch, not once per gradient (fuzz_estimate 4542)
           ({"pp": 2, "dp": 2, "zero": 3, "schedule": "zb"}, {"micro_batch": 1}, {"norm": "layernorm", "mlp": "gelu",
                                                                                  "pos": "learned"}),
           # q, k and v biases: split over tp, reduced over dp, gathered by ZeRO-3 like the weights
           ({"dp": 2, "tp": 2, "sequence_parallel": True, "zero": 1}, {}, {"qkv_bias": True}),
           ({"dp": 2, "zero": 3}, {}, {"qkv_bias": True}),
           # qk-norm: its weights' gradients summed over tp without SP too; heads of 24 over d_model 64
           ({"tp": 2}, {}, {"qk_norm": True, "head_dim": 24}),
           ({"dp": 2, "tp": 2, "zero": 1, "grad_codec": "bf16"}, {}, {"qk_norm": True, "head_dim": 24}),
           ({"tp": 2, "sequence_parallel": True}, {}, {"qk_norm": True, "head_dim": 24}),
           # the tp-replicated gradients finalize sums are those in rank 0's shard of each bucket as
           # laid out, not an even part (fuzz_estimate 4804, 4823): qk-norm's over small buckets, and
           # under ZeRO-3 each block's bucket, whose first shard starts with the attention norm
           ({"dp": 2, "tp": 2, "zero": 1, "grad_bucket_mb": 0.01}, {}, {"qk_norm": True, "head_dim": 24}),
           ({"dp": 2, "tp": 2, "sequence_parallel": True, "zero": 3}, {}, {}),
           # buckets cut at parameters: PowerSGD's factors and int8's padding per bucket as laid out
           # (fuzz_estimate 4835)
           ({"dp": 2, "zero": 1, "grad_codec": "powersgd", "grad_bucket_mb": 0.002}, {}, {}),
           ({"dp": 2, "zero": 1, "grad_codec": "int8", "grad_bucket_mb": 0.01}, {}, {}),
           # Gemma 3: sandwich norms (replicated, summed over tp under SP) and qk-norm, per-layer windows
           ({"dp": 2, "tp": 2, "sequence_parallel": True, "zero": 1}, {}, GEMMA3),
           ({"pp": 2, "dp": 2, "zero": 3}, {}, GEMMA3),
           # under recompute the MLP's last tp reduction runs again: its output is the saved input of
           # the sandwich norm after it (fuzz_estimate 41058, 41085, 41089)
           ({"tp": 2}, {"recompute": "full"}, GEMMA3),
           ({"tp": 2, "sequence_parallel": True}, {"recompute": "selective-op"}, GEMMA3)]
# MoE (model/moe.py): the dense MLP's tp collectives, the router's gradient summed over tp (as qk-norm's),
# every expert's gradients over dp; ZeRO-3 gathers [E, H, d] tensors
MOE = {"n_experts": 4, "experts_per_token": 2, "expert_ffn_hidden": 96}
LAYOUTS += [
    ({"dp": 2, "tp": 2, "sequence_parallel": True, "zero": 1}, {}, MOE), ({"tp": 2}, {}, MOE),
    ({"dp": 2, "zero": 3}, {}, {**MOE, "mlp": "gelu"}), ({"pp": 2, "dp": 2, "zero": 2}, {"recompute": "full"}, MOE),
    # the counts summed over cp (again under full and per-op recompute); SP's regather gathers no MoE input again
    ({"tp": 2, "cp": 2, "sequence_parallel": True, "sp_regather": True}, {}, MOE),
    ({"cp": 2, "cp_algo": "alltoall"}, {"recompute": "full"}, MOE), ({"cp": 2}, {"recompute": "selective-op"}, MOE)]
# Qwen2-MoE / DeepSeek-MoE layers: a gated shared expert (dense buckets; its gate's gradient summed over tp
# as the router's) and a dense first layer, whose stage differs (its fc1 gathered again under sp_regather;
# the cp counts and the ep all-to-alls in the MoE layers alone)
SHARED = {**MOE, "shared_expert_ffn_hidden": 64, "shared_expert_gate": True, "dense_layers": [0], "n_layers": 4}
LAYOUTS += [({"pp": 2, "dp": 2, "zero": 1}, {}, SHARED),
            ({"tp": 2, "sequence_parallel": True, "sp_regather": True}, {}, SHARED),
            ({"cp": 2}, {"recompute": "full"}, {**SHARED, "normalize_expert_weights": False})]

# Multi-token prediction (model/mtp.py): rank 0 on one stage runs each depth's layer (tp, cp and ep
# collectives), embedding and head; its eh_proj's gradient summed over tp under SP; the step's sums two
# floats a depth more; over pp the embedding's copy summed with rank 0's over the "embed" group
MTP = {"mtp_layers": 2}
LAYOUTS += [({"tp": 2, "sequence_parallel": True, "dp": 2, "zero": 1}, {}, MTP), ({"tp": 2}, {"recompute": "full"}, MTP),
            ({"cp": 2}, {}, MTP), ({"pp": 2, "dp": 2, "zero": 2}, {}, MTP), ({"tp": 2, "cp": 2}, {}, {**MOE, **MTP})]
EP_LAYOUTS_MTP = [({"dp": 2, "ep": 2}, {}, {**MOE, **MTP})]


def _name(parallel: dict) -> str:
    return "-".join(f"{k}{v}" for k, v in parallel.items())


# Expert parallelism (parallel.ep): the experts' buckets over dp*cp/ep (ZeRO 0-3, under ZeRO-3 one
# per block, gathered with it; a group of one rank, ep = dp, moves nothing), the EP group's
# all-to-alls (again under full and per-op recompute), with tp+SP, pp and cp. Per rank "ep" follows
# the routing: the EP group's sum is exact (docs/planner.md).
EP_LAYOUTS = [({"dp": 2, "ep": 2}, {}, MOE), ({"dp": 4, "ep": 2, "zero": 1}, {"micro_batch": 1, "global_batch": 8}, MOE),
              ({"dp": 4, "ep": 4, "zero": 1}, {"micro_batch": 1, "global_batch": 8}, MOE),
              ({"dp": 2, "ep": 2, "tp": 2, "sequence_parallel": True, "zero": 2}, {}, MOE),
              ({"dp": 2, "ep": 2, "pp": 2}, {"recompute": "full"}, MOE),
              ({"dp": 2, "ep": 2, "cp": 2}, {"recompute": "selective-op"}, {**MOE, "mlp": "gelu"}),
              ({"dp": 2, "ep": 2, "zero": 1}, {}, SHARED),
              ({"dp": 4, "ep": 2, "zero": 3}, {"micro_batch": 1, "global_batch": 8}, MOE),
              ({"dp": 2, "ep": 2, "zero": 3}, {}, SHARED),
              ({"dp": 4, "ep": 2, "zero": 1, "grad_codec": "bf16"}, {"micro_batch": 1, "global_batch": 8}, MOE),
              ({"dp": 2, "ep": 2, "grad_codec": "bf16"}, {}, MOE),
              ({"dp": 2, "ep": 2, "zero": 3, "grad_codec": "bf16"}, {}, MOE)]  # experts alone: no bytes
# Hybrid ZeRO with ep: the experts' buckets over zero_shard/ep ranks of the block, summed over the same
# replicas as the dense ones: one rank (no reduce-scatter or gather bytes, the whole bucket over the
# replicas: fp32 under ZeRO 2/3, the wire dtype under ZeRO-1), or a dp rank's cp pair.
EP_LAYOUTS += [({"dp": 4, "ep": 2, "zero": zero, "zero_shard": 2, **codec}, {"micro_batch": 1, "global_batch": 8}, MOE)
               for zero, codec in ((1, {}), (2, {}), (3, {}), (1, {"grad_codec": "bf16"}))]
EP_LAYOUTS += [({"dp": 4, "cp": 2, "ep": 2, "zero": 2, "zero_shard": 4}, {"micro_batch": 1, "global_batch": 8}, MOE)]
EP_LAYOUTS += EP_LAYOUTS_MTP


@pytest.mark.parametrize("parallel,train,model", EP_LAYOUTS, ids=lambda p: _name(p) or "-")
def test_ep_comm_bytes_equal_the_runtime_count(parallel, train, model):
    """Every group's bytes on rank 0 as counted, "ep" but summed over rank 0's EP group: the
    planner's balanced figure times ep (the sum of the rows received is the sum of those sent)."""
    cfg = tiny_config(parallel=parallel, train={"steps": 2, "device": "cpu", **train}, model=model)
    want, ep = comm_bytes_per_step(cfg), cfg.parallel.ep
    runs = rank_histories(cfg)
    first = next(h for c, h in runs if not any(c.values()))
    group = [h for c, h in runs if c["dp"] < ep and not (c["tp"] or c["pp"] or c["cp"])]
    for step, r in enumerate(first):
        assert {**r["comm_bytes"], "ep": want["ep"]} == want, step
        assert sum(h[step]["comm_bytes"]["ep"] for h in group) == ep * want["ep"], step


@pytest.mark.parametrize("parallel,train,model", LAYOUTS, ids=lambda p: _name(p) or "-")
def test_comm_bytes_equal_the_runtime_count(parallel, train, model):
    cfg = tiny_config(parallel=parallel, train={"steps": 2, "device": "cpu", **train}, model=model)
    _, _, history = train_layout(cfg)
    assert all(r["comm_bytes"] == comm_bytes_per_step(cfg) for r in history)


def _peak(cfg):
    """This rank's peak resident-set growth over two steps (step 1 creates the optimizer state
    midway), from the trainer's start (device.start_memory_tracking): what the planner's CPU
    figure describes."""
    return Trainer(cfg, torch.device("cpu")).fit()[-1]["peak_memory_gib"]


MEMORY_LAYOUTS = [{"dp": 2}, {"cp": 2}, {"tp": 2, "sequence_parallel": True}, {"pp": 2}]
# tp=2 with SP measures 333-365 MiB against 301 predicted (+11 to +21%, run to run; 353 on
# 2026-12-03 17:19) while its counted tensors agree within 2% (test below): the extra is glibc's
# heap keeping freed blocks (with a fixed mmap threshold the rank measures 266 MiB;
# docs/planner.md), which only adds to the resident set. Bound: the others' 15% below, and above
# the retention seen plus a margin: +25%.
RETENTION_ABOVE = {"tp2-sequence_parallelTrue": 0.25}


# One micro-batch per step: with gradient accumulation glibc keeps the first micro-batch's freed
# activation blocks resident and the measured peak runs above the estimate (docs/planner.md).
@pytest.mark.parametrize("parallel", MEMORY_LAYOUTS, ids=_name)
def test_cpu_memory_estimate_within_15_percent(parallel):
    cfg = tiny_config(model={"d_model": 512, "n_heads": 8, "n_kv_heads": 2, "ffn_hidden": 1536, "seq_len": 256,
                             "vocab_size": 4096, "n_layers": 4},
                      parallel=parallel, train={"steps": 2, "device": "cpu", "warmup": 1, "micro_batch": 4,
                                                "global_batch": 4 * parallel.get("dp", 1)})
    # Spawned: a forked rank would reuse the pytest process's freed heap and seem to grow less.
    measured = max(run_ranks(_peak, cfg.parallel.world_size, cfg, spawn=True))
    predicted = estimate(cfg, load_cluster("cpu")).peak_memory_gib
    print(f"predicted {1024 * predicted:.0f} MiB, measured {1024 * measured:.0f} MiB")
    above = RETENTION_ABOVE.get(_name(parallel))
    if above is None:
        assert predicted == pytest.approx(measured, rel=0.15), (predicted, measured)
    else:
        assert 0.85 * predicted <= measured <= (1 + above) * predicted, (predicted, measured)


# Counted memory (not the resident set): every layout the runtime has, against the planner's parts
# for the same rank. The rms_norm variants (bf16, and a 16-bit single rank) keep torch's composite
# RMSNorm's two fp32 tensors per norm on CPU (tools/fuzz_estimate.py found them). `other` (buffers, fragmentation) is an allowance with nothing to count it
# against, so it is left out of both sides.
COUNTED_LAYOUTS = [(parallel, train, {}) for parallel, train in [
    ({"dp": 2, "zero": 1}, {}), ({"tp": 2, "sequence_parallel": True}, {}),
    ({"tp": 2, "sequence_parallel": True, "sp_regather": True}, {}),
    ({"pp": 2}, {}), ({"pp": 2, "vpp": 2, "schedule": "interleaved"}, {}), ({"pp": 2, "schedule": "zb"}, {}),
    ({"cp": 2}, {}), ({"dp": 2, "zero": 3}, {"dtype": "bf16"}), ({"tp": 2}, {"recompute": "full"}),
    ({"tp": 2, "sequence_parallel": True}, {"recompute": "selective-op"}),
    ({"pp": 2, "schedule": "zb"}, {"recompute": "full"}), ({}, {"dtype": "bf16"}),
    ({"tp": 2}, {"dtype": "fp16", "global_batch": 4})]]  # fp16 matmuls are slow on CPU: two micro-batches a step
# Interleaved chunks of unequal size: rank 0 holds more sets of its 3-layer chunk than of its
# 1-layer one (13 layers' sets at its peak, not 10 for two 2-layer chunks).
COUNTED_LAYOUTS += [({"pp": 2, "vpp": 2, "schedule": "interleaved", "stage_layers": [3, 1, 1, 1]}, {}, {"n_layers": 6})]
# SP with full recompute: the final norm's input is a sequence chunk, a large share of little.
COUNTED_LAYOUTS += [({"tp": 2, "sequence_parallel": True}, {"recompute": "full"}, {})]
# MoE: each token's k experts' hidden tensors, the routed copies, the router's probabilities and indices
COUNTED_LAYOUTS += [
    ({"tp": 2, "sequence_parallel": True}, {}, {"n_experts": 4}), ({"pp": 2}, {}, {"n_experts": 4, "mlp": "gelu"}),
    ({"dp": 2, "zero": 1}, {}, {"n_experts": 8, "experts_per_token": 1, "expert_ffn_hidden": 256}),
    ({"pp": 2, "schedule": "zb"}, {}, {"n_experts": 4}),
    ({"tp": 2, "sequence_parallel": True}, {"recompute": "selective-op"}, {"n_experts": 4}),
    ({"tp": 2}, {"recompute": "full"}, {"n_experts": 4})]  # the experts' weight gradients made in BI: none deferred
# qk-norm keeps q's and k's inputs; heads of 48 over d_model 256 (q 384 wide).
COUNTED_LAYOUTS += [({"tp": 2}, {}, {"qk_norm": True, "head_dim": 48})]
# Gemma 3: four norms a layer keep their inputs, qk-norm q's and k's, GeGLU as SwiGLU; one window bias
# (the sliding layers', 16 of 128) kept for every layer that has it, none for the global one.
GEMMA3_WIDE = {**{k: v for k, v in GEMMA3.items() if k not in ("head_dim", "query_pre_attn_scalar")},
               "sliding_window": 16, "layer_types": ["sliding_attention"] * 3 + ["full_attention"]}
COUNTED_LAYOUTS += [({"tp": 2, "sequence_parallel": True}, {}, GEMMA3_WIDE), ({"pp": 2}, {}, GEMMA3_WIDE)]


# Qwen2-MoE / DeepSeek-MoE layers: the shared expert's hidden tensors, its gate's output and the partial
# output it scales; the dense first layer's set on pp rank 0 beside an MoE layer's, rank 1's two MoE layers
SHARED_COUNTED = {"n_experts": 4, "shared_expert_ffn_hidden": 256, "shared_expert_gate": True, "dense_layers": [0]}
COUNTED_LAYOUTS += [({"pp": 2}, {}, SHARED_COUNTED),
                    ({"tp": 2, "sequence_parallel": True}, {}, {**SHARED_COUNTED, "normalize_expert_weights": False}),
                    ({"pp": 2, "schedule": "zb"}, {}, SHARED_COUNTED),  # the shared expert's linears defer to BW
                    ({"pp": 2, "vpp": 2, "schedule": "interleaved"}, {}, {**SHARED_COUNTED, "dense_layers": [0, 1]})]


# Expert parallelism: a rank's E/ep experts, its activations at the balanced k*tokens rows received.
EP_COUNTED_LAYOUTS = [({"dp": 2, "ep": 2, "zero": 1}, {}, {"n_experts": 4}),
                      ({"dp": 2, "ep": 2, "tp": 2, "sequence_parallel": True}, {"recompute": "full"}, {"n_experts": 4}),
                      ({"dp": 2, "ep": 2, "zero": 1}, {}, SHARED_COUNTED),
                      ({"dp": 4, "ep": 2, "zero": 3}, {}, {"n_experts": 4}),
                      ({"dp": 4, "ep": 2, "zero": 3, "zero_shard": 2}, {}, {"n_experts": 4})]


@pytest.mark.parametrize("parallel,train,model", COUNTED_LAYOUTS + EP_COUNTED_LAYOUTS, ids=lambda p: _name(p) or "-")
def test_counted_memory_matches_the_estimate_within_15_percent(parallel, train, model):
    cfg = tiny_config(model={"d_model": 256, "n_heads": 8, "n_kv_heads": 4, "ffn_hidden": 768, "seq_len": 128,
                             "n_layers": 4, **model},
                      parallel=parallel, train={"steps": 2, "device": "cpu", "warmup": 1, "micro_batch": 2,
                                                "global_batch": 8 * parallel.get("dp", 1), **train})
    est = estimate(cfg, load_cluster("cpu"))
    # The last step's counted memory: model states from the tensors, peak saved activations
    # from autograd's hooks.
    for coords, history in rank_histories(cfg):
        pp_rank, got = coords["pp"], history[-1]["memory_bytes"]
        want = est.memory_by_rank[pp_rank]
        measured = got["params"] + got["grads"] + got["optimizer"] + got["activations"]
        predicted = want.weights + want.grads + want.optimizer + want.activations
        print(f"pp rank {pp_rank}: predicted {predicted / 2**20:.2f} MiB, counted {measured / 2**20:.2f} MiB "
              f"(activations {want.activations / 2**20:.2f} vs {got['activations'] / 2**20:.2f})")
        assert predicted == pytest.approx(measured, rel=0.15), (pp_rank, want, got)
        # Alone, too: what autograd saved against the estimate less what it holds unsaved.
        assert want.activations - want.transient == pytest.approx(got["activations"], rel=0.15), (pp_rank, want, got)


@pytest.mark.parametrize("model", [{"experts_per_token": 1, "mlp": "gelu", "expert_ffn_hidden": 64},
                                   {"experts_per_token": 2, "expert_ffn_hidden": 96}], ids=["top1-gelu", "top2"])
def test_per_op_recompute_keeps_all_of_an_moe_layers_routing_matmuls(model):
    """Under selective-op an MoE layer's routing keeps every matmul's output (as torchtitan's keeps
    its grouped GEMMs') outside the "every other" count (model/llama.py): counted, the experts'
    matmuls, whose number changes with the routing, kept another set each call, 21% more at top-1
    and 14% less at top-2 than predicted (fuzz_estimate 42296). What autograd saves is now what the
    planner counts (flops.op_checkpoint_saved_matmuls), within 1%. Only the saved part is compared:
    the layer rebuilt in backward, which the planner counts as transient, is no saved tensor."""
    cfg = tiny_config(model={"d_model": 256, "n_heads": 8, "n_kv_heads": 4, "ffn_hidden": 768, "seq_len": 128,
                             "n_layers": 4, "n_experts": 4, **model},
                      parallel={"tp": 2}, train={"steps": 2, "device": "cpu", "warmup": 1, "micro_batch": 2,
                                                 "global_batch": 8, "recompute": "selective-op"})
    want = estimate(cfg, load_cluster("cpu")).memory_by_rank[0]
    for _, history in rank_histories(cfg):
        assert want.activations - want.transient == pytest.approx(history[-1]["memory_bytes"]["activations"], rel=0.03)


def _states_by_shard(cfg):
    """(this rank's index in the group ZeRO shards over, its pipeline rank, its model states
    after two steps: GradReducer.model_state_bytes)."""
    trainer = Trainer(cfg, torch.device("cpu"))
    got = trainer.fit()[-1]["memory_bytes"]
    topo = trainer.topo
    return topo.local_rank(topo.zero_groups()[0]), topo.coords["pp"], [got[k] for k in ("params", "grads", "optimizer")]


# fuzz_estimate 4983, 5053, 5209: int8 pads each bucket to 256 x dp x cp elements, a tenth of a
# 2 KB bucket. ZeRO-1 fp32 (moments over the parameters in the owned shard only: the last holds
# the padding), ZeRO-0 bf16 (padded weights and masters); ZeRO-2 over 3 ranks, which divide no
# bucket; hybrid ZeRO-3 bf16 (a shard of each bucket, the moments by the rank's place in its block).
TINY_BUCKETS = [({"dp": 2, "zero": 1, "grad_codec": "int8", "grad_bucket_mb": 0.002}, {}, {}),
                ({"dp": 2, "pp": 2, "zero": 0, "grad_codec": "int8", "grad_bucket_mb": 0.002}, {"dtype": "bf16"}, {}),
                ({"dp": 3, "zero": 2, "grad_bucket_mb": 0.002}, {"dtype": "bf16", "micro_batch": 1, "global_batch": 6},
                 {}),
                ({"dp": 4, "zero": 3, "zero_shard": 2, "grad_bucket_mb": 0.002}, {"dtype": "bf16", "micro_batch": 1},
                 {})]


# Expert parallelism: the experts' buckets padded for dp*cp/ep, each rank's moments at its place in that group
# (ZeRO-3: its weights' shard too); a dense layer of an MoE model holds its whole MLP at every ep.
EXPERTS = {"n_experts": 4, "expert_ffn_hidden": 96}
EP_TINY_BUCKETS = [({"dp": 4, "ep": 2, "zero": 1, "grad_bucket_mb": 0.002}, {"dtype": "bf16", "micro_batch": 1},
                    EXPERTS),
                   ({"dp": 2, "cp": 2, "ep": 2, "zero": 2, "grad_bucket_mb": 0.002}, {"micro_batch": 1}, EXPERTS),
                   ({"dp": 4, "ep": 2, "zero": 3}, {"dtype": "bf16", "micro_batch": 1}, EXPERTS),
                   ({"dp": 2, "ep": 2}, {}, {**EXPERTS, "dense_layers": [1]}),
                   # hybrid ZeRO: the experts' shards over zero_shard/ep ranks (one; a dp rank's cp pair)
                   ({"dp": 4, "ep": 2, "zero": 3, "zero_shard": 2, "grad_bucket_mb": 0.002},
                    {"dtype": "bf16", "micro_batch": 1}, EXPERTS),
                   ({"dp": 4, "cp": 2, "ep": 2, "zero": 1, "zero_shard": 4, "grad_bucket_mb": 0.002}, {"micro_batch": 1},
                    EXPERTS)]
# Multi-token prediction: the last stage's depths after its head (ZeRO-3: their blocks gathered as the
# layers'), the embedding's copy in a bucket of its own
EP_TINY_BUCKETS += [({"dp": 2, "pp": 2, "zero": 1, "grad_bucket_mb": 0.002}, {"dtype": "bf16"}, {"mtp_layers": 2}),
                    ({"dp": 4, "ep": 2, "zero": 3}, {"dtype": "bf16", "micro_batch": 1}, {**EXPERTS, "mtp_layers": 1})]


@pytest.mark.parametrize("parallel,train,model", TINY_BUCKETS + EP_TINY_BUCKETS, ids=lambda p: _name(p) or "-")
def test_model_states_are_the_runtimes_padded_buckets_to_the_byte(parallel, train, model):
    """Weights, gradients and optimizer state are what the runtime allocates, byte for byte, on
    every rank: buckets with their padding, AdamW's moments without it (rank_model_states); the
    estimate's are shard 0's, the most. Before, the planner counted the parameters unpadded and
    evenly sharded: 2.0-4.1% under the runtime with these buckets."""
    cfg = tiny_config(parallel=parallel, train={"steps": 2, "device": "cpu", **train}, model=model)
    est = estimate(cfg, load_cluster("cpu"))
    for shard, pp, got in run_ranks(_states_by_shard, cfg.parallel.world_size, cfg):
        assert got == list(rank_model_states(cfg, shard)[pp]), (shard, pp, got)
        held = [getattr(est.memory_by_rank[pp], k) for k in ("weights", "grads", "optimizer")]
        assert held == list(rank_model_states(cfg)[pp]) and all(a >= b for a, b in zip(held, got)), (held, got)


@pytest.mark.parametrize("schedule", ["1f1b", "zb"])
def test_the_last_stage_keeps_the_mtp_depths_activations(schedule):
    """Multi-token prediction's depths keep, per micro-batch waiting on the last stage, a layer's
    set (activations.chunk_weights: zero-bubble holds its BI-to-BW remainder as a layer's), their
    norms' and eh_proj's inputs and a head's (mtp_saved_bytes): the estimate's saved activations
    are the runtime's count within 5% (counted on 2026-12-07 with stage_layers [2, 2]: +2.8% 1F1B,
    -0.1% zero-bubble; -12% under zero-bubble when the depths' layers were counted as the head's)."""
    cfg = tiny_config(model={"d_model": 128, "n_heads": 4, "n_kv_heads": 2, "ffn_hidden": 384, "seq_len": 128,
                             "n_layers": 4, "vocab_size": 4096, "mtp_layers": 2},
                      parallel={"pp": 2, "schedule": schedule, "stage_layers": [2, 2]}, train={"steps": 2, "device": "cpu", "warmup": 1,
                                                                       "micro_batch": 2, "global_batch": 8})
    want = estimate(cfg, load_cluster("cpu")).memory_by_rank[-1]
    last = [history[-1]["memory_bytes"] for coords, history in rank_histories(cfg) if coords["pp"] == 1][0]
    assert want.activations - want.transient == pytest.approx(last["activations"], rel=0.05), (want, last)


def test_zero_bubble_does_not_hold_the_logits_gradient_until_bw():
    """A vocabulary that dwarfs the layers: the head's weight gradient is made in BI, so the
    logits' fp32 gradient (16 MiB a micro-batch here: the estimate's `transient`) is not kept in
    the queue until BW. When it was, the last stage counted 42.3 MiB of saved activations against
    the estimate's 26.3."""
    cfg = tiny_config(model={"d_model": 256, "n_heads": 8, "n_kv_heads": 4, "ffn_hidden": 768, "seq_len": 128,
                             "n_layers": 4, "vocab_size": 16384},
                      parallel={"pp": 2, "schedule": "zb"}, train={"steps": 2, "device": "cpu", "warmup": 1,
                                                                    "micro_batch": 2, "global_batch": 8})
    want = estimate(cfg, load_cluster("cpu")).memory_by_rank[-1]
    last = [history[-1]["memory_bytes"] for coords, history in rank_histories(cfg) if coords["pp"] == 1][0]
    assert want.activations - want.transient == pytest.approx(last["activations"], rel=0.15), (want, last)


def test_ring_attention_under_the_per_op_policy_is_kept_once_and_not_resent():
    """selective-op under ring cp keeps the ring's merged output and log-sum-exp once per layer
    and replays them in the recompute (model/replay.py RingReplay): every cp rank counts what
    the estimate says (within 15%), the last as much as the first, and the ring sends what it
    sends without recompute. (When the policy saw the block kernels inside the ring, it kept
    every ring step's output: 2.64 / 2.78 / 2.91 / 3.05 MB on cp ranks 0-3; and the recompute ran
    the ring again, 13.6 MB of cp bytes a step against 10.5.)"""
    model = {"d_model": 256, "n_heads": 8, "n_kv_heads": 4, "ffn_hidden": 768, "seq_len": 128, "n_layers": 4}
    train = {"steps": 2, "device": "cpu", "warmup": 1, "micro_batch": 2, "global_batch": 8}
    cfg, plain = (tiny_config(model=model, parallel={"cp": 4}, train={**train, "recompute": recompute})
                  for recompute in ("selective-op", "none"))
    want = estimate(cfg, load_cluster("cpu")).memory_by_rank[0]
    runs = {coords["cp"]: history[-1] for coords, history in rank_histories(cfg)}
    counted = [runs[rank]["memory_bytes"]["activations"] for rank in range(4)]
    assert all(c == pytest.approx(want.activations - want.transient, rel=0.15) for c in counted), (want, counted)
    assert counted[3] == pytest.approx(counted[0], rel=0.01), counted
    plain_cp = {history[-1]["comm_bytes"]["cp"] for _, history in rank_histories(plain)}
    assert {r["comm_bytes"]["cp"] for r in runs.values()} == plain_cp == {comm_bytes_per_step(cfg)["cp"]}, plain_cp


@pytest.mark.parametrize("recompute", ["selective-op", "full"])
def test_zero_bubble_last_stage_peak_counts_the_head_only_while_a_loss_waits(recompute):
    """Under recompute a layer's BI-to-BW remainder outweighs its kept set, so zero-bubble's
    last stage peaks after a BI, when no loss waits: the head's outputs are not at that peak.
    Adding the most waiting losses to the most held sets over-stated it: +19.7% (selective-op)
    and +41.6% (full) at vocabulary 4096; counted and estimated now agree within 0.1%."""
    cfg = tiny_config(model={"d_model": 256, "n_heads": 8, "n_kv_heads": 4, "ffn_hidden": 768, "seq_len": 128,
                             "n_layers": 4, "vocab_size": 4096},
                      parallel={"pp": 2, "schedule": "zb"}, train={"steps": 2, "device": "cpu", "warmup": 1,
                                                                    "micro_batch": 2, "global_batch": 8,
                                                                    "recompute": recompute})
    want = estimate(cfg, load_cluster("cpu")).memory_by_rank[-1]
    last = [history[-1]["memory_bytes"] for coords, history in rank_histories(cfg) if coords["pp"] == 1][0]
    assert want.activations - want.transient == pytest.approx(last["activations"], rel=0.02), (want, last)


def test_zero_bubble_full_recompute_peak_has_none_of_the_heads_transient():
    """Full recompute, a layer's set no more than its input: each stage peaks as a BI ends, beside
    the earlier micro-batch's remainder, when no loss waits, so none of the head's transient (the
    logits' gradient) is at the peak. Subtracting the most waiting losses' transient put this draw
    (fuzz_estimate seed 4045) 17% under the count; leaving out the checkpointed input the BI holds
    until its first layer's backward ends (simulate.peak_held's `bi_end`), 3.4% under on the last
    stage and 9.7% on the first (fuzz_estimate 42217, an MoE model's first stage: 16%)."""
    cfg = tiny_config(model={"n_layers": 2, "d_model": 64, "n_heads": 4, "n_kv_heads": 4, "ffn_hidden": 128,
                             "vocab_size": 251, "seq_len": 32},
                      parallel={"pp": 2, "schedule": "zb"}, train={"steps": 2, "device": "cpu", "warmup": 1,
                                                                    "micro_batch": 1, "global_batch": 2,
                                                                    "recompute": "full"})
    want = estimate(cfg, load_cluster("cpu")).memory_by_rank
    for coords, history in rank_histories(cfg):
        got, plan = history[-1]["memory_bytes"], want[coords["pp"]]
        assert plan.activations - plan.transient == pytest.approx(got["activations"], rel=0.02), (coords, plan, got)


def test_tied_embedding_sum_moves_the_embedding_not_its_buckets_padding():
    """The tied embedding's gradient summed over its two stages is the embedding's elements: with
    int8's block-aligned buckets the whole padded bucket went (fuzz_estimate seed 4017: pp bytes
    1,280 a step above the planner's)."""
    cfg = tiny_config(parallel={"pp": 2, "cp": 2, "zero": 1, "grad_codec": "int8"},
                      model={"tie_embeddings": True, "vocab_size": 258, "n_layers": 2},
                      train={"steps": 1, "device": "cpu", "micro_batch": 1, "global_batch": 4})
    _, _, history = train_layout(cfg)
    assert history[-1]["comm_bytes"]["pp"] == comm_bytes_per_step(cfg)["pp"]


def test_sp_regather_keeps_the_heads_input_as_a_sequence_chunk():
    """Under sp_regather every column-parallel input is kept as this rank's sequence chunk and
    gathered again in backward, the head's too: the estimate kept the head's gathered (fuzz_estimate
    seeds 4005 and 4110, +15.7% and +22.4% on two-layer models; this one +13.9%, now +3.5%)."""
    cfg = tiny_config(model={"n_layers": 2, "d_model": 96, "n_heads": 4, "n_kv_heads": 4, "ffn_hidden": 96,
                             "vocab_size": 257, "seq_len": 48},
                      parallel={"tp": 4, "sequence_parallel": True, "sp_regather": True},
                      train={"steps": 2, "device": "cpu", "warmup": 1, "micro_batch": 4, "global_batch": 4})
    want = estimate(cfg, load_cluster("cpu")).memory_by_rank[0]
    for coords, history in rank_histories(cfg):
        got = history[-1]["memory_bytes"]["activations"]
        assert want.activations - want.transient == pytest.approx(got, rel=0.06), (coords, want, got)
