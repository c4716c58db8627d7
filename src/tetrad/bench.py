"""`tetrad bench [comm|gemm]`: measure this machine and write the hardware profile that
`tetrad estimate` / `tetrad plan` read in place of a datasheet (format: plan/hardware.py's
`load_gpu`, documented in docs/planner.md).

`bench gemm` times matmuls by shape and dtype on one rank; `bench comm` times collectives over
local ranks (tetrad.comm.bench). Each updates its own part of OUT/hardware.json, so they can run
apart; OUT/cluster.toml points a one-node cluster at the profile for `--cluster`.
"""

from __future__ import annotations

import argparse
import json
import os
import time
from pathlib import Path

import torch

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}
# (M, K, N): square sizes and the shapes of a small transformer's projections.
DEFAULT_SHAPES = ((128, 128, 128), (256, 256, 256), (512, 512, 512), (256, 1024, 256))


def time_gemm(m: int, k: int, n: int, dtype: torch.dtype, device: str = "cpu", min_time_s: float = 0.2) -> float:
    """Achieved TFLOP/s of an (m x k) @ (k x n) matmul, repeated until `min_time_s` has passed."""
    from tetrad import device as devices
    dev = torch.device(device)
    a, b = torch.randn(m, k, dtype=dtype, device=dev), torch.randn(k, n, dtype=dtype, device=dev)
    out = torch.empty(m, n, dtype=dtype, device=dev)
    torch.matmul(a, b, out=out)  # warm-up
    devices.synchronize(dev)
    calls, start = 0, time.perf_counter()
    while (elapsed := time.perf_counter() - start) < min_time_s:
        torch.matmul(a, b, out=out)
        devices.synchronize(dev)
        calls += 1
    return 2 * m * k * n * calls / elapsed / 1e12


def bench_gemm(shapes=DEFAULT_SHAPES, dtypes=("fp32", "bf16"), device: str = "cpu") -> list[dict]:
    return [{"m": m, "k": k, "n": n, "dtype": d, "tflops": time_gemm(m, k, n, DTYPES[d], device)}
            for d in dtypes for m, k, n in shapes]


def memory_gbps(nbytes: int = 64 << 20, repeats: int = 5) -> float:
    """Copy bandwidth (read + write) of a large buffer: what element-wise work and the optimizer see."""
    src = torch.ones(nbytes // 4)
    dst = torch.empty_like(src)
    dst.copy_(src)
    start = time.perf_counter()
    for _ in range(repeats):
        dst.copy_(src)
    return 2 * nbytes * repeats / (time.perf_counter() - start) / 1e9


def gemm_profile(rows: list[dict]) -> dict:
    """The profile's compute part: the best achieved rate per dtype as the peak. Efficiency 1.0:
    the peak is already achieved, and the planner lowers it for small shapes."""
    peaks: dict[str, float] = {}
    for r in rows:
        peaks[r["dtype"]] = max(peaks.get(r["dtype"], 0.0), r["tflops"])
    return {"peak_tflops": peaks, "gemm_efficiency": 1.0, "memory_gbps": memory_gbps(), "gemm": rows}


def comm_profile(rows: list[dict]) -> dict:
    """The profile's communication part: the fitted link (one machine: intra = inter) and the table."""
    from tetrad.comm.bench import fit_link
    link = fit_link(rows)
    return {"links": {"intra_node": link, "inter_node": link}, "collectives": rows}


def write_profile(out: Path, part: dict, name: str, ranks_per_node: int) -> Path:
    """Merge `part` into OUT/hardware.json (keeping the other bench's part) and write OUT/cluster.toml."""
    out.mkdir(parents=True, exist_ok=True)
    path = out / "hardware.json"
    profile = json.loads(path.read_text()) if path.exists() else {}
    profile.update({"name": name, "base": "CPU",
                    "memory_gib": os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 2**30 / ranks_per_node},
                   **part)
    path.write_text(json.dumps(profile, indent=2) + "\n")
    (out / "cluster.toml").write_text(f'[cluster]\ngpu = "hardware.json"\ngpus_per_node = {ranks_per_node}\n'
                                      "nodes = 1\n")
    return path


def bench_command(argv: list[str]) -> int:
    ap = argparse.ArgumentParser(prog="tetrad bench", description=__doc__.split("\n\n")[0])
    ap.add_argument("what", nargs="?", choices=("comm", "gemm", "all"), default="all")
    ap.add_argument("--out", default="bench", help="folder for hardware.json and cluster.toml (default: bench)")
    ap.add_argument("--name", default=f"measured-{os.uname().nodename}")
    ap.add_argument("--ranks", default="2,4,8", help="comm: group sizes, comma-separated (local CPU ranks)")
    ap.add_argument("--sizes-kb", default=",".join(str(s >> 10) for s in _default_sizes()),
                    help="comm: message sizes in KiB, comma-separated")
    ap.add_argument("--threads", type=int, default=1,
                    help="gemm: intra-op threads, as one training rank gets (default 1: one rank per core)")
    ap.add_argument("--device", default="cpu", help="gemm: device to time on")
    ap.add_argument("--json", action="store_true", help="print the measurements as JSON instead of tables")
    args = ap.parse_args(argv)
    ranks = [int(x) for x in args.ranks.split(",")]
    out = Path(args.out)
    if args.what in ("gemm", "all"):
        torch.set_num_threads(args.threads)
        rows = bench_gemm(device=args.device)
        part = gemm_profile(rows)
        print(json.dumps(rows, indent=2) if args.json else _gemm_table(rows, part, args.threads))
        write_profile(out, part, args.name, max(ranks))
    if args.what in ("comm", "all"):
        from tetrad.comm.bench import bench_comm, format_table
        rows = bench_comm(ranks, sizes=[int(s) << 10 for s in args.sizes_kb.split(",")])
        part = comm_profile(rows)
        print(json.dumps(rows, indent=2) if args.json else format_table(rows))
        link = part["links"]["intra_node"]
        print(f"fitted link (planner ring model): alpha {link['alpha_s'] * 1e6:.1f} us/step, "
              f"beta {link['beta_gbps']:.3f} GB/s")
        write_profile(out, part, args.name, max(ranks))
    print(f"profile: {out / 'hardware.json'}; use it with `tetrad estimate CONFIG --cluster {out / 'cluster.toml'}`")
    return 0


def _default_sizes():
    from tetrad.comm.bench import DEFAULT_SIZES
    return DEFAULT_SIZES


def _gemm_table(rows: list[dict], part: dict, threads: int) -> str:
    lines = [f"matmul on {threads} thread{'s' if threads > 1 else ''}:",
             f"{'dtype':<6}{'M x K x N':>20}{'TFLOP/s':>10}"]
    for r in rows:
        shape = f"{r['m']} x {r['k']} x {r['n']}"
        lines.append(f"{r['dtype']:<6}{shape:>20}{r['tflops']:>10.4f}")
    lines.append(f"memory copy bandwidth {part['memory_gbps']:.1f} GB/s")
    return "\n".join(lines)
