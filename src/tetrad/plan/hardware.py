"""Hardware the cost model knows: GPU profiles from datasheets, clusters, measured profiles.

A GPU profile is dense peak FLOP/s per dtype, HBM capacity and bandwidth, the per-GPU link
bandwidth inside a node (NVLink/xGMI) and across nodes (the GPU's network share), and two
achieved-fraction constants: a large GEMM's share of peak and a flash-attention kernel's.
Bandwidths are GB/s per GPU per direction. For `train.offload_optimizer`, the GPU's link to its
host (PCIe) and the host memory bandwidth of the node it usually sits in. `tetrad bench` writes a
measured profile (JSON, format in docs/planner.md) that replaces any of these figures.
"""

from __future__ import annotations

import difflib
import json
import sys
from dataclasses import dataclass, replace
from pathlib import Path

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover
    import tomli as tomllib


class HardwareError(ValueError):
    """An unknown GPU or cluster, or a malformed cluster/profile file; the message lists the choices."""


@dataclass(frozen=True)
class GPU:
    name: str
    peak_tflops: dict  # dense peak by dtype: "fp32", "bf16", "fp16", "fp8"
    hbm_gib: float  # capacity the driver reports
    hbm_gbps: float
    intra_gbps: float  # NVLink/xGMI per GPU per direction
    # The network per GPU per direction: a node's NIC bandwidth over its GPUs (one NIC's in every
    # built-in profile, one NIC a GPU); an all-to-all across nodes gets this much per GPU.
    inter_gbps: float
    intra_alpha_s: float = 3e-6  # latency of one collective ring step inside a node
    inter_alpha_s: float = 10e-6  # ... across nodes
    gemm_efficiency: float = 0.80  # share of peak a large, well-shaped GEMM reaches
    attention_efficiency: float = 0.40  # share of the 16-bit peak a flash-attention fwd+bwd reaches (head_dim 128)
    fused_attention_efficiency: float | None = None  # the same for the GPU's native fused kernel (None: as above)
    memory_efficiency: float = 0.85  # share of the rated HBM bandwidth streaming kernels reach
    sms: int = 0  # streaming multiprocessors (compute units) that collective kernels compete for; 0: none
    host_link_gbps: float = 0.0  # the GPU's link to host memory (PCIe x16) per direction; 0: none known
    host_memory_gbps: float = 0.0  # DRAM bandwidth of the whole host of a node, shared by its ranks; 0: unknown
    is_cpu: bool = False  # memory is the process's resident set (torch itself included), not HBM

    @property
    def hbm_bytes_per_s(self) -> float:
        """What streaming (element-wise, optimizer) kernels achieve."""
        return self.hbm_gbps * 1e9 * self.memory_efficiency

    def attention(self, fused: bool) -> float:
        """FlashAttention-2's efficiency, or with `fused` the GPU's own fused kernel's."""
        if fused and self.fused_attention_efficiency is not None:
            return self.fused_attention_efficiency
        return self.attention_efficiency

    def matmul_peak(self, dtype: str, tf32: bool) -> float:
        """Dense FLOP/s of a training matmul in train.dtype `dtype`: fp32 on the TF32 tensor cores
        where `tf32` (train.tf32) and the GPU has them, fp16 at the 16-bit rate."""
        if dtype == "fp32" and tf32 and "tf32" in self.peak_tflops:
            dtype = "tf32"
        return self.peak({"fp16": "bf16"}.get(dtype, dtype))

    def peak(self, dtype: str) -> float:
        """Dense FLOP/s of a matmul in `dtype` (fp8 falls back to the 16-bit rate where the GPU has none)."""
        table = self.peak_tflops
        return 1e12 * table.get(dtype, table.get("bf16", table["fp32"]))


