"""What the CPU suite cannot check, on a machine with one CUDA GPU, in one table (< 8 minutes):

- loss parity: 5 training steps of the tiny model on CUDA and on the CPU (fp32, TF32 off);
- attention kernels: which ops and CUDA kernels ran (torch.profiler) for the one-call path and
  the ring blocks, in bf16 and fp32, with and without grouped-query heads, against choose_kernel;
- throughput: tokens/s and MFU of a ~1B Llama (Llama-3.2-1B's shape) at seq 4096 in bf16,
  eager and with train.compile;
- memory: `tetrad estimate`'s peak against the measured peak allocated and reserved, for
  recompute none / selective / full;
- offload: a save -> resume round trip with train.offload_optimizer continues the same losses,
  and the ~1B model trained with it: measured peak allocated against `tetrad estimate`'s device
  peak (the optimizer's states on the host), its optimizer time beside the estimate's;
- async save: a background checkpoint (checkpoint.async_save) resumes to the same losses;
- ring blocks: the fused block kernels against the fp32 math path at 8k-32k tokens (time, peak
  memory, largest difference), and the kernel choose_kernel picks for head dims the fused ops
  refuse when called directly (100, 200, 288) running a block;
- the user's commands: `tetrad train` (the demo config on one rank) and `tetrad generate` (on the
  GPU by default; its greedy fp32 text there against the CPU's);
- chunked loss: the ~1B model with train.loss_chunk_tokens against the unfused head (losses, peak
  memory against the estimate, step time);
- varlen: masked attention (documents with and without a sliding window, bf16, GQA) through
  flash's varlen kernel against the masked SDPA path, outputs and gradients, both times, and that per-op
  recompute keeps its output (bench/varlen_check.py).

    python bench/gpu_check.py

Each part runs in its own spawned process (tetrad's launcher, one rank), so one that fails or
runs out of memory is a FAIL row, not the end of the check.
"""

from __future__ import annotations

import math
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

from tetrad import device as devices
from tetrad import launch
from tetrad.config import load_config
from tetrad.model import attention as attn
from varlen_check import varlen_attention

TINY = {"model": {"preset": "tiny"}, "train": {"steps": 5, "global_batch": 8, "micro_batch": 4, "warmup": 2,
                                               "lr": 1e-2, "dtype": "fp32", "tf32": False}}
# Llama-3.2-1B: 16 layers, d_model 2048, 32 heads, 8 KV heads, ffn 8192, tied 128k vocabulary.
LLAMA_1B = {"preset": "llama3-8b", "n_layers": 16, "d_model": 2048, "n_heads": 32, "n_kv_heads": 8,
            "ffn_hidden": 8192, "tie_embeddings": True, "seq_len": 4096}
RING_TOKENS = (8192, 16384, 32768)


def config(sections: dict, run_dir: str, **train):
    """A runtime config from `sections`, training in `run_dir`, with `train` keys on top."""
    merged = {name: dict(values) for name, values in sections.items()}
    merged.setdefault("train", {}).update(train)
    merged["run"] = {"dir": run_dir, "log_every": 1000}
    return load_config(overrides=merged)


def train_run(cfg, device_type: str) -> list[dict]:
    """The metrics records of `cfg` trained on one fresh rank of `device_type` (spawned on an
    accelerator, forked on the CPU: the suite's CPU run of a part)."""
    from tetrad.train.trainer import train_on_this_rank
    return launch.run_local(train_on_this_rank, 1, (cfg, device_type), device_type=device_type, timeout_s=600)[0]


# ----------------------------------------------------------------------------- parts

def loss_parity(device_type: str = "cuda", steps: int = 5) -> list[tuple]:
    with tempfile.TemporaryDirectory() as tmp:
        runs = {d: [r["loss"] for r in train_run(config(TINY, f"{tmp}/{d}", steps=steps, device=d), d)]
                for d in ("cpu", device_type)}
    diff = max(abs(a - b) / abs(b) for a, b in zip(runs[device_type], runs["cpu"]))
    ok = len(runs["cpu"]) == steps and diff < 1e-4
    return [("loss parity, fp32 TF32 off", ok, f"{steps} steps, max relative |Δloss| {diff:.1e} "
             f"(cpu {runs['cpu'][-1]:.5f}, {device_type} {runs[device_type][-1]:.5f})")]


