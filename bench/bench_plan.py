"""The planner's speed and accuracy, printed (never asserted):

1. `tetrad plan` wall time for llama3-70b on 1024 H100 (8 per node), global batch 1024 x 8192
   tokens, and llama3-405b on 16384 H100 (targets: under 2 s and 10 s on a 2-core machine);
2. the reference runs (src/tetrad/plan/reference_runs/published_runs.csv), as tests/test_plan.py checks them;
3. published runs outside that file: the 8B FSDP ones (torchtitan Table 1) informed the
   500 W H100's two efficiencies together with the CSV's cp=1 row; the others fitted nothing, so
   their error is the honest one;
with MAPE and Kendall's tau per source after each table (plan/reference.agreement).

    .venv/bin/python bench/bench_plan.py [--skip-plan]
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time

from tetrad.config import load_config
from tetrad.plan.cost import estimate
from tetrad.plan.hardware import cluster_of
from tetrad.plan.reference import (agreement, best_estimate, format_agreement, predicted_value, ranking_group,
                                   read_rows)

# Megatron's GPT ties the embedding and the head; with pp > 1 the last stage holds its own copy.
_GPT = dict(norm="layernorm", mlp="gelu", pos="learned", tie_embeddings=True, vocab_size=51200, dropout=0.1,
            seq_len=2048)
_LLAMA = dict(norm="rmsnorm", mlp="swiglu", pos="rope", tie_embeddings=False, vocab_size=128256)
_8B = dict(n_layers=32, d_model=4096, n_heads=32, n_kv_heads=8, ffn_hidden=14336, **_LLAMA)
_70B = dict(n_layers=80, d_model=8192, n_heads=64, n_kv_heads=8, ffn_hidden=28672, **_LLAMA)
_LLAMA2_13B = dict(n_layers=40, d_model=5120, n_heads=40, n_kv_heads=40, ffn_hidden=13824, seq_len=4096,
                  **dict(_LLAMA, vocab_size=32000))
_405B = dict(n_layers=126, d_model=16384, n_heads=128, n_kv_heads=8, ffn_hidden=53248, **_LLAMA)


def _gpt(layers: int, hidden: int, heads: int) -> dict:
    return dict(n_layers=layers, d_model=hidden, n_heads=heads, n_kv_heads=heads, ffn_hidden=4 * hidden, **_GPT)


# (run, source, GPU, GPUs, model, parallel, train, stack, metric, published value)
HELD_OUT = [
    ("kor22-175B", "Korthikanti 2022, Table 5 (SP + selective)", "A100-80GB-SXM", 64, _gpt(96, 12288, 96),
     dict(tp=8, pp=8, sequence_parallel=True, schedule="interleaved", vpp=4),
     dict(global_batch=64, micro_batch=1, recompute="selective"), "megatron-2021", "mfu", 0.514),
    ("kor22-530B", "Korthikanti 2022, Table 5", "A100-80GB-SXM", 280, _gpt(105, 20480, 128),
     dict(tp=8, pp=35, sequence_parallel=True, schedule="interleaved", vpp=3),
     dict(global_batch=280, micro_batch=1, recompute="selective"), "megatron-2021", "mfu", 0.560),
    ("kor22-1T", "Korthikanti 2022, Table 5", "A100-80GB-SXM", 512, _gpt(128, 25600, 160),
     dict(tp=8, pp=64, sequence_parallel=True, schedule="interleaved", vpp=2),
     dict(global_batch=512, micro_batch=1, recompute="selective"), "megatron-2021", "mfu", 0.563),
    ("tt-70B-fp8", "torchtitan performance.md, Table 4 (2D)", "H100-96GB-500W", 256, dict(_70B, seq_len=8192),
     dict(dp=32, tp=8, zero=3, sequence_parallel=True), dict(global_batch=512, micro_batch=16, recompute="full",
                                                             dtype="fp8"), "compiled", "tokens_per_s_per_gpu", 829),
    ("tt-405B-1f1b", "torchtitan performance.md, Table 5 (3D)", "H100-96GB-500W", 512, dict(_405B, seq_len=8192),
     dict(dp=8, tp=8, pp=8, zero=3, sequence_parallel=True),
     dict(global_batch=256, micro_batch=4, recompute="full", dtype="fp8"), "compiled", "tokens_per_s_per_gpu", 100),
    ("tt-405B-interl", "torchtitan performance.md, Table 5", "H100-96GB-500W", 512, dict(_405B, seq_len=8192),
     dict(dp=8, tp=8, pp=8, zero=3, sequence_parallel=True, schedule="interleaved", vpp=2),
     dict(global_batch=256, micro_batch=4, recompute="full", dtype="fp8"), "compiled", "tokens_per_s_per_gpu", 128),
    ("tt-405B-32k", "torchtitan performance.md, Table 6 (4D, cp=1)", "H100-96GB-500W", 512, dict(_405B, seq_len=32768),
     dict(dp=8, tp=8, pp=8, zero=3, sequence_parallel=True),
     dict(global_batch=64, micro_batch=1, recompute="full", dtype="fp8"), "compiled", "tokens_per_s_per_gpu", 76),
    ("tt-405B-262k", "torchtitan performance.md, Table 6 (cp=8)", "H100-96GB-500W", 512, dict(_405B, seq_len=262144),
     dict(cp=8, tp=8, pp=8, zero=3, sequence_parallel=True),
     dict(global_batch=8, micro_batch=1, recompute="full", dtype="fp8"), "compiled", "tokens_per_s_per_gpu", 16),
    ("tt-8B-fsdp-bf16", "torchtitan performance.md, Table 1 (compile; op-level SAC there)", "H100-96GB-500W", 8,
     dict(_8B, seq_len=8192), dict(dp=8, zero=3), dict(global_batch=16, micro_batch=2, recompute="selective-op"),
     "compiled", "tokens_per_s_per_gpu", 6667),
    ("tt-8B-fsdp-fp8", "torchtitan performance.md, Table 1 (compile + fp8)", "H100-96GB-500W", 8,
     dict(_8B, seq_len=8192), dict(dp=8, zero=3), dict(global_batch=16, micro_batch=2, recompute="selective-op",
                                                        dtype="fp8"), "compiled", "tokens_per_s_per_gpu", 8532),
    ("llama3-405B-16k", "Llama 3 paper, Table 4 (16384 GPUs, 8K)", "H100-SXM", 16384, dict(_405B, seq_len=8192),
     dict(tp=8, pp=16, dp=128, sequence_parallel=True, schedule="interleaved", vpp=2, zero=1),
     dict(global_batch=2048, micro_batch=1, recompute="none"), "megatron", "mfu", 0.41),
    ("llama3-405B-128k", "Llama 3 paper, Table 4 (cp=16, 128K)", "H100-SXM", 16384, dict(_405B, seq_len=131072),
     dict(tp=8, pp=16, cp=16, dp=8, sequence_parallel=True, schedule="interleaved", vpp=2, zero=1),
     dict(global_batch=128, micro_batch=1, recompute="none"), "megatron", "mfu", 0.38),
    # Megatron-Bridge (Megatron-Core + TE), NeMo 25.11 container, docs/performance-summary.md of
    # https://github.com/NVIDIA-NeMo/Megatron-Bridge (docs.nvidia.com/nemo/megatron-bridge/latest/
    # performance-summary.html). Columns: Model | #-GPUs | Precision | GBS | MBS | Sequence Length |
    # FSDP | TP | PP | CP | VP | EP | GA | Tokens / sec / GPU | Model TFLOP / sec / GPU. Recompute is not
    # printed: none assumed. FSDP 1 is Megatron's FSDP (ZeRO-3), 0 its distributed optimizer (ZeRO-1).
    # "| LLAMA3_8B | 8 | FP8-CS | 128 | 1 | 8192 | 1 | 1 | 1 | 1 | n/a | 1 | 16 | 14451 | 744 |" (DGX-H100)
    ("nemo-8B-h100", "Megatron-Bridge 25.11, DGX-H100", "H100-SXM", 8, dict(_8B, seq_len=8192),
     dict(dp=8, zero=3), dict(global_batch=128, micro_batch=1, recompute="none", dtype="fp8"), "megatron-core",
     "tokens_per_s_per_gpu", 14451),
    # "| LLAMA3_70B | 64 | FP8-CS | 128 | 1 | 8192 | 0 | 4 | 8 | 1 | 5 | 1 | 64 | 1602 | 719 |" (DGX-H100)
    ("nemo-70B-h100", "Megatron-Bridge 25.11, DGX-H100", "H100-SXM", 64, dict(_70B, seq_len=8192),
     dict(tp=4, pp=8, dp=2, sequence_parallel=True, schedule="interleaved", vpp=5, zero=1),
     dict(global_batch=128, micro_batch=1, recompute="none", dtype="fp8"), "megatron-core", "tokens_per_s_per_gpu", 1602),
    # "| LLAMA3.1_405B | 1024 | FP8-CS | 512 | 1 | 8192 | 0 | 8 | 8 | 2 | 8 | 1 | 64 | 292 | 737 |" (DGX-H100)
    ("nemo-405B-h100", "Megatron-Bridge 25.11, DGX-H100", "H100-SXM", 1024, dict(_405B, seq_len=8192),
     dict(tp=8, pp=8, cp=2, dp=8, sequence_parallel=True, schedule="interleaved", vpp=8, zero=1),
     dict(global_batch=512, micro_batch=1, recompute="none", dtype="fp8"), "megatron-core", "tokens_per_s_per_gpu", 292),
    # "| LLAMA3_8B | 8 | FP8-CS (FP8-MX) | 128 | 2 | 8192 | 0 | 1 | 1 | 1 | n/a | 1 | 8 | 30624 (29521) | 1576 (1519) |"
    # (DGX-B200)
    ("nemo-8B-b200", "Megatron-Bridge 25.11, DGX-B200", "B200", 8, dict(_8B, seq_len=8192),
     dict(dp=8, zero=1), dict(global_batch=128, micro_batch=2, recompute="none", dtype="fp8"), "megatron-core",
     "tokens_per_s_per_gpu", 30624),
    # "| LLAMA3.1_405B | 128 | FP8-CS (FP8-MX) | 64 | 1 | 8192 | 0 | 4 | 8 | 2 | 8 | 1 | 32 | 661 (624) | 1667 (1576) |"
    # (DGX-B200)
    ("nemo-405B-b200", "Megatron-Bridge 25.11, DGX-B200", "B200", 128, dict(_405B, seq_len=8192),
     dict(tp=4, pp=8, cp=2, dp=2, sequence_parallel=True, schedule="interleaved", vpp=8, zero=1),
     dict(global_batch=64, micro_batch=1, recompute="none", dtype="fp8"), "megatron-core", "tokens_per_s_per_gpu", 661),
    # torchtitan's FSDP2 on 64 A100 80GB, eager (mid-2024), docs/performance.md at
    # https://github.com/pytorch/torchtitan/blob/041336434916bdc0f88c1f89fda176fd3c2092e4/docs/performance.md
    # (Model size | Batch size | Activation checkpoiting | WPS | MFU; WPS is tokens/s per GPU). The
    # "selective layer" rows (every other block fully recomputed) are left out: tetrad has no such
    # policy; "selective op" is `selective-op`.
    # Llama 2: "| 13B | 2 | no | 2162 | 61.1%	|"
    ("tt-a100-l2-13B", "torchtitan FSDP2 on A100, Llama 2 table", "A100-80GB-SXM", 64, _LLAMA2_13B,
     dict(dp=64, zero=3), dict(global_batch=128, micro_batch=2, recompute="none"), "fsdp", "tokens_per_s_per_gpu", 2162),
    # Llama 2: "| 13B | 2 | selective op | 1904 | 53.8% |"
    ("tt-a100-l2-13B-op", "torchtitan FSDP2 on A100, Llama 2 table", "A100-80GB-SXM", 64, _LLAMA2_13B,
     dict(dp=64, zero=3), dict(global_batch=128, micro_batch=2, recompute="selective-op"), "fsdp",
     "tokens_per_s_per_gpu", 1904),
    # Llama 3: "| 8B | 1 | selective op | 2973 | 58.2% |"
    ("tt-a100-l3-8B-op", "torchtitan FSDP2 on A100, Llama 3 table", "A100-80GB-SXM", 64, dict(_8B, seq_len=8192),
     dict(dp=64, zero=3), dict(global_batch=64, micro_batch=1, recompute="selective-op"), "fsdp",
     "tokens_per_s_per_gpu", 2973),
    # Llama 3: "| 70B | 1 | full | 331 | 51.7% |"
    ("tt-a100-l3-70B", "torchtitan FSDP2 on A100, Llama 3 table", "A100-80GB-SXM", 64, dict(_70B, seq_len=8192),
     dict(dp=64, zero=3), dict(global_batch=64, micro_batch=1, recompute="full"), "fsdp", "tokens_per_s_per_gpu", 331),
    # Llama 2: "| 70B | 2 | full | 353 | 50.5% |"
    ("tt-a100-l2-70B", "torchtitan FSDP2 on A100, Llama 2 table", "A100-80GB-SXM", 64,
     dict(_70B, seq_len=4096, vocab_size=32000), dict(dp=64, zero=3),
     dict(global_batch=128, micro_batch=2, recompute="full"), "fsdp", "tokens_per_s_per_gpu", 353),
    # Llama 2: "| 70B | 1[^1] | selective op | 355 | 50.8% |"
    ("tt-a100-l2-70B-op", "torchtitan FSDP2 on A100, Llama 2 table", "A100-80GB-SXM", 64,
     dict(_70B, seq_len=4096, vocab_size=32000), dict(dp=64, zero=3),
     dict(global_batch=64, micro_batch=1, recompute="selective-op"), "fsdp", "tokens_per_s_per_gpu", 355),
]


# The two commands of the speed target, timed as a user runs them (a fresh process, so
# start-up and imports count).
PLAN_COMMANDS = (
    (["--model", "llama3-70b", "--cluster", "h100x1024", "--global-batch", "1024", "--seq-len", "8192"], 2),
    (["--model", "llama3-405b", "--cluster", "h100x16384", "--global-batch", "1024", "--seq-len", "8192"], 10),
)


def bench_plan() -> None:
    print("`tetrad plan` wall time (this machine, bf16, --top 10):")
    for args, target in PLAN_COMMANDS:
        cmd = [sys.executable, "-m", "tetrad", "plan", *args, "--dtype", "bf16", "--top", "10", "--json"]
        start = time.perf_counter()
        out = subprocess.run(cmd, capture_output=True, text=True, check=True).stdout
        seconds = time.perf_counter() - start
        best = json.loads(out)[0]
        p, t = best["parallel"], best["train"]
        print(f"  tetrad plan {' '.join(args)}: {seconds:.2f} s (target < {target} s); best tp={p['tp']} pp={p['pp']} "
              f"cp={p['cp']} dp={p['dp']} {p['schedule']} vpp={p['vpp']} zero={p['zero']} mb={t['micro_batch']} "
              f"{t['recompute']}: {best['step_time_s']:.2f} s, MFU {100 * best['mfu']:.1f}%, "
              f"{best['peak_memory_gib']:.1f} GiB")


def _table(rows) -> None:
    """rows: (run, source, ranking group, metric, published, predicted); then MAPE and Kendall's
    tau per source (reference.agreement)."""
    for name, source, _, metric, published, predicted in rows:
        error = 100 * (predicted / published - 1)
        print(f"  {name:<18}{metric:<22}{published:>10.4g}{predicted:>10.4g}{error:>+8.1f}%  {source}")
    summary = agreement([(source.split(",")[0], group, published, predicted)  # per paper, not per table
                         for _, source, group, _, published, predicted in rows])
    print("  " + format_agreement(summary).replace("\n", "\n  "))


def bench_reference() -> None:
    print("reference runs (calibration):")
    _table([(r["id"], r["source"], ranking_group(r), r["metric"], float(r["value"]), predicted_value(r, best_estimate(r)))
            for r in read_rows()])


def bench_held_out() -> None:
    print("published runs outside the reference file (only the two tt-8B-fsdp rows informed a constant):")
    rows = []
    for name, source, gpu, gpus, model, parallel, train, stack, metric, value in HELD_OUT:
        cfg = load_config(overrides={"model": {"preset": "tiny", **model}, "parallel": parallel,
                                     "train": {"dtype": "bf16", **train}}, runtime=False)
        est = estimate(cfg, cluster_of(gpu, gpus), stack)
        group = f"{model['n_layers']}x{model['d_model']}/{gpus}x{gpu}/{metric}"  # one model on one cluster
        rows.append((name, source, group, metric, value,
                     est.mfu if metric == "mfu" else est.tokens_per_s / gpus))
    _table(rows)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--skip-plan", action="store_true")
    args = ap.parse_args()
    if not args.skip_plan:
        bench_plan()
    bench_reference()
    bench_held_out()


if __name__ == "__main__":
    main()