# Datasheet figures, dense (no sparsity). Networks: one 200 Gb/s HDR NIC per A100 (DGX A100),
# one 400 Gb/s NIC per GPU elsewhere. Efficiencies are typical published measurements: cuBLAS
# on large bf16 GEMMs (A100 ~250-270 of 312, H100 ~700-800 of 989, MI300X ~55-60% of peak);
# PyTorch's flash-attention-2 kernels, forward and backward together (A100 ~60% of peak; Hopper
# ~30%, as FA2 does not use its asynchronous tensor-core instructions). Hopper's fused kernels
# (FlashAttention-3, cuDNN 9's, which Transformer Engine calls) use them: Shah et al. 2024
# (FlashAttention-3, arXiv 2407.08608) measure 1.5-2.0x FA2's forward and 1.5-1.75x its backward,
# up to 740 TFLOP/s (75%) forward in bf16: 1.65x FA2's fwd+bwd share, `fused_attention_efficiency`.
# `sms`: streaming multiprocessors of the datasheets (A100 108, H100 SXM and H200 132, B200 148;
# MI300X 304 compute units).
# Host side, for optimizer offload (datasheet rates, not measured on a GPU): `host_link_gbps` is
# the GPU's PCIe x16 link per direction: Gen4 (32 GB/s) on the A100 (datasheet: "PCIe Gen4 64 GB/s",
# both directions), Gen5 (64 GB/s) on H100, H200 ("PCIe Gen5 128 GB/s") and MI300X ("PCIe Gen 5 x16,
# 128 GB/s"); the B200 has Gen6 but its DGX/HGX hosts (Xeon Emerald Rapids) run Gen5. `host_memory_gbps`
# is the DRAM bandwidth of the node the GPU ships in, two sockets' channels x transfer rate x 8 bytes:
# DGX A100, 2x AMD EPYC 7742, 16 channels DDR4-3200: 409.6 GB/s; DGX H100 and H200, 2x Xeon Platinum
# 8480C, 16 channels DDR5-4800: 614.4 GB/s; DGX B200, 2x Xeon Platinum 8570, 16 channels DDR5-5600:
# 716.8 GB/s. MI300X hosts vary (no reference system): unknown, set it in the cluster file.
GPUS: dict[str, GPU] = {g.name: g for g in [
    GPU("A100-80GB-SXM", {"fp32": 19.5, "tf32": 156, "bf16": 312, "fp16": 312}, 80, 2039, 300, 25,
        gemm_efficiency=0.78, attention_efficiency=0.60, sms=108, host_link_gbps=32, host_memory_gbps=409.6),
    GPU("H100-SXM", {"fp32": 67, "tf32": 495, "bf16": 989, "fp16": 989, "fp8": 1979}, 79.6, 3350, 450, 50,
        gemm_efficiency=0.75, attention_efficiency=0.30, fused_attention_efficiency=0.50, sms=132,
        host_link_gbps=64, host_memory_gbps=614.4),
    # The 96 GB HBM2e H100 at a 500 W cap (torchtitan's benchmark machines, Grand Teton): its
    # rated peak sits between the H100 NVL (835 TFLOP/s) and the 700 W SXM part (989), and under
    # sustained tensor-core load the power cap pulls its clock down to ~78% of the 700 W part's
    # achieved rates (hence the lower efficiencies).
    GPU("H100-96GB-500W", {"fp32": 60, "tf32": 450, "bf16": 900, "fp16": 900, "fp8": 1800}, 94, 2400, 450, 50,
        gemm_efficiency=0.58, attention_efficiency=0.26, fused_attention_efficiency=0.43, sms=132,
        host_link_gbps=64, host_memory_gbps=614.4),
    # H200: GEMM and fused-attention efficiencies measured on one (`tetrad bench gemm`, torch
    # 2.11+cu130, 2026-12-04): bf16 matmuls at training shapes sustained 666 TFLOP/s over 2 s at
    # 8192^3 (662-700 over 0.2 s), 0.71 of the datasheet peak after the shape law; cuDNN's causal
    # attention (head dim 128, 16k tokens, fwd+bwd) 579-589 TFLOP/s, 0.59; FlashAttention-2's
    # 241-311, 0.24-0.31 (0.30 kept).
    GPU("H200", {"fp32": 67, "tf32": 495, "bf16": 989, "fp16": 989, "fp8": 1979}, 140, 4800, 450, 50,
        gemm_efficiency=0.71, attention_efficiency=0.30, fused_attention_efficiency=0.59, sms=132,
        host_link_gbps=64, host_memory_gbps=614.4),
    # B200 (SXM, 1000 W): dense bf16 2250 and fp8 4500 TFLOP/s, 8 TB/s HBM3e, 180 GB, NVLink 5 at 1.8 TB/s
    # both ways (NVIDIA's HGX B200 figures halved for sparsity). Its GEMM efficiency is the H100's
    # scaled by the two chips' measured maximum achievable matmul FLOPS (Bekman, ml-engineering,
    # insights/when-to-upgrade-gpus: bf16 1745.0 of 2250 = 77.6% on B200, 794.5 of 989 = 80.3% on
    # H100/H200; fp8 76.3% on B200, 73.4% on H200): 0.75 x 77.6 / 80.3 = 0.72.
    GPU("B200", {"fp32": 80, "tf32": 1100, "bf16": 2250, "fp16": 2250, "fp8": 4500}, 179, 8000, 900, 50,
        gemm_efficiency=0.72, attention_efficiency=0.40, sms=148, host_link_gbps=64, host_memory_gbps=716.8),
    GPU("MI300X", {"fp32": 163, "tf32": 654, "bf16": 1307, "fp16": 1307, "fp8": 2615}, 191.5, 5300, 448, 50,
        gemm_efficiency=0.58, attention_efficiency=0.30, sms=304, host_link_gbps=64),
    # One rank (one core) of a CPU machine (tetrad's tests); `tetrad bench` measures the real
    # figures. Peaks of the AVX-512 cores here (AMD EPYC, 2.6 GHz base, two 256-bit FMA pipes: 32
    # fp32 FLOP a cycle, ~0.12 TFLOP/s at boost; AVX512_BF16 dot products twice that; no fp16
    # arithmetic). Measured 2026-12-03 on one thread: 87 GFLOP/s fp32 and 189 bf16 for a
    # 2048-square matmul, 114 fp32 in a training step of a 4-layer d_model-512 model. These make
    # MFU below 100% and tiny CPU runs estimable (memory above all).
    GPU("CPU", {"fp32": 0.12, "bf16": 0.24, "fp16": 0.02}, 4, 10, 1.0, 1.0,
        intra_alpha_s=2e-4, inter_alpha_s=2e-4, gemm_efficiency=0.5, attention_efficiency=0.3, is_cpu=True),
]}