ATTENTION_OPS = {"flash": "aten::_scaled_dot_product_flash_attention",
                 "efficient": "aten::_scaled_dot_product_efficient_attention",
                 "cudnn": "aten::_scaled_dot_product_cudnn_attention",
                 "cpu_flash": "aten::_scaled_dot_product_flash_attention_for_cpu",
                 "math": "aten::_scaled_dot_product_attention_math"}
KERNEL_WORDS = ("flash", "fmha", "cudnn", "sdpa", "attention")


def attention_ops(device: str, dtype: torch.dtype, gqa: bool, algo: str, tokens: int = 256) -> tuple[set, set]:
    """(attention ops, attention CUDA kernels) a forward and backward ran, by torch.profiler:
    the one-call path (`alltoall`: local_attention) or one ring block pair (`ring`)."""
    g = torch.Generator().manual_seed(0)
    q = torch.randn(1, tokens, 8, 64, generator=g).to(device, dtype).requires_grad_()
    k, v = (torch.randn(1, tokens, 4 if gqa else 8, 64, generator=g).to(device, dtype).requires_grad_()
            for _ in range(2))
    activities = [torch.profiler.ProfilerActivity.CPU]
    if device == "cuda":
        activities.append(torch.profiler.ProfilerActivity.CUDA)
    with torch.profiler.profile(activities=activities) as prof:
        if algo == "ring":
            kernel = attn.choose_kernel(device, dtype, gqa, "ring", devices.prefers_cudnn_attention(q.device))
            qh, kh, vh = (t.detach().transpose(1, 2) for t in (q, k, v))
            groups = 2 if kernel.expand_kv else 1
            kh, vh = attn._repeat_kv(kh, groups), attn._repeat_kv(vh, groups)
            out, lse = attn._block_forward(qh, kh, vh, True, kernel.name)
            attn._block_backward(torch.ones_like(out), qh, kh, vh, out, lse, True, kernel.name)
        else:
            attn.local_attention(q, k, v).sum().backward()
    names = {e.key for e in prof.key_averages()}
    ops = {name for name, op in ATTENTION_OPS.items() if op in names}
    kernels = {e.name for e in prof.events() if e.device_type != torch.autograd.DeviceType.CPU
               and any(w in e.name.lower() for w in KERNEL_WORDS)}
    return ops, kernels


def _attention_rank(device: str) -> list[tuple]:
    rows = []
    for dtype in (torch.bfloat16, torch.float32):
        for gqa in (False, True):
            for algo in ("alltoall", "ring"):
                ops, kernels = attention_ops(device, dtype, gqa, algo)
                cudnn = devices.prefers_cudnn_attention(torch.device(device))
                want = attn.choose_kernel(device, dtype, gqa, algo, cudnn).name
                ok = want in ops and "math" not in ops
                label = f"attention {algo}, {str(dtype)[6:]}, {'GQA' if gqa else 'MHA'}"
                detail = f"chose {want}; ops {sorted(ops)}; kernels {sorted(k[:48] for k in kernels)[:3]}"
                rows.append((label, ok, detail))
    return rows


def attention_kernels(device_type: str = "cuda") -> list[tuple]:
    return launch.run_local(_attention_rank, 1, (device_type,), device_type=device_type, spawn=True)[0]


