"""Published training runs (reference_runs/published_runs.csv, shipped with the package; its
README says where each row comes from) as tetrad configs, and the estimator's prediction of each
row's figure under that row's convention. Rows marked `held_out` informed no constant: the
model's error on them is the honest one."""

from __future__ import annotations

import csv
import itertools
from pathlib import Path

from tetrad.config import Config, ConfigError, load_config
from tetrad.parallel.pipeline.registry import SCHEDULES, check_config
from tetrad.model import flops
from tetrad.plan.cost import Estimate, estimate
from tetrad.plan.hardware import cluster_of


REFERENCE_RUNS = Path(__file__).with_name("reference_runs") / "published_runs.csv"


# The model's mean absolute percentage error over the calibration runs of the reference file, as
# tests/test_plan_calibration.py prints it (a test keeps this figure within half a point of that): the spread
# `tetrad plan` puts around each prediction.
CALIBRATION_MAPE = 0.057

# The model family of each `arch`: Megatron's GPT (LayerNorm, GELU, learned positions, tied, with
# dropout), Llama (RMSNorm, SwiGLU, RoPE, untied), MosaicML's MPT (GPT's, without dropout).
ARCHES = {"gpt": dict(norm="layernorm", mlp="gelu", pos="learned", tie_embeddings=True, dropout=0.1),
          "llama": dict(norm="rmsnorm", mlp="swiglu", pos="rope", tie_embeddings=False, dropout=0.0),
          "mpt": dict(norm="layernorm", mlp="gelu", pos="learned", tie_embeddings=True, dropout=0.0)}


def read_rows(path: Path = REFERENCE_RUNS, held_out: bool | None = None) -> list[dict]:
    """The rows of a published-runs CSV, by default the package's own; only the calibration
    (held_out=False) or the held-out ones (True) when asked."""
    with open(path, newline="") as f:
        rows = list(csv.DictReader(f))
    return [r for r in rows if held_out is None or (r["held_out"] == "yes") == held_out]


def _int(value: str | None, default: int | None = None) -> int | None:
    return int(value) if value not in ("", None) else default


def row_config(row: dict, micro_batch: int, vpp: int) -> Config:
    """The row's model and layout. A tied GPT on several pipeline stages keeps a copy of the
    embedding on the last one either way, which is what the estimate counts, and tetrad's config
    only takes untied weights there."""
    schedule = row["schedule"] or "1f1b"
    if SCHEDULES[schedule].interleaved and vpp < 2:
        schedule = "1f1b"
    pp = int(row["pp"])
    arch = dict(ARCHES[row["arch"]])
    model = {"n_layers": int(row["layers"]), "d_model": int(row["hidden"]), "n_heads": int(row["heads"]),
             "n_kv_heads": int(row["kv_heads"]), "ffn_hidden": int(row["ffn"]), "seq_len": int(row["seq_len"]),
             "vocab_size": _int(row["vocab"], 51200), **arch}
    dp = int(row["dp"])
    parallel = {"tp": int(row["tp"]), "pp": pp, "cp": int(row["cp"]), "dp": dp,
                "vpp": vpp if SCHEDULES[schedule].interleaved else 1, "schedule": schedule,
                "sequence_parallel": row["sequence_parallel"] == "true", "zero": int(row["zero"])}
    train = {"global_batch": _int(row["global_batch"], dp * micro_batch), "micro_batch": micro_batch,
             "dtype": row["dtype"], "recompute": row["recompute"] or "none"}
    cfg = load_config(overrides={"model": {"preset": "tiny", **model}, "parallel": parallel, "train": train},
                      runtime=False)
    check_config(cfg)
    return cfg