@dataclass(frozen=True)
class Cluster:
    gpu: GPU
    gpus_per_node: int = 8
    nodes: int = 1
    host_memory_gib: float | None = None  # RAM per node where known (a DGX's datasheet, a cluster file)

    @property
    def world(self) -> int:
        return self.gpus_per_node * self.nodes


# Built-in clusters for --cluster: (GPU, GPUs per node, nodes).
CLUSTERS: dict[str, tuple[str, int, int]] = {
    "dgx-a100": ("A100-80GB-SXM", 8, 1), "dgx-h100": ("H100-SXM", 8, 1), "dgx-h200": ("H200", 8, 1),
    "h200x8": ("H200", 8, 1), "dgx-b200": ("B200", 8, 1), "mi300x-8": ("MI300X", 8, 1),
    "h100x64": ("H100-SXM", 8, 8), "h100x1024": ("H100-SXM", 8, 128), "h100x16384": ("H100-SXM", 8, 2048),
    "cpu": ("CPU", 8, 1),
}
# RAM per node of the DGX systems (datasheets: DGX A100 640GB, DGX H100, DGX H200 and DGX B200 all
# "2TB" of system memory; the B200's is configurable to 4TB); the other clusters' is unknown.
NODE_RAM_GIB = {"dgx-a100": 2048, "dgx-h100": 2048, "dgx-h200": 2048, "dgx-b200": 2048}


def offload_unknown(cluster: Cluster) -> str | None:
    """Why `train.offload_optimizer` cannot be costed on `cluster` (None: it can): the runtime
    refuses it on a CPU, and its time needs the host link and the host's memory bandwidth."""
    gpu = cluster.gpu
    if gpu.is_cpu:
        return ("train.offload_optimizer moves optimizer state off an accelerator and this cluster's ranks are "
                "CPUs: set train.offload_optimizer=false")
    if not gpu.host_link_gbps or not gpu.host_memory_gbps:
        return (f"the {gpu.name} profile has no host link or host memory bandwidth to cost train.offload_optimizer "
                "with: set host_link_gbps (per GPU) and host_memory_gbps (the node's DRAM) in a cluster file")
    return None


def load_gpu(name_or_path: str) -> GPU:
    """A built-in profile by name, or a measured profile JSON file (docs/planner.md)."""
    if name_or_path in GPUS:
        return GPUS[name_or_path]
    path = Path(name_or_path)
    if path.suffix == ".json" and path.is_file():
        return _measured_profile(path)
    close = difflib.get_close_matches(name_or_path, list(GPUS), n=1)
    hint = f" (did you mean {close[0]!r}?)" if close else ""
    raise HardwareError(f"unknown GPU {name_or_path!r}{hint}; known: {', '.join(GPUS)} "
                        "(or the path of a measured profile .json written by `tetrad bench`)")