def block_vs_math(device: str, tokens: int, dtype: torch.dtype, heads: int = 4, dim: int = 128) -> dict:
    """One causal block, forward and backward, with the kernel the ring uses and with the fp32
    math path: milliseconds, peak memory (GiB; on CUDA) and the largest difference of each."""
    g = torch.Generator().manual_seed(0)
    q, k, v, dout = (torch.randn(1, heads, tokens, dim, generator=g).to(device, dtype) for _ in range(4))
    chosen = attn.choose_kernel(torch.device(device).type, dtype, False, "ring",
                                devices.prefers_cudnn_attention(torch.device(device)), head_dim=dim).name
    results, out = {}, {}
    for name in (chosen, "math"):
        try:
            results[name], out[name] = _timed_block(q, k, v, dout, name)
        except torch.OutOfMemoryError:
            results[name] = {"ms": math.nan, "gib": math.nan, "oom": True}
        if device == "cuda":
            torch.cuda.empty_cache()
    if len(out) == 2:
        results["max_diff"] = max(float((a.float() - b.float()).abs().max()) for a, b in zip(out[chosen], out["math"]))
    results["kernel"] = chosen
    return results


def _timed_block(q, k, v, dout, name: str):
    dev = q.device
    if dev.type == "cuda":
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated() if dev.type == "cuda" else 0
    start = time.perf_counter()
    o, lse = attn._block_forward(q, k, v, True, name)
    grads = attn._block_backward(dout, q, k, v, o, lse, True, name)
    if dev.type == "cuda":
        torch.cuda.synchronize()
    ms = (time.perf_counter() - start) * 1e3
    gib = (torch.cuda.max_memory_allocated() - base) / 2**30 if dev.type == "cuda" else math.nan
    return {"ms": ms, "gib": gib}, (o, *grads)


def _ring_rank(device: str, tokens: tuple) -> list[tuple]:
    rows = []
    for n in tokens:
        for dtype in (torch.bfloat16,) + ((torch.float32,) if n == tokens[0] else ()):
            r = block_vs_math(device, n, dtype)
            fused, math_ = r[r["kernel"]], r["math"]
            bound = 5e-2 if dtype == torch.bfloat16 else 1e-3
            ok = not fused.get("oom") and (math_.get("oom") or r.get("max_diff", math.inf) < bound)
            versus = "math path out of memory" if math_.get("oom") else \
                f"math {math_['ms']:.0f} ms {math_['gib']:.1f} GiB, max |Δ| {r['max_diff']:.1e}"
            rows.append((f"ring block {n} tokens {str(dtype)[6:]}", ok,
                         f"{r['kernel']} {fused['ms']:.0f} ms {fused['gib']:.2f} GiB; {versus}"))
            # (the first call of each kernel includes its warm-up; the memory is what matters)
    for dim in (100, 200, 288):  # head dims the fused ops refuse directly: choose_kernel's fallbacks
        r = block_vs_math(device, 2048, torch.bfloat16, dim=dim)
        rows.append((f"ring block head_dim {dim} bf16", r.get("max_diff", math.inf) < 0.125,  # 2 bf16 ulps at 8-16
                     f"{r['kernel']} {r[r['kernel']]['ms']:.0f} ms; max |Δ| to math {r.get('max_diff', math.nan):.1e}"))
    return rows


def ring_blocks(device_type: str = "cuda", tokens: tuple = RING_TOKENS) -> list[tuple]:
    return launch.run_local(_ring_rank, 1, (device_type, tokens), device_type=device_type, spawn=True)[0]


def predicted(cfg, gpu: str, stack: str = "tetrad"):
    """`tetrad estimate` of `cfg` on one `gpu` (the tetrad stack follows train.compile, as the CLI's does)."""
    from tetrad.plan.cost import estimate
    from tetrad.plan.hardware import Cluster, load_gpu
    return estimate(cfg, Cluster(load_gpu(gpu), gpus_per_node=1, nodes=1), stack)


def predicted_peak_gib(cfg, gpu: str) -> float:
    """`tetrad estimate`'s peak memory per GPU for `cfg` on one `gpu`."""
    return predicted(cfg, gpu).peak_memory_gib


