"""Published training runs (../shared/reference/published_runs.csv) as tetrad configs, and the
estimator's prediction of each row's figure under that row's convention."""

from __future__ import annotations

import csv
import itertools
from pathlib import Path

from tetrad.config import Config, ConfigError, load_config
from tetrad.plan import flops
from tetrad.plan.cost import Estimate, estimate
from tetrad.plan.hardware import cluster_of


def read_rows(path: Path) -> list[dict]:
    with open(path, newline="") as f:
        return list(csv.DictReader(f))


def _int(value: str, default: int | None = None) -> int | None:
    return int(value) if value not in ("", None) else default


def row_config(row: dict, micro_batch: int, vpp: int) -> Config:
    gpt = row["model"].startswith("GPT")
    layers, pp = int(row["layers"]), int(row["pp"])
    schedule = row["schedule"] or "1f1b"
    if schedule == "interleaved" and vpp < 2:
        schedule = "1f1b"
    model = {"preset": "tiny", "n_layers": layers, "d_model": int(row["hidden"]), "n_heads": int(row["heads"]),
             "n_kv_heads": int(row["kv_heads"]), "ffn_hidden": int(row["ffn"]), "seq_len": int(row["seq_len"]),
             "vocab_size": _int(row["vocab"], 51200), "norm": "layernorm" if gpt else "rmsnorm",
             "mlp": "gelu" if gpt else "swiglu", "pos": "learned" if gpt else "rope", "tie_embeddings": gpt}
    dp = int(row["dp"])
    global_batch = _int(row["global_batch"], dp * micro_batch)
    parallel = {"tp": int(row["tp"]), "pp": pp, "cp": int(row["cp"]), "dp": dp, "vpp": vpp if schedule == "interleaved" else 1,
                "schedule": schedule, "sequence_parallel": row["sequence_parallel"] == "true",
                "zero": 3 if row["id"].startswith("tt-") else 0}  # torchtitan runs FSDP2 (ZeRO-3)
    train = {"global_batch": global_batch, "micro_batch": micro_batch, "dtype": row["dtype"],
             "recompute": row["recompute"] or "none"}
    return load_config(overrides={"model": model, "parallel": parallel, "train": train}, runtime=False)


def kernels_of(row: dict) -> str:
    """The source's software stack: Megatron-LM of 2021 predates flash attention."""
    return "unfused" if row["source"].startswith("Narayanan2021") else "fused"


def best_estimate(row: dict) -> Estimate:
    """The row's layout as printed; knobs the source leaves out (micro-batch, virtual stages) are
    chosen as the planner would: the fastest that fits."""
    cluster = cluster_of(row["gpu"], int(row["gpus"]), int(row["gpus_per_node"]))
    mbs = [_int(row["micro_batch"])] if row["micro_batch"] else [1, 2, 4, 8]
    layers, pp = int(row["layers"]), int(row["pp"])
    vpps = [_int(row["vpp"])] if row["vpp"] else (
        [v for v in range(2, 9) if layers % (pp * v) == 0] or [1] if row["schedule"] == "interleaved" and pp > 1 else [1])
    best = None
    for mb, v in itertools.product(mbs, vpps):
        try:
            cfg = row_config(row, mb, v)
        except ConfigError:
            continue
        if cfg.train.global_batch % (mb * cfg.parallel.dp) or (v > 1 and cfg.microbatches % pp):
            continue
        est = estimate(cfg, cluster, kernels=kernels_of(row))
        if best is None or (est.fits, -est.step_time_s) > (best.fits, -best.step_time_s):
            best = est
    return best


def predicted_value(row: dict, est: Estimate) -> float:
    """The estimate in the row's own metric and convention."""
    metric = row["metric"]
    cfg = est.cfg
    if metric == "tflops_per_gpu_eq3":
        f = flops.narayanan_eq3_flops(cfg.train.global_batch, cfg.model.seq_len, cfg.model.n_layers,
                                      cfg.model.d_model, cfg.model.vocab_size)
        return f / (int(row["gpus"]) * est.step_time_s) / 1e12
    if metric == "tokens_per_s_per_gpu":
        return est.tokens_per_s / int(row["gpus"])
    if metric == "bubble_fraction":
        return est.bubble_fraction
    raise ValueError(f"unknown metric {metric!r}")
