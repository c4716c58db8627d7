"""Seeded draws of layouts for parity runs (tests/test_drawn_layouts.py and tools/fuzz_layouts.py):
dp/tp/pp/cp (2, 4 or 8 ranks) with ZeRO 0-3, the four schedules and virtual stages, sequence
parallelism and its regather, both cp algorithms, codecs, bucket sizes, hierarchical reduction
("auto" included), the tiny model's shapes varied (GQA, odd vocabularies, tied, GPT-style,
uneven stage splits), micro/global batches and their ramp-up, clipping, dtypes, recompute, offload,
validation and document masking, and (the fuzzers') hybrid ZeRO's blocks, mixtures of experts
(with expert parallelism half the time dp allows it), multi-head latent attention and
multi-token prediction.
Each draw is a pure function of its seed; a few are invalid on purpose (validation must refuse
them with one line that names the fix)."""

from __future__ import annotations

import random
import time
from collections.abc import Iterator

from conftest import doc_shards, sft_shards, tiny_config
from tetrad.config import ConfigError
from tetrad.parallel.pipeline.registry import check_config as check_pipeline

SCHEDULES = ("gpipe", "1f1b", "interleaved", "zb")


def parity_atol(parallel: dict) -> float:
    """assert_parity's parameter bound for a layout: tests/test_cp.py's and tests/test_tp.py's,
    for the reasons written there. ZeRO-2/3 reduce-scatter each micro-batch's gradient and add
    the shards, another order of sums than ZeRO-0/1's one all-reduce of the accumulated gradient,
    which AdamW's g/sqrt(v) amplifies on a near-zero gradient: seed 1051 (dp2, ZeRO-3, three
    micro-batches a rank) moves one element of 4096 in layers.1.attn.wo.weight by 1.35e-5 on an
    AMD EPYC's BLAS (ZeRO-0: 4.5e-6 on the same element; every other within 1e-6)."""
    if parallel["cp"] > 1:
        return 2e-4
    if parallel["tp"] > 1:
        return 1e-4
    return 2e-5 if parallel.get("zero", 0) >= 2 else 1e-5


def factor(world: int, rng: random.Random) -> dict:
    """dp, tp, pp, cp with product `world`, drawn by splitting its factors of 2 at random."""
    sizes = {"dp": 1, "tp": 1, "pp": 1, "cp": 1}
    while world > 1:
        sizes[rng.choice(list(sizes))] *= 2
        world //= 2
    return sizes


def seeds(first: int, count: int, budget_s: float) -> Iterator[int]:
    """The fuzzers' seeds from `first`, `count` of them, none started after `budget_s` seconds."""
    start = time.perf_counter()
    for seed in range(first, first + count):
        if time.perf_counter() - start > budget_s:
            print(f"budget spent; next seed {seed}", flush=True)
            return
        yield seed


def uneven_split(n_layers: int, stages: int, rng: random.Random) -> list[int]:
    """Layers of each of `stages` pipeline stages (parallel.stage_layers), cut at random."""
    cuts = sorted(rng.sample(range(1, n_layers), stages - 1))
    return [b - a for a, b in zip([0] + cuts, cuts + [n_layers])]