def throughput_and_memory(device_type: str = "cuda", gpu: str = "H200", steps: int = 6) -> list[tuple]:
    rows = []
    runs = [("none", False, steps), ("selective", False, 2), ("full", False, 2), ("none", True, steps)]
    with tempfile.TemporaryDirectory() as tmp:
        for recompute, compile_, n in runs:
            cfg = config({"model": LLAMA_1B}, f"{tmp}/{recompute}{compile_}", steps=n, dtype="bf16",
                         global_batch=4, micro_batch=2, warmup=1, recompute=recompute, compile=compile_,
                         device=device_type)
            try:
                records = train_run(cfg, device_type)
            except launch.RankFailure as e:
                rows.append((f"1B seq 4096 recompute={recompute} compile={compile_}", False, str(e)[-200:]))
                continue
            steady = records[2:] or records[-1:]
            if recompute == "none":
                tps = statistics.median(r["tokens_per_s"] for r in steady)
                mfu = statistics.median(r["mfu"] or 0 for r in steady)
                guess = predicted(cfg, gpu).tokens_per_s
                rows.append((f"1B seq 4096 bf16 {'compiled' if compile_ else 'eager'}",
                             mfu > 0 and near(tps, guess, ESTIMATE_TOLERANCE[0]),
                             f"{tps:,.0f} tokens/s, MFU {100 * mfu:.1f}%; estimate {guess:,.0f} tokens/s "
                             f"(measured/estimate {tps / guess:.2f})"))
            if not compile_:
                last, peak = records[-1], predicted_peak_gib(cfg, gpu)
                measured = last["peak_memory_gib"]
                rows.append((f"memory recompute={recompute}", near(measured, peak, ESTIMATE_TOLERANCE[1]),
                             f"predicted {peak:.1f} GiB; measured allocated {measured:.1f}, "
                             f"reserved {last.get('peak_reserved_gib', math.nan):.1f} GiB"))
    return rows


# Runs the planner was not fitted to, each named by what it stresses: (label, model keys, train keys).
LLAMA_8B_4_LAYERS = {"preset": "llama3-8b", "n_layers": 4, "seq_len": 8192}
CALIBRATION = (
    ("1B seq 16384 (long sequence)", {**LLAMA_1B, "seq_len": 16384}, {"global_batch": 2, "micro_batch": 1}),
    ("1B seq 4096 recompute=full", LLAMA_1B, {"global_batch": 4, "micro_batch": 2, "recompute": "full"}),
    ("1B seq 2048 fp32 (TF32)", {**LLAMA_1B, "seq_len": 2048}, {"global_batch": 4, "micro_batch": 2, "dtype": "fp32"}),
    ("Llama-3-8B layers x4, seq 8192", LLAMA_8B_4_LAYERS, {"global_batch": 2, "micro_batch": 1}),
)
# How far a measurement may sit from `tetrad estimate` before its row fails: time, memory. On the
# H200 the planner's runs sat within 7% and 3% (tests/test_plan_h200.py); another GPU has its
# profile's literature efficiencies, hence the margin.
ESTIMATE_TOLERANCE = (0.15, 0.10)


def near(measured: float, predicted: float, tolerance: float) -> bool:
    return abs(measured / predicted - 1) <= tolerance


