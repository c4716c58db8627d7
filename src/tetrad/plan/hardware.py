"""Hardware the cost model knows: GPU profiles from datasheets, clusters, measured profiles.

Bandwidths are per GPU, one direction, in GB/s: `intra_gbps` over NVLink/xGMI inside a node,
`inter_gbps` over the network (one NIC's share per GPU). A measured profile (JSON written by
`tetrad bench`) replaces any of these numbers; see docs/planner.md for its format.
"""

from __future__ import annotations

import json
import sys
from dataclasses import dataclass, replace
from pathlib import Path

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover
    import tomli as tomllib


@dataclass(frozen=True)
class GPU:
    name: str
    peak_tflops: dict  # dense peak by dtype: "fp32", "bf16", "fp16", "fp8"
    hbm_gib: float
    hbm_gbps: float
    intra_gbps: float  # NVLink/xGMI per GPU per direction
    inter_gbps: float  # network per GPU per direction
    intra_alpha_s: float = 5e-6  # latency of one collective step inside a node
    inter_alpha_s: float = 15e-6
    gemm_efficiency: float = 0.80  # fraction of peak a large, well-shaped GEMM reaches


# Datasheet figures (dense, no sparsity). Network: 200 Gb/s HDR per A100 (DGX A100),
# 400 Gb/s NDR per H100/H200/B200 GPU, 400 Gb/s per MI300X.
GPUS: dict[str, GPU] = {g.name: g for g in [
    GPU("A100-80GB-SXM", {"fp32": 19.5, "tf32": 156, "bf16": 312, "fp16": 312, "fp8": 312}, 80, 2039, 300, 25),
    GPU("H100-SXM", {"fp32": 67, "bf16": 989, "fp16": 989, "fp8": 1979}, 80, 3350, 450, 50),
    # The H100 with 96 GB HBM2e capped at 500 W (torchtitan's benchmark machines): lower clocks
    # under load than the 700 W part, HBM2e at 2.4 TB/s.
    GPU("H100-96GB-500W", {"fp32": 60, "bf16": 800, "fp16": 800, "fp8": 1600}, 96, 2400, 450, 50),
    GPU("H200", {"fp32": 67, "bf16": 989, "fp16": 989, "fp8": 1979}, 141, 4800, 450, 50),
    GPU("B200", {"fp32": 80, "bf16": 2250, "fp16": 2250, "fp8": 4500}, 180, 8000, 900, 50),
    GPU("MI300X", {"fp32": 163, "bf16": 1307, "fp16": 1307, "fp8": 2615}, 192, 5300, 448, 50),
    # One CPU rank of the development machines (fp32; measured-profile files replace this).
    GPU("CPU", {"fp32": 0.05, "bf16": 0.02, "fp16": 0.02, "fp8": 0.02}, 24, 10, 1.0, 1.0,
        intra_alpha_s=2e-4, inter_alpha_s=2e-4, gemm_efficiency=0.5),
]}


@dataclass(frozen=True)
class Cluster:
    gpu: GPU
    gpus_per_node: int = 8
    nodes: int = 1

    @property
    def world(self) -> int:
        return self.gpus_per_node * self.nodes


CLUSTERS = {
    "dgx-a100": ("A100-80GB-SXM", 8, 1), "dgx-h100": ("H100-SXM", 8, 1), "h100x1024": ("H100-SXM", 8, 128),
    "h100x16384": ("H100-SXM", 8, 2048), "h200x8": ("H200", 8, 1), "cpu": ("CPU", 8, 1),
}


class HardwareError(ValueError):
    pass


def load_gpu(name_or_path: str) -> GPU:
    """A built-in profile by name, or a measured profile JSON file (docs/planner.md)."""
    if name_or_path in GPUS:
        return GPUS[name_or_path]
    path = Path(name_or_path)
    if path.suffix == ".json" and path.is_file():
        data = json.loads(path.read_text())
        base = GPUS.get(data.get("base", "CPU"), GPUS["CPU"])
        links = data.get("links", {})
        intra, inter = links.get("intra_node", {}), links.get("inter_node", links.get("intra_node", {}))
        return replace(base, name=data.get("name", path.stem),
                       peak_tflops={**base.peak_tflops, **data.get("peak_tflops", {})},
                       gemm_efficiency=data.get("gemm_efficiency", 1.0 if "peak_tflops" in data else base.gemm_efficiency),
                       hbm_gib=data.get("memory_gib", base.hbm_gib), hbm_gbps=data.get("memory_gbps", base.hbm_gbps),
                       intra_gbps=intra.get("beta_gbps", base.intra_gbps),
                       intra_alpha_s=intra.get("alpha_s", base.intra_alpha_s),
                       inter_gbps=inter.get("beta_gbps", base.inter_gbps),
                       inter_alpha_s=inter.get("alpha_s", base.inter_alpha_s))
    raise HardwareError(f"unknown GPU {name_or_path!r}; known: {', '.join(GPUS)} (or a measured profile .json)")


def load_cluster(name_or_path: str) -> Cluster:
    """A built-in cluster name, or a TOML file with one [cluster] table."""
    if name_or_path in CLUSTERS:
        gpu, per_node, nodes = CLUSTERS[name_or_path]
        return Cluster(GPUS[gpu], per_node, nodes)
    path = Path(name_or_path)
    if not path.is_file():
        raise HardwareError(f"unknown cluster {name_or_path!r}: neither a built-in ({', '.join(CLUSTERS)}) "
                            "nor a TOML file")
    table = tomllib.loads(path.read_text()).get("cluster")
    if table is None:
        raise HardwareError(f"{path} has no [cluster] table")
    gpu_ref = table.get("gpu", "")
    if gpu_ref.endswith(".json") and not Path(gpu_ref).is_absolute():
        gpu_ref = str(path.parent / gpu_ref)
    gpu = load_gpu(gpu_ref)
    overrides = {k: table[k] for k in ("intra_node_gbps", "inter_node_gbps", "gemm_efficiency") if k in table}
    gpu = replace(gpu, intra_gbps=overrides.get("intra_node_gbps", gpu.intra_gbps),
                  inter_gbps=overrides.get("inter_node_gbps", gpu.inter_gbps),
                  gemm_efficiency=overrides.get("gemm_efficiency", gpu.gemm_efficiency),
                  peak_tflops={**gpu.peak_tflops, **table.get("peak_tflops", {})})
    return Cluster(gpu, int(table.get("gpus_per_node", 8)), int(table.get("nodes", 1)))


def cluster_of(gpu: str, gpus: int, gpus_per_node: int = 8) -> Cluster:
    per_node = min(gpus_per_node, gpus)
    return Cluster(load_gpu(gpu), per_node, max(1, gpus // per_node))