def best_estimate(row: dict) -> Estimate:
    """The row's layout as printed; knobs the source leaves out (micro-batch size, virtual stages)
    are chosen as the planner would: the fastest that fits."""
    cluster = cluster_of(row["gpu"], int(row["gpus"]), int(row["gpus_per_node"]))
    layers, pp = int(row["layers"]), int(row["pp"])
    mbs = [_int(row["micro_batch"])] if row["micro_batch"] else [1, 2, 4, 8]
    if row["vpp"]:
        vpps = [_int(row["vpp"])]
    elif row["schedule"] and SCHEDULES[row["schedule"]].interleaved and pp > 1:
        vpps = [v for v in range(2, 9) if layers % (pp * v) == 0] or [1]
    else:
        vpps = [1]
    best = None
    for mb, v in itertools.product(mbs, vpps):
        try:
            cfg = row_config(row, mb, v)
        except ConfigError:  # e.g. fewer micro-batches than the schedule needs
            continue
        est = estimate(cfg, cluster, stack=row["stack"])
        if best is None or (est.fits, -est.step_time_s) > (best.fits, -best.step_time_s):
            best = est
    return best


def predicted_value(row: dict, est: Estimate) -> float:
    """The estimate in the row's own metric and convention."""
    metric, cfg = row["metric"], est.cfg
    if metric == "tflops_per_gpu_eq3":
        f = flops.narayanan_eq3_flops(cfg.train.global_batch, cfg.model.seq_len, cfg.model.n_layers,
                                      cfg.model.d_model, cfg.model.vocab_size)
        return f / (int(row["gpus"]) * est.step_time_s) / 1e12
    if metric == "tokens_per_s_per_gpu":
        return est.tokens_per_s / int(row["gpus"])
    if metric == "bubble_fraction":
        return est.bubble_fraction
    if metric == "mfu":
        return est.mfu
    raise ValueError(f"unknown metric {metric!r}")


# ----------------------------------------------------------------------------- agreement

def kendall_tau(published: list[float], predicted: list[float]) -> float | None:
    """Rank agreement of two orderings of the same runs: (concordant - discordant pairs) / pairs,
    1 when the planner orders them as measured, -1 when reversed; None with fewer than 2 runs."""
    pairs = [(i, j) for i in range(len(published)) for j in range(i + 1, len(published))]
    if not pairs:
        return None
    signs = [(published[i] - published[j]) * (predicted[i] - predicted[j]) for i, j in pairs]
    return sum((s > 0) - (s < 0) for s in signs) / len(pairs)


def agreement(results: list[tuple[str, str, float, float]]) -> dict[str, dict]:
    """Per source (and "all"): MAPE over its runs and Kendall's tau over the pairs the ranking
    question is about, runs of one source on one model and cluster (`group`), pooled over groups.
    `results` are (source, group, published, predicted)."""
    out: dict[str, dict] = {}
    for source in sorted({r[0] for r in results}) + ["all"]:
        mine = [r for r in results if source in ("all", r[0])]
        net = pairs = 0  # concordant minus discordant pairs, pairs
        for group in {(r[0], r[1]) for r in mine}:
            runs = [r for r in mine if (r[0], r[1]) == group]
            tau = kendall_tau([r[2] for r in runs], [r[3] for r in runs])
            if tau is not None:
                n = len(runs) * (len(runs) - 1) // 2
                net, pairs = net + tau * n, pairs + n
        mape = 100 * sum(abs(r[3] / r[2] - 1) for r in mine) / len(mine)
        out[source] = {"runs": len(mine), "mape": mape, "pairs": pairs, "tau": net / pairs if pairs else None}
    return out


def ranking_group(row: dict) -> str:
    """What a source's runs must share to be ranked against each other: the model's size, the GPUs
    and their number, and the metric."""
    return f"{row['layers']}x{row['hidden']}/{row['gpus']}x{row['gpu']}/{row['metric']}"


def format_agreement(summary: dict[str, dict]) -> str:
    lines = [f"{'source':<28}{'runs':>5}{'MAPE':>8}{'pairs':>7}{'tau':>7}"]
    for source, s in summary.items():
        tau = "-" if s["tau"] is None else f"{s['tau']:+.2f}"
        lines.append(f"{source:<28}{s['runs']:>5}{s['mape']:>7.1f}%{s['pairs']:>7}{tau:>7}")
    return "\n".join(lines)