def planner_points(device_type: str = "cuda", gpu: str = "H200", steps: int = 5) -> list[tuple]:
    """Measured tokens/s and peak memory of eager runs against `tetrad estimate` (tests/
    test_plan_h200.py keeps the H200's figures), and the estimate had the attention core been
    FlashAttention-2 (what torch runs where it does not prefer cuDNN's kernel). A row fails when
    either is off by more than ESTIMATE_TOLERANCE."""
    from dataclasses import replace

    from tetrad.plan.stacks import STACKS
    flash2 = replace(STACKS["tetrad"], attention_kernel="flash2")
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        for i, (label, model, train) in enumerate(CALIBRATION):
            cfg = config({"model": model}, f"{tmp}/{i}", **{"steps": steps, "dtype": "bf16", "warmup": 1,
                                                           "device": device_type, **train})
            try:
                records = train_run(cfg, device_type)
            except launch.RankFailure as e:
                rows.append((label, False, str(e)[-200:]))
                continue
            tps = statistics.median(r["tokens_per_s"] for r in records[2:])
            as_run, if_flash2 = predicted(cfg, gpu), predicted(cfg, gpu, flash2)
            peak = records[-1]["peak_memory_gib"]
            ok = near(peak, as_run.peak_memory_gib, ESTIMATE_TOLERANCE[1]) and \
                near(tps, as_run.tokens_per_s, ESTIMATE_TOLERANCE[0])
            rows.append((label, ok, f"{tps:,.0f} tokens/s (MFU {100 * records[-1]['mfu']:.1f}%); "
                         f"measured/estimate {tps / as_run.tokens_per_s:.2f} ({tps / if_flash2.tokens_per_s:.2f} "
                         f"if FlashAttention-2); peak {peak:.1f} GiB, predicted "
                         f"{as_run.peak_memory_gib:.1f}"))
    return rows


def chunked_loss(device_type: str = "cuda", gpu: str = "H200", steps: int = 4, model: dict = LLAMA_1B,
                 chunk: int = 4096) -> list[tuple]:
    """The ~1B model (a 128k vocabulary, tied) with the head's loss fused in chunks of 4096 tokens
    (train.loss_chunk_tokens) against the unfused head: the same losses (bf16: within 1e-2), the
    measured peak against `tetrad estimate`'s for each, and the step-time ratio (one more head GEMM)."""
    runs = {}
    with tempfile.TemporaryDirectory() as tmp:
        for tokens in (0, chunk):
            cfg = config({"model": model}, f"{tmp}/{tokens}", steps=steps, dtype="bf16", global_batch=4,
                         micro_batch=2, warmup=1, loss_chunk_tokens=tokens, device=device_type)
            runs[tokens] = cfg, train_run(cfg, device_type)
    rows = []
    for tokens, (cfg, records) in runs.items():
        measured, peak = records[-1]["peak_memory_gib"], predicted_peak_gib(cfg, gpu)
        rows.append((f"seq {cfg.model.seq_len} vocab {cfg.model.vocab_size} loss_chunk_tokens={tokens}", near(measured, peak, ESTIMATE_TOLERANCE[1]),
                     f"peak {measured:.1f} GiB, predicted {peak:.1f}; "
                     f"{statistics.median(r['step_time_s'] for r in records[1:]):.3f} s a step"))
    (_, plain), (_, fused) = runs.values()
    diff = max(abs(a["loss"] - b["loss"]) for a, b in zip(plain, fused))
    ratio = statistics.median(r["step_time_s"] for r in fused[1:]) / statistics.median(r["step_time_s"] for r in plain[1:])
    rows.append(("fused chunked loss against unfused", diff < 1e-2,
                 f"max |Δloss| {diff:.1e} over {steps} steps; step time x{ratio:.3f}; peak "
                 f"{fused[-1]['peak_memory_gib'] - plain[-1]['peak_memory_gib']:+.1f} GiB"))
    return rows


def resume_round_trip(name: str, device_type: str = "cuda", **train) -> list[tuple]:
    """Four steps straight, against two steps, a checkpoint, and two steps resumed from it, all with
    the `train` keys (and `checkpoint.async_save` where `train` asks for it)."""
    async_save = train.pop("async_save", False)
    with tempfile.TemporaryDirectory() as tmp:
        straight = train_run(config(TINY, f"{tmp}/a", steps=4, device=device_type, **train), device_type)
        first = config(TINY, f"{tmp}/b", steps=2, device=device_type, **train)
        first.checkpoint.every, first.checkpoint.async_save = 2, async_save
        train_run(first, device_type)
        saved = sorted(Path(tmp, "b", "checkpoints").glob("step_*"))[-1]
        resumed_cfg = config(TINY, f"{tmp}/c", steps=4, device=device_type, **train)
        resumed_cfg.checkpoint.resume = str(saved)
        resumed = train_run(resumed_cfg, device_type)
    a, b = [r["loss"] for r in straight[2:]], [r["loss"] for r in resumed]
    return [(f"{name} save -> resume", a == b, f"steps 3-4 straight {a}, resumed from {saved.name} {b}")]


