"""`tetrad bench [comm|gemm]`: measure this machine and write the hardware profile that
`tetrad estimate` / `tetrad plan` read in place of a datasheet (format: plan/hardware.py's
`load_gpu`, documented in docs/planner.md).

`bench gemm` times matmuls by shape and dtype on one rank; `bench comm` times collectives over
local ranks (tetrad.dist.bench). Each updates its own part of OUT/hardware.json, so they can run
apart; OUT/cluster.toml points a one-node cluster at the profile for `--cluster`. On an
accelerator (`--device auto` finds it) both run there: device GEMMs at training-sized shapes,
and the collectives over the backend torch pairs with it (NCCL on NVIDIA GPUs), one rank per local
device, with nccl-tests' bus-bandwidth convention; the profile then starts from the built-in
profile of that device.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

import torch

from tetrad.config.arguments import whole_number, whole_numbers
from tetrad.device import DTYPES
from tetrad.dist.bench import ACCELERATOR_SIZES, DEFAULT_SIZES, OPS, bench_rank, bus_factor
from tetrad.launch import run_local
from tetrad.plan.links import LINK_EFFICIENCY

# (M, K, N): square sizes and the shapes of a small transformer's projections.
DEFAULT_SHAPES = ((128, 128, 128), (256, 256, 256), (512, 512, 512), (256, 1024, 256))
# On accelerators: squares, and the projections of a Llama-3-8B layer (4096 wide, ffn 14336)
# over 8192 tokens.
ACCELERATOR_SHAPES = ((4096, 4096, 4096), (8192, 8192, 8192), (8192, 4096, 14336), (8192, 14336, 4096))


def time_gemm(m: int, k: int, n: int, dtype: torch.dtype, device: str = "cpu", min_time_s: float = 0.2) -> float:
    """Achieved TFLOP/s of an (m x k) @ (k x n) matmul, repeated until `min_time_s` has passed."""
    from tetrad import device as devices
    dev = torch.device(device)
    a, b = torch.randn(m, k, dtype=dtype, device=dev), torch.randn(k, n, dtype=dtype, device=dev)
    out = torch.empty(m, n, dtype=dtype, device=dev)
    torch.matmul(a, b, out=out)  # warm-up
    devices.synchronize(dev)
    calls, batch, start = 0, 1, time.perf_counter()
    while (elapsed := time.perf_counter() - start) < min_time_s:
        for _ in range(batch):  # queued back to back: one synchronisation per batch, not per call
            torch.matmul(a, b, out=out)
        devices.synchronize(dev)
        calls, batch = calls + batch, 2 * batch
    return 2 * m * k * n * calls / elapsed / 1e12


def bench_gemm(shapes=None, dtypes=None, device: str = "cpu") -> list[dict]:
    """Achieved rates by shape and dtype. On an accelerator fp32 runs as training runs it (TF32,
    train.tf32's default; the caller sets it) and is reported as "tf32", the profile key the
    planner reads for it."""
    shapes = shapes or (DEFAULT_SHAPES if device == "cpu" else ACCELERATOR_SHAPES)
    dtypes = dtypes or (("fp32", "bf16") if device == "cpu" else ("tf32", "bf16"))
    return [{"m": m, "k": k, "n": n, "dtype": d, "tflops": time_gemm(m, k, n, DTYPES[d if d != "tf32" else "fp32"], device)}
            for d in dtypes for m, k, n in shapes]


# On accelerators, the attention core at a long causal sequence, by SDPA backend: FlashAttention-2
# (torch's flash backend) gives the profile's attention_efficiency, cuDNN's fused kernel (Hopper
# and later) its fused_attention_efficiency; both as the planner counts them (plan/layer.py's
# _attention_core: causal FLOPs, backward FLASH_BACKWARD_FACTOR times the forward, at head dim 128).
ATTENTION_BACKENDS = {"attention_efficiency": "FLASH_ATTENTION", "fused_attention_efficiency": "CUDNN_ATTENTION"}
ATTENTION_SHAPE = {"tokens": 16384, "heads": 16, "head_dim": 128}


def attention_tflops(backend: str, tokens: int, heads: int, head_dim: int, dtype: torch.dtype = torch.bfloat16,
                     device: str = "cpu", repeats: int = 5) -> float:
    """Achieved TFLOP/s of a causal attention forward and backward on SDPA's `backend`, with the
    planner's FLOP count."""
    from torch.nn.attention import SDPBackend, sdpa_kernel

    from tetrad import device as devices
    from tetrad.plan.layer import FLASH_BACKWARD_FACTOR
    dev = torch.device(device)
    q, k, v = (torch.randn(1, heads, tokens, head_dim, device=dev, dtype=dtype, requires_grad=True) for _ in range(3))
    grad = torch.randn(1, heads, tokens, head_dim, device=dev, dtype=dtype)

    def step():
        torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True).backward(grad)

    with sdpa_kernel(getattr(SDPBackend, backend)):
        step()  # warm-up (and the kernel's set-up: cuDNN builds its graph on the first call)
        devices.synchronize(dev)
        start = time.perf_counter()
        for _ in range(repeats):
            step()
        devices.synchronize(dev)
    seconds = (time.perf_counter() - start) / repeats
    forward = 4 * tokens * (tokens / 2) * heads * head_dim
    return (1 + FLASH_BACKWARD_FACTOR) * forward / seconds / 1e12