def draw(seed: int, extended: bool = False) -> dict:
    """Config overrides (model, parallel, train) for one draw; `extended` (the fuzzers') also draws
    document masking, batch ramp-up and loss-masked (SFT) data, after every other choice (so a
    seed's layout is the same).
    The suite's fixed seeds draw without: at global batches of 2, Adam's cancellations carry fp32
    rounding past tp's parity bound (tests/test_drawn_layouts.py)."""
    rng = random.Random(seed)
    world = rng.choices([2, 4, 8], weights=[4, 5, 1])[0]
    par = factor(world, rng)
    schedule = rng.choice(SCHEDULES if par["pp"] > 1 else ("1f1b",))
    par["schedule"] = schedule
    par["vpp"] = rng.choice([2, 2, 3]) if schedule == "interleaved" else 1
    par["zero"] = rng.randint(0, 3)
    if par["tp"] > 1 and rng.random() < 0.6:
        par["sequence_parallel"] = True
        par["sp_regather"] = rng.random() < 0.4
    if par["cp"] > 1:
        par["cp_algo"] = rng.choice(["ring", "alltoall"])
    if rng.random() < 0.2:
        par["grad_codec"] = rng.choice(["bf16", "int8", "powersgd"])
        par["zero"] = rng.choice([0, 1, 1, 2])  # 2: refused
    if rng.random() < 0.3:
        par["grad_bucket_mb"] = rng.choice([0.002, 0.01, 0.05, "auto"])  # several buckets, or measured
    if par["dp"] * par["cp"] >= 2 and rng.random() < 0.15:
        par["hierarchical"] = rng.choice([True, True, "auto"])
        if par["hierarchical"] is True:
            par["zero"] = rng.choice([0, 1, 1, 3])  # 3: refused
            par.pop("grad_codec", None)
        par["ranks_per_node"] = par["tp"] * rng.choice([1, 2])
    stages = par["pp"] * par["vpp"]
    split = par["tp"] * (par["cp"] if par.get("cp_algo") == "alltoall" else 1)
    d_model = rng.choice([64, 64, 96])
    heads = [h for h in ((4, 8) if d_model == 64 else (4, 6, 12)) if h % split == 0] or [split]
    model = {"n_layers": max(2, rng.choice([stages, stages, stages + 1, 2 * stages])), "d_model": d_model,
             "n_heads": rng.choice(heads), "ffn_hidden": rng.choice([128, 128, 96, 192]),
             "tie_embeddings": rng.random() < 0.35, "vocab_size": rng.choice([251, 256, 257, 258]),
             "seq_len": rng.choice([32, 32, 48, 64])}
    kv = [h for h in range(1, model["n_heads"] + 1) if model["n_heads"] % h == 0]
    model["n_kv_heads"] = rng.choice([h for h in kv if h % split == 0] if rng.random() < 0.9 else kv)
    if rng.random() < 0.2:
        model.update(norm="layernorm", mlp="gelu", pos="learned")
    if stages > 1 and rng.random() < 0.15 and model["n_layers"] > stages:
        par["stage_layers"] = uneven_split(model["n_layers"], stages, rng)
    micro = rng.choice([1, 1, 2, 4])
    need = par["pp"] * (2 if schedule == "interleaved" else 1)
    m = rng.choice([1, 2, 3, 4]) if par["pp"] == 1 else rng.choice([need, need, need + 1, 2 * need])
    train = {"steps": 3, "warmup": 1, "lr": 5e-3, "micro_batch": micro, "global_batch": micro * par["dp"] * m,
             "grad_clip": rng.choice([1.0, 1.0, 0.0, 0.05]),
             "dtype": rng.choices(["fp32", "bf16", "fp16"], weights=[7, 2, 1])[0],
             "recompute": rng.choice(["none", "none", "selective", "selective-op", "full"])}
    if rng.random() < 0.1:
        train["offload_optimizer"] = True
    if rng.random() < 0.1:
        train["global_batch"] += rng.choice([1, micro])  # sometimes invalid
    data = {}
    if rng.random() < 0.25:  # validation in the training layout, at step 2 and the last
        data["val_fraction"] = 0.05
        train.update(eval_every=2, eval_steps=2)
    if extended and rng.random() < 0.15:  # document masking needs shards whose index names the EOS
        train["document_mask"], data["source"], model["vocab_size"] = True, doc_shards(), 256
    fewest = max(1, need if par["pp"] > 1 else 1)  # micro-batches per dp rank the schedule needs
    if extended and m > fewest and rng.random() < 0.15:  # a ramp-up from the fewest over the run's 3 steps
        rows = micro * par["dp"]
        train["batch_rampup"] = [rows * fewest, rows, rng.choice([1, 2]) * rows * fewest]
    if extended and rng.random() < 0.15:  # supervised fine-tuning data: a loss mask (its index names the EOS too)
        data["source"], model["vocab_size"] = sft_shards(), 256
    if extended and rng.random() < 0.15:  # Qwen2's biases on the q, k and v projections
        model["qkv_bias"] = True
    if extended and rng.random() < 0.15:  # Qwen3's qk-norm, with heads of their own width
        model.update(qk_norm=True, head_dim=rng.choice([8, 16, 24]))
    replicas = par["dp"] * par["cp"]
    if extended and par["zero"] >= 1 and replicas > 1 and rng.random() < 0.2:  # hybrid ZeRO's blocks
        par["zero_shard"] = rng.choice([s for s in range(1, replicas + 1) if replicas % s == 0])
    if extended and rng.random() < 0.15:  # a sliding window, shorter or longer than a cp chunk (not 1:
        # a token that sees itself alone gives q and k no gradient but rounding noise, which AdamW
        # turns into steps that differ by layout and change nothing: fuzz seeds 64039, 67022)
        model["sliding_window"] = rng.choice([2, 3, 8, 20])
    if extended and "source" in data and rng.random() < 0.5:  # shards whose index names the EOS: position reset
        train["reset_positions"] = True
    if extended and model.get("pos") != "learned" and rng.random() < 0.15:  # Gemma 3's block: a sliding layer
        # with its own RoPE, then global ones
        model.update(norm="gemma_rmsnorm", mlp="geglu", scale_embeddings=True, sandwich_norm=True, qk_norm=True,
                     query_pre_attn_scalar=rng.choice([0.0, 20.0]), sliding_window=model.get("sliding_window") or 5,
                     layer_types=["sliding_attention"] + ["full_attention"] * (model["n_layers"] - 1),
                     rope_local_base_freq=100.0)
    if extended and rng.random() < 0.15:  # a mixture of experts in every layer (model/moe.py)
        model.update(moe_model(rng))
        ep = [e for e in (2, 4) if par["dp"] % e == 0 and model["n_experts"] % e == 0]
        if ep and rng.random() < 0.5:  # its experts over blocks of dp ranks (refused with a zero_shard not a multiple of ep x cp)
            par["ep"] = rng.choice(ep)
    if extended and rng.random() < 0.2:  # DeepSeek's multi-head latent attention (model/latent_attention.py)
        model.update(latent_model(rng, model["n_heads"]))
        model.pop("head_dim", None)
    if extended and not model.get("layer_types") and rng.random() < 0.2:  # DeepSeek-V3's multi-token prediction
        # (model/mtp.py; refused with per-layer kinds, Gemma 3's): 1 or 2 depths after the last layer
        model.update(mtp_layers=rng.choice([1, 2]), mtp_loss_weight=rng.choice([0.1, 0.3, 1.0]))
    if extended and rng.random() < 0.2:  # the head and its loss fused, a few tokens of logits at a time
        # (model/chunked_loss.py)
        train["loss_chunk_tokens"] = rng.choice([7, 24, 64])
    return {"model": model, "parallel": par, "train": train, "data": data}