def offload_resume(device_type: str = "cuda") -> list[tuple]:
    """An offloaded optimizer's state saved from and restored to host memory."""
    return resume_round_trip("offload", device_type, offload_optimizer=True)


def async_checkpoint_resume(device_type: str = "cuda") -> list[tuple]:
    """A background checkpoint (checkpoint.async_save): the state copied from the device to CPU
    memory, written from a thread."""
    return resume_round_trip("async", device_type, async_save=True)


def offload_config(run_dir: str, device_type: str = "cuda", steps: int = 4):
    """The ~1B model (seq 4096, one micro-batch of 2) in bf16 with the optimizer offloaded: its
    fp32 masters and moments, 12 bytes a parameter, are most of what leaves the GPU."""
    return config({"model": LLAMA_1B}, run_dir, steps=steps, dtype="bf16", global_batch=2, micro_batch=2, warmup=1,
                  offload_optimizer=True, device=device_type)


def offload_predictions(cfg, gpu: str):
    """`tetrad estimate` of `cfg` on one `gpu`, offloaded as it is and with the optimizer kept."""
    from dataclasses import replace
    return predicted(cfg, gpu), predicted(replace(cfg, train=replace(cfg.train, offload_optimizer=False)), gpu)


def offload_memory(device_type: str = "cuda", gpu: str = "H200") -> list[tuple]:
    """The measured peak allocated (torch.cuda.max_memory_allocated) of an offloaded run against
    the estimate's device peak; its optimizer time (copies and CPU AdamW, on this machine's host,
    which the profile's DGX figures may not describe) beside the estimate's, not judged."""
    with tempfile.TemporaryDirectory() as tmp:
        cfg = offload_config(tmp, device_type)
        records = train_run(cfg, device_type)
    moved, kept = offload_predictions(cfg, gpu)
    peak = records[-1]["peak_memory_gib"]
    optimizer = statistics.median(r["optimizer_s"] for r in records[1:])
    guess = moved.breakdown["optimizer"] + moved.breakdown["host_copies"]
    return [("offload memory, 1B seq 4096 bf16", near(peak, moved.peak_memory_gib, ESTIMATE_TOLERANCE[1]),
             f"peak allocated {peak:.1f} GiB, predicted {moved.peak_memory_gib:.1f} ({kept.peak_memory_gib:.1f} "
             f"without offload); host {moved.host_memory.total / 2**30:.1f} GiB predicted; optimizer "
             f"{optimizer:.3f} s, predicted {guess:.3f} (measured/estimate {optimizer / guess:.2f})")]


