"""The planner: a calibrated cost model of 4D-parallel training (docs/planner.md).

    estimate(cfg, cluster, stack="tetrad") -> Estimate     one layout: time, memory, MFU/HFU
    plan(base, cluster, top=10) -> Plan                     every legal layout, fastest that fit first
    comm_bytes_per_step(cfg) -> {"tp", "cp", "pp", "dp", "ep"}    what tetrad.comm counts on rank 0
    load_cluster(name_or_path) -> Cluster                   built-in, TOML, or measured profile

No torch here: it runs in a plain Python process.
"""

from tetrad.plan.comm_bytes import comm_bytes_per_step
from tetrad.plan.cost import Estimate, estimate
from tetrad.plan.hardware import Cluster, HardwareError, load_cluster, load_gpu
from tetrad.plan.memory import memory_by_rank
from tetrad.plan.search import Plan, plan

__all__ = ["Cluster", "Estimate", "HardwareError", "Plan", "comm_bytes_per_step", "estimate", "load_cluster",
           "load_gpu", "memory_by_rank", "plan"]