def attention_profile(device: str, bf16_peak_tflops: float, shape: dict = ATTENTION_SHAPE) -> tuple[dict, list[dict]]:
    """(the profile's attention efficiencies over its measured bf16 GEMM peak, the rows measured).
    A backend this device lacks is left out, and the built-in profile's figure stays."""
    from tetrad.plan.layer import GEMM_HALF_DIM
    tokens = shape["tokens"]
    part, rows = {}, []
    for key, backend in ATTENTION_BACKENDS.items():
        try:
            tflops = attention_tflops(backend, device=device, **shape)
        except RuntimeError as e:  # no kernel of this backend for this device (e.g. cuDNN's before Hopper)
            rows.append({"backend": backend, "tflops": None, "error": str(e).splitlines()[0][:120]})
            continue
        rows.append({"backend": backend, "tflops": tflops})
        part[key] = tflops / bf16_peak_tflops / (tokens / (tokens + GEMM_HALF_DIM))
    return part, rows


def memory_gbps(device: str = "cpu", repeats: int = 5) -> float:
    """Copy bandwidth (read + write) of a large buffer: what element-wise work and the optimizer see."""
    from tetrad import device as devices
    dev = torch.device(device)
    nbytes = 64 << 20 if dev.type == "cpu" else 1 << 30
    src = torch.ones(nbytes // 4, device=dev)
    dst = torch.empty_like(src)
    dst.copy_(src)
    devices.synchronize(dev)
    start = time.perf_counter()
    for _ in range(repeats):
        dst.copy_(src)
    devices.synchronize(dev)
    return 2 * nbytes * repeats / (time.perf_counter() - start) / 1e9


def gemm_profile(rows: list[dict], device: str = "cpu") -> dict:
    """The profile's compute part: the best achieved rate per dtype as the peak. Efficiency 1.0:
    the peak is already achieved, and the planner lowers it for small shapes."""
    peaks: dict[str, float] = {}
    for r in rows:
        peaks[r["dtype"]] = max(peaks.get(r["dtype"], 0.0), r["tflops"])
    return {"peak_tflops": peaks, "gemm_efficiency": 1.0, "memory_gbps": memory_gbps(device), "gemm": rows}


def comm_profile(rows: list[dict]) -> dict:
    """The profile's communication part: the fitted link (one machine: intra = inter) and the table."""
    link = fit_link(rows)
    return {"links": {"intra_node": link, "inter_node": link}, "collectives": rows}


def bench_comm(group_sizes=(2, 4, 8), ops=OPS, sizes=DEFAULT_SIZES, timeout_s: float = 600,
               device_type: str = "cpu") -> list[dict]:
    """Run the bench on fresh local ranks for each group size (on accelerators one per device, over
    the backend torch pairs with it: NCCL on NVIDIA GPUs); all rows together."""
    rows = []
    for n in group_sizes:
        rows += run_local(bench_rank, n, (tuple(ops), tuple(sizes)), timeout_s=timeout_s, pg_timeout_s=120,
                          device_type=device_type)[0]
    return rows


def fit_link(rows: list[dict], op: str = "all_reduce") -> dict:
    """Alpha (s per ring step) and beta (GB/s) for which the planner's ring model
    (`plan.links.ring_time`) best matches the measured `op` times, by least squares on relative
    error. beta is the link rate before the planner's LINK_EFFICIENCY, so the planner's
    prediction for these messages is what was measured."""
    steps = {"all_reduce": lambda n: 2 * (n - 1), "send_recv": lambda n: 1}.get(op, lambda n: n - 1)
    pts = [r for r in rows if r["op"] == op and r["ranks"] > 1]
    if not pts:
        raise ValueError(f"no {op} measurements to fit")
    # t = steps*alpha + factor*bytes*inv_bw; divide each row by t to weight by relative error.
    a = torch.tensor([[steps(r["ranks"]) / r["time_s"], bus_factor(op, r["ranks"]) * r["bytes"] / r["time_s"]]
                      for r in pts], dtype=torch.float64)
    alpha, inv_bw = torch.linalg.lstsq(a, torch.ones(len(pts), 1, dtype=torch.float64)).solution.flatten().tolist()
    alpha, inv_bw = max(alpha, 0.0), max(inv_bw, 1e-15)
    return {"alpha_s": alpha, "beta_gbps": 1 / inv_bw / LINK_EFFICIENCY / 1e9, "fitted_on": op}


def format_table(rows: list[dict]) -> str:
    lines = [f"{'op':<15}{'ranks':>6}{'size':>10}{'time':>12}{'algbw GB/s':>12}{'busbw GB/s':>12}"]
    for r in rows:
        lines.append(f"{r['op']:<15}{r['ranks']:>6}{_size(r['bytes']):>10}{r['time_s'] * 1e3:>10.3f}ms"
                     f"{r['algbw_gbps']:>12.3f}{r['busbw_gbps']:>12.3f}")
    return "\n".join(lines)


def _size(nbytes: int) -> str:
    for unit, scale in (("MB", 1 << 20), ("KB", 1 << 10)):
        if nbytes >= scale:
            return f"{nbytes / scale:g} {unit}"
    return f"{nbytes} B"


def write_profile(out: Path, part: dict, name: str, ranks_per_node: int, device: str = "cpu") -> Path:
    """Merge `part` into OUT/hardware.json (keeping the other bench's part) and write OUT/cluster.toml."""
    out.mkdir(parents=True, exist_ok=True)
    path = out / "hardware.json"
    profile = json.loads(path.read_text()) if path.exists() else {}
    profile.update(_device_facts(device, ranks_per_node), name=name, **part)
    path.write_text(json.dumps(profile, indent=2) + "\n")
    (out / "cluster.toml").write_text(f'[cluster]\ngpu = "hardware.json"\ngpus_per_node = {ranks_per_node}\n'
                                      "nodes = 1\n")
    return path


def _group_sizes(text: str) -> list[int]:
    """argparse type of --ranks: a collective needs two ranks or more."""
    sizes = whole_numbers(text)
    if min(sizes) < 2:
        raise argparse.ArgumentTypeError(f"group sizes are 2 ranks or more (a collective of one moves nothing), "
                                         f"got {text!r}")
    return sizes


def bench_command(argv: list[str]) -> int:
    from tetrad import device as devices
    ap = argparse.ArgumentParser(prog="tetrad bench", description=__doc__.split("\n\n")[0])
    ap.add_argument("what", nargs="?", choices=("comm", "gemm", "all"), default="all")
    ap.add_argument("--out", default="bench", help="folder for hardware.json and cluster.toml (default: bench)")
    ap.add_argument("--name", default=f"measured-{os.uname().nodename}")
    ap.add_argument("--device", default="auto", help="cpu, cuda, ... (default auto: the accelerator if any)")
    ap.add_argument("--ranks", type=_group_sizes, help="comm: group sizes, comma-separated (default 2,4,8 CPU ranks; "
                    "on an accelerator the powers of two up to the local device count)")
    ap.add_argument("--sizes-kb", type=whole_numbers, help="comm: message sizes in KiB, comma-separated (default: 4 KiB-16 "
                    "MiB on CPU, 64 KiB-1 GiB on an accelerator)")
    ap.add_argument("--threads", type=whole_number, default=1,
                    help="gemm on CPU: intra-op threads, as one training rank gets (default 1: one rank per core)")
    ap.add_argument("--json", action="store_true", help="print the measurements as JSON instead of tables")
    args = ap.parse_args(argv)
    device = devices.resolve_device_type(args.device, "--device")
    devices.configure_allocator(device)
    local = devices.local_device_count(device)
    ranks = args.ranks or ([2, 4, 8] if device == "cpu" else [n for n in (2, 4, 8) if n <= local])
    sizes = [s << 10 for s in args.sizes_kb] if args.sizes_kb else list(_default_sizes(device))
    if args.what in ("comm", "all") and (len(set(sizes)) < 3 or max(sizes) < 16 * min(sizes)):
        # two unknowns (latency, bandwidth): fewer sizes, or a narrow span, fit noise (1.25 PB/s seen)
        print(f"tetrad bench: --sizes-kb needs 3 or more sizes spanning 16x or more (got "
              f"{','.join(str(s >> 10) for s in sizes)}), so that "
              "both the link's latency and its bandwidth show in the times; e.g. --sizes-kb 4,64,1024,16384",
              file=sys.stderr)
        return 2
    out = Path(args.out)
    if args.what in ("gemm", "all"):
        torch.set_num_threads(args.threads)
        devices.set_fp32_matmul(torch.device(device), True)  # fp32 as training runs it (train.tf32's default)
        rows = bench_gemm(device=device)
        part = gemm_profile(rows, device)
        print(json.dumps(rows, indent=2) if args.json else _gemm_table(rows, part, device, args.threads))
        if device != "cpu":
            attention, attention_rows = attention_profile(device, part["peak_tflops"]["bf16"])
            part.update(attention, attention=attention_rows)
            print(json.dumps(attention_rows, indent=2) if args.json else _attention_table(attention_rows, attention))
        write_profile(out, part, args.name, max(ranks, default=local), device)
    if args.what in ("comm", "all") and device != "cpu" and (not ranks or max(ranks) > local):
        print(f"tetrad bench comm: group sizes {ranks or '(none)'} need that many {device} devices and this "
              f"machine has {local}; skipped (pass --ranks)")
    elif args.what in ("comm", "all"):
        rows = bench_comm(ranks, sizes=sizes, device_type=device)
        part = comm_profile(rows)
        print(json.dumps(rows, indent=2) if args.json else format_table(rows))
        link = part["links"]["intra_node"]
        print(f"fitted link (planner ring model): alpha {link['alpha_s'] * 1e6:.1f} us/step, "
              f"beta {link['beta_gbps']:.3f} GB/s")
        write_profile(out, part, args.name, max(ranks), device)
    print(f"profile: {out / 'hardware.json'}; use it with `tetrad estimate CONFIG --cluster {out / 'cluster.toml'}`")
    return 0


def _device_facts(device: str, ranks_per_node: int) -> dict:
    """The built-in profile a measured one starts from, and the memory one rank has: a CPU
    machine's RAM shared by its ranks, or the accelerator's own."""
    if device == "cpu":
        return {"base": "CPU",
                "memory_gib": os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 2**30 / ranks_per_node}
    from tetrad import device as devices
    from tetrad.train.metrics import device_profile
    dev = torch.device(device, 0)
    base = device_profile(dev)
    if base is None:
        print(f"tetrad bench: no built-in profile matches this {device} device; unmeasured figures "
              "(attention efficiency, ...) come from H100-SXM")
    return {"base": base.name if base else "H100-SXM",
            "memory_gib": devices.accelerator_properties(dev).total_memory / 2**30}


def _default_sizes(device: str = "cpu"):
    return DEFAULT_SIZES if device == "cpu" else ACCELERATOR_SIZES


def _attention_table(rows: list[dict], part: dict) -> str:
    shape = ", ".join(f"{k} {v}" for k, v in ATTENTION_SHAPE.items())
    lines = [f"causal attention forward + backward, bf16, {shape}:"]
    for r in rows:
        lines.append(f"{r['backend']:<18}" + (f"{r['tflops']:>10.1f} TFLOP/s" if r["tflops"] else f"  not run: {r['error']}"))
    lines += [f"{key} {value:.3f} (of the measured bf16 matmul peak)" for key, value in part.items()]
    return "\n".join(lines)


def _gemm_table(rows: list[dict], part: dict, device: str, threads: int) -> str:
    where = f"{threads} thread{'s' if threads > 1 else ''}" if device == "cpu" else device
    lines = [f"matmul on {where}:",
             f"{'dtype':<6}{'M x K x N':>20}{'TFLOP/s':>10}"]
    for r in rows:
        shape = f"{r['m']} x {r['k']} x {r['n']}"
        lines.append(f"{r['dtype']:<6}{shape:>20}{r['tflops']:>10.4f}")
    lines.append(f"memory copy bandwidth {part['memory_gbps']:.1f} GB/s")
    return "\n".join(lines)