def cli_round_trip(device_type: str = "cuda") -> list[tuple]:
    """The user's path: `tetrad train` (the demo config on one rank, train.device=auto), then
    `tetrad generate` from its checkpoint, as commands."""
    root = Path(__file__).resolve().parents[1]
    one_rank = ["--parallel.dp=1", "--parallel.pp=1", "--parallel.cp=1", "--parallel.tp=1",
                "--parallel.sequence_parallel=false", "--train.steps=40", "--train.eval_every=20",
                "--checkpoint.every=40"]
    with tempfile.TemporaryDirectory() as tmp:
        train = subprocess.run([sys.executable, "-m", "tetrad", "train", str(root / "configs" / "demo.toml"),
                                *one_rank, f"--run.dir={tmp}/demo"], capture_output=True, text=True, timeout=300)
        on_device = f"1 rank on {device_type}" in train.stdout
        generate = subprocess.run([sys.executable, "-m", "tetrad", "generate", f"{tmp}/demo", "--prompt", "The"],
                                  capture_output=True, text=True, timeout=300)
        greedy = {where: subprocess.run([sys.executable, "-m", "tetrad", "generate", f"{tmp}/demo", "--prompt", "The",
                                         "--temperature", "0", "--dtype", "fp32", "--device", where,
                                         "--max-new-tokens", "32"], capture_output=True, text=True, timeout=300)
                  for where in (device_type, "cpu")}
    summary = (train.stdout.strip().splitlines() or [train.stderr.strip()[-200:]])[-1]
    said = (generate.stdout + generate.stderr).strip().splitlines()
    here, cpu = greedy[device_type], greedy["cpu"]
    same = here.returncode == cpu.returncode == 0 and here.stdout == cpu.stdout
    return [("tetrad train (demo, 1 rank, device auto)", train.returncode == 0 and on_device, summary[:200]),
            ("tetrad generate (device auto)", generate.returncode == 0
             and f"; {device_type}, " in generate.stderr, (said[-1] if said else "")[:200]),
            (f"tetrad generate greedy fp32: {device_type} text = cpu text", same,
             f"{here.stdout.strip()[:60]!r} vs {cpu.stdout.strip()[:60]!r}" if not same else "32 tokens alike")]


# ----------------------------------------------------------------------------- table

def format_table(rows: list[tuple]) -> str:
    width = max(len(r[0]) for r in rows)
    lines = [f"{'check':<{width}}  result  detail"]
    for name, ok, detail in rows:
        lines.append(f"{name:<{width}}  {'PASS' if ok else 'FAIL':<6}  {detail}")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    """`python bench/gpu_check.py [PART ...]`: every part, or the named ones (PARTS' keys)."""
    unknown = [name for name in argv or () if name not in PARTS]
    if unknown:
        print(f"gpu_check: unknown part(s) {unknown}; the parts: {', '.join(PARTS)}", file=sys.stderr)
        return 2
    if not torch.cuda.is_available():
        print("gpu_check: this machine has no CUDA GPU that torch can use (torch.cuda.is_available() is "
              f"False; torch {torch.__version__}). Run it on a machine with one NVIDIA GPU and a CUDA build "
              "of torch.", file=sys.stderr)
        return 2
    from tetrad.train.metrics import device_profile
    devices.configure_allocator("cuda")  # as `tetrad train` does; the spawned ranks inherit it
    profile = device_profile(torch.device("cuda", 0))
    gpu = profile.name if profile else "H100-SXM"
    start, rows = time.perf_counter(), []
    for name in argv or PARTS:
        rows += _guarded(name, lambda: PARTS[name](gpu))
        print(format_table(rows), f"\n({time.perf_counter() - start:.0f} s so far)\n", flush=True)
    print(f"gpu_check on {torch.cuda.get_device_name(0)} (profile {gpu}), torch {torch.__version__}, "
          f"{time.perf_counter() - start:.0f} s")
    print(format_table(rows))
    return 0 if all(ok for _, ok, _ in rows) else 1


def _guarded(name: str, part) -> list[tuple]:
    """A part that raises is one FAIL row naming the error, and the check goes on."""
    try:
        return part()
    except Exception as e:  # noqa: BLE001 - any failure is a result of the check
        return [(name, False, f"{type(e).__name__}: {str(e).splitlines()[-1] if str(e) else ''}"[:300])]


# Each part takes the GPU's profile name; in the order they run, the quick ones first.
PARTS = {"cli": lambda gpu: cli_round_trip(), "parity": lambda gpu: loss_parity(),
         "throughput": lambda gpu: throughput_and_memory(gpu=gpu), "planner": lambda gpu: planner_points(gpu=gpu),
         "attention": lambda gpu: attention_kernels(), "varlen": lambda gpu: varlen_attention(),
         "offload": lambda gpu: offload_resume() + offload_memory(gpu=gpu),
         "async_save": lambda gpu: async_checkpoint_resume(),
         "ring": lambda gpu: ring_blocks(), "chunked_loss": lambda gpu: chunked_loss(gpu=gpu)}


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