def _measured_profile(path: Path) -> GPU:
    """A `tetrad bench` profile: its figures over a built-in `base` (default CPU). Measured peaks
    are achieved rates, so their efficiency defaults to 1 (the shape law still applies)."""
    try:
        data = json.loads(path.read_text())
    except json.JSONDecodeError as e:
        raise HardwareError(f"{path} is not valid JSON: {e}") from None
    base = load_gpu(data.get("base", "CPU"))
    links = data.get("links", {})
    intra = links.get("intra_node", {})
    inter = links.get("inter_node", intra)
    return replace(base, name=data.get("name", path.stem),
                   peak_tflops={**base.peak_tflops, **data.get("peak_tflops", {})},
                   gemm_efficiency=data.get("gemm_efficiency", 1.0 if "peak_tflops" in data else base.gemm_efficiency),
                   attention_efficiency=data.get("attention_efficiency", base.attention_efficiency),
                   fused_attention_efficiency=data.get("fused_attention_efficiency", base.fused_attention_efficiency),
                   hbm_gib=data.get("memory_gib", base.hbm_gib), hbm_gbps=data.get("memory_gbps", base.hbm_gbps),
                   memory_efficiency=1.0 if "memory_gbps" in data else base.memory_efficiency,
                   intra_gbps=intra.get("beta_gbps", base.intra_gbps),
                   intra_alpha_s=intra.get("alpha_s", base.intra_alpha_s),
                   inter_gbps=inter.get("beta_gbps", base.inter_gbps),
                   inter_alpha_s=inter.get("alpha_s", base.inter_alpha_s))


CLUSTER_KEYS = {"gpu", "gpus_per_node", "nodes", "intra_node_gbps", "inter_node_gbps", "peak_tflops",
                "gemm_efficiency", "attention_efficiency", "memory_gib", "host_link_gbps", "host_memory_gbps",
                "host_memory_gib"}


def load_cluster(name_or_path: str) -> Cluster:
    """A built-in cluster name, or a TOML file with one [cluster] table (docs/planner.md)."""
    if name_or_path in CLUSTERS:
        gpu, per_node, nodes = CLUSTERS[name_or_path]
        return Cluster(GPUS[gpu], per_node, nodes, NODE_RAM_GIB.get(name_or_path))
    path = Path(name_or_path)
    if not path.is_file():
        raise HardwareError(f"unknown cluster {name_or_path!r}: neither a built-in ({', '.join(CLUSTERS)}) "
                            "nor a cluster TOML file")
    try:
        table = tomllib.loads(path.read_text()).get("cluster")
    except tomllib.TOMLDecodeError as e:
        raise HardwareError(f"{path} is not valid TOML: {e}") from None
    if not isinstance(table, dict) or "gpu" not in table:
        raise HardwareError(f"{path} needs a [cluster] table with at least `gpu` (one of {', '.join(GPUS)} "
                            "or a measured profile .json)")
    unknown = set(table) - CLUSTER_KEYS
    if unknown:
        raise HardwareError(f"{path}: unknown [cluster] keys {sorted(unknown)}; keys are {sorted(CLUSTER_KEYS)}")
    gpu_ref = str(table["gpu"])
    if gpu_ref.endswith(".json") and not Path(gpu_ref).is_absolute():
        gpu_ref = str(path.parent / gpu_ref)
    gpu = load_gpu(gpu_ref)
    gpu = replace(gpu, intra_gbps=table.get("intra_node_gbps", gpu.intra_gbps),
                  inter_gbps=table.get("inter_node_gbps", gpu.inter_gbps),
                  gemm_efficiency=table.get("gemm_efficiency", gpu.gemm_efficiency),
                  attention_efficiency=table.get("attention_efficiency", gpu.attention_efficiency),
                  hbm_gib=table.get("memory_gib", gpu.hbm_gib),
                  host_link_gbps=table.get("host_link_gbps", gpu.host_link_gbps),
                  host_memory_gbps=table.get("host_memory_gbps", gpu.host_memory_gbps),
                  peak_tflops={**gpu.peak_tflops, **table.get("peak_tflops", {})})
    ram = table.get("host_memory_gib")
    return Cluster(gpu, int(table.get("gpus_per_node", 8)), int(table.get("nodes", 1)),
                   None if ram is None else float(ram))


def cluster_of(gpu: str, gpus: int, gpus_per_node: int = 8) -> Cluster:
    """`gpus` GPUs of one kind, `gpus_per_node` to a node."""
    per_node = min(gpus_per_node, gpus)
    return Cluster(load_gpu(gpu), per_node, max(1, gpus // per_node))