def latent_model(rng: random.Random, heads: int) -> dict:
    """[model] keys of multi-head latent attention: a query latent or none (DeepSeek-V2-Lite's),
    latents and head widths of a few sizes, an odd q/k width among them, values no wider; and what
    it refuses set to what it takes (a key per query head, RoPE, RMSNorm, no qk-norm or biases: a
    GPT-style or Gemma 3 draw keeps the rest of its block)."""
    nope, rope = rng.choice([4, 8, 12, 5]), rng.choice([2, 4, 8])
    return {"kv_lora_rank": rng.choice([8, 16, 32]), "q_lora_rank": rng.choice([0, 16, 24]), "qk_nope_head_dim": nope,
            "qk_rope_head_dim": rope, "v_head_dim": rng.randint(2, nope + rope), "n_kv_heads": heads,
            "pos": "rope", "norm": "rmsnorm", "qk_norm": False, "qkv_bias": False, "query_pre_attn_scalar": 0.0}


def moe_model(rng: random.Random) -> dict:
    """[model] keys of a mixture of experts: 2 or 4 experts, top-k of any k; a third of the time
    experts of their own width (multiples of 8: every drawn tp splits them, as validation needs;
    the dense widths, 96 to 192, too); no load-balancing loss, the default, or one whose gradient
    shows (1.0); a third of the time expert biases that move (a rate large enough to change the
    picks within 3 steps), and a third sigmoid scores, scaled, picked in groups where k fits one. No draw compiles, MoE or not (tests/test_compile.py compiles MoE layouts)."""
    experts = rng.choice([2, 4])
    keys = {"n_experts": experts, "experts_per_token": rng.randint(1, experts),
            "router_aux_loss": rng.choice([0.0, 0.01, 1.0])}
    if rng.random() < 0.33:
        keys["expert_ffn_hidden"] = rng.choice([24, 40, 64])
    if rng.random() < 0.33:  # drawn after the keys above: their draws are what they were
        keys["router_bias_update_rate"] = 0.05
    if rng.random() < 0.33:  # DeepSeek-V3's routing (model/routing.py), in two groups of 2 where k fits one
        keys.update(router_score="sigmoid", expert_weight_scale=2.5)
        if experts == 4 and keys["experts_per_token"] <= 2:
            keys.update(expert_groups=2, expert_groups_per_token=1)
    return keys


def reference_of(overrides: dict) -> dict:
    """The one-process config of the same model and train settings (no offload: same arithmetic).
    A fused, chunked loss stays: unfused, its sums run in another order, which AdamW without
    clipping amplified past the micro-batch bound in 3 steps (seed 79863: 8.6e-4 on a weight, one
    process chunked against unfused alike; first-step gradients 5e-7 apart). tests/test_chunked_loss.py
    holds the fused loss to the unfused one."""
    train = {k: v for k, v in overrides["train"].items() if k != "offload_optimizer"}
    return {"model": overrides["model"], "train": train, "data": overrides.get("data", {})}


def resume_pair(seed: int, extended: bool = False) -> dict | None:
    """Layout A trains 4 steps, saving at step 2; layout B, another draw over the same model and
    train config (its own micro_batch), resumes from step 2. fp32 without codecs, for parity."""
    a = draw(seed, extended)
    a["train"].update(steps=4, dtype="fp32")
    a["parallel"].pop("grad_codec", None)
    for k in range(1, 40):
        b = draw(seed * 1000 + k, extended)
        b["parallel"].pop("grad_codec", None)
        b_train = {**a["train"], "micro_batch": b["train"]["micro_batch"]}
        try:
            check_pipeline(tiny_config(model=a["model"], parallel=b["parallel"], train=b_train, data=a["data"]))
        except ConfigError:
            continue
        return {"a": a, "b": {"model": a["model"], "parallel": b["parallel"], "train": b_train, "data": a["data"]}}
    return None
