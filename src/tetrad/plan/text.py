"""What `tetrad estimate` and `tetrad plan` print: one estimate broken down, the ranking as an
aligned table, and, when nothing fits, why."""

from __future__ import annotations

import dataclasses
import math

from tetrad.config import Config, ModelConfig, counted
from tetrad.config.rampup import BatchRamp
from tetrad.config.sections import zero_shard
from tetrad.model import flops
from tetrad.plan.cost import Estimate, estimate
from tetrad.plan.hardware import Cluster, offload_unknown
from tetrad.plan.memory import GIB, state_bytes_per_param
from tetrad.plan.reference import CALIBRATION_MAPE
from tetrad.plan.search import Plan, layouts

STATES = ("weights", "grads", "optimizer")


def layout_label(e: Estimate) -> str:
    p, t = e.cfg.parallel, e.cfg.train
    cp = f" cp={p.cp}{'' if p.cp == 1 else '/' + p.cp_algo}"
    sched = p.schedule + (f" vpp={p.vpp}" if p.vpp > 1 else "")
    shard = f" zero_shard={zero_shard(p)}" if zero_shard(p) else ""
    ep = f" ep={p.ep}" if p.ep > 1 else ""
    return (f"tp={p.tp} pp={p.pp}{cp} dp={p.dp}{ep} zero={p.zero}{shard} {sched} mb={t.micro_batch} "
            f"recompute={t.recompute}" + (f" loss_chunk={t.loss_chunk_tokens}" if t.loss_chunk_tokens else "")
            + (" offload" if t.offload_optimizer else ""))


def decimals(seconds: float) -> int:
    """Decimals that show `seconds` to three significant digits, and at least three (a tiny
    model's step is microseconds, which three decimals would print as 0.000)."""
    return max(3, 2 - math.floor(math.log10(seconds))) if seconds > 0 else 3


def table(estimates: list[Estimate]) -> list[str]:
    """One line per estimate under a header, every column aligned (widths from the content)."""
    d = decimals(min((e.step_time_s for e in estimates), default=1.0))
    head = ("layout", "step (s)", "tok/s/GPU", "MFU", "GiB/GPU", "bubble", "comm", "fits")
    rows = [head] + [(layout_label(e), f"{e.step_time_s:.{d}f}", f"{e.tokens_per_s / e.cfg.parallel.world_size:,.0f}",
                      f"{100 * e.mfu:.1f}%", _gib(e.peak_memory_gib), f"{100 * e.bubble_fraction:.1f}%",
                      f"{100 * _exposed_comm(e) / e.step_time_s:.1f}%", "yes" if e.fits else "NO")
                     for e in estimates]
    widths = [max(len(row[i]) for row in rows) for i in range(len(head))]
    return ["  ".join(cell.ljust(w) if i == 0 else cell.rjust(w) for i, (cell, w) in enumerate(zip(row, widths)))
            for row in rows]


def _gib(gib: float) -> str:
    """One decimal, or two significant digits below 0.1 GiB (a tiny model's 0.0042 is not 0.0)."""
    return f"{gib:.1f}" if gib >= 0.1 else f"{gib:.2g}"


def _exposed_comm(e: Estimate) -> float:
    return sum(v for k, v in e.breakdown.items() if k.endswith("_comm"))


def describe(e: Estimate) -> str:
    """The readable report of one estimate: time, memory and utilisation broken down."""
    d = decimals(e.step_time_s) + 1
    lines = [layout_label(e), model_line(e.cfg.model), "",
             f"  step time      {e.step_time_s:.{d}f} s    tokens/s {e.tokens_per_s:,.0f} "
             f"({e.tokens_per_s / e.cfg.parallel.world_size:,.0f} per GPU)",
             f"  MFU / HFU      {100 * e.mfu:.1f}% / {100 * e.hfu:.1f}%    model TFLOP/s per GPU "
             f"{e.model_tflops_per_gpu:.4g}",
             f"  bubble         {100 * e.bubble_fraction:.1f}% of pipeline rank-time", "",
             "  time per step, busiest pipeline rank (exposed parts only):"]
    lines += [f"    {k:<18} {v:{d + 6}.{d}f} s  {100 * v / e.step_time_s:5.1f}%" for k, v in e.breakdown.items()]
    verdict = "fits" if e.peak_memory_gib <= e.usable_gib else "DOES NOT FIT"  # the GPU's; the host's below
    lines += ["", f"  memory per GPU, worst pipeline rank: {e.peak_memory_gib:.2f} GiB of {e.usable_gib:.1f} usable "
                  f"({e.hbm_gib:.1f} GiB) -> {verdict}"]
    lines += [f"    {k:<12} {v:9.2f} GiB" for k, v in e.memory.gib().items()]
    lines += _host_lines(e)
    if e.peak_memory_gib > e.usable_gib:
        chunk = "" if e.cfg.train.loss_chunk_tokens else "the head's loss in chunks (train.loss_chunk_tokens), "
        lines.append(f"  to fit: {chunk}more recompute, a higher ZeRO stage, a smaller micro-batch, more tp/pp, or "
                     "train.offload_optimizer (`tetrad plan` ranks the layouts that fit)")
    elif e.host_fits is False:
        lines.append("  to fit the host: a higher ZeRO stage or more GPUs (fewer parameters updated per rank), "
                     "or checkpoint.async_save = false")
    return "\n".join(lines)


def model_line(m: ModelConfig) -> str:
    """The model's parameters (the multi-token prediction modules' named apart where it has them),
    and under MoE the share a token uses (what its FLOPs count), the shared expert and the dense
    layers named where the model has them."""
    line = f"  model          {flops.parameter_count(m) / 1e9:.4g}B parameters"
    if m.mtp_layers:
        line += f" ({flops.mtp_parameter_count(m) / 1e9:.4g}B of them {counted(m.mtp_layers, 'multi-token prediction module')})"
    if m.n_experts:
        shared = (f" + a shared expert of {m.shared_expert_ffn_hidden}{' (gated)' if m.shared_expert_gate else ''}"
                  if m.shared_expert_ffn_hidden else "")
        dense = (f"; {counted(len(m.dense_layers), 'dense layer')} {sorted(m.dense_layers)} of {m.ffn_hidden}"
                 if m.dense_layers else "")
        line += (f", {flops.parameter_count(m, active=True) / 1e9:.4g}B active per token ({m.n_experts} experts "
                 f"of {m.expert_hidden}, top-{m.experts_per_token}{shared}{dense}; FLOPs and MFU count the active ones)")
    return line


def ramp_lines(e: Estimate, cluster: Cluster, stack: str) -> list[str]:
    """A batch ramp-up's share of the run (train.batch_rampup): its steps and samples, and their
    time at each of its batches' estimated step time; the estimate itself is the final batch's."""
    t = e.cfg.train
    stages = [(b, n) for b, n in BatchRamp.of(t).stages(t.steps) if b < t.global_batch]
    if not stages:
        return []
    ramp_s = sum(n * estimate(dataclasses.replace(e.cfg, train=dataclasses.replace(t, global_batch=b, batch_rampup=[])),
                              cluster, stack).step_time_s for b, n in stages)
    steps = sum(n for _, n in stages)
    run_s = ramp_s + (t.steps - steps) * e.step_time_s
    seconds = lambda x: f"{x:,.0f} s" if x >= 10 else f"{x:.3g} s"  # noqa: E731
    return ["", f"  batch ramp-up  {steps} of the {counted(t.steps, 'step')} run global batches "
                f"{stages[0][0]}..{stages[-1][0]} "
                f"({sum(b * n for b, n in stages):,} samples) in {seconds(ramp_s)}; all {t.steps} in {seconds(run_s)}",
            f"                 (the figures above are the final batch's, {t.global_batch}: its step time and "
            "peak memory)"]


def _host_lines(e: Estimate) -> list[str]:
    """Host memory per rank (offloaded optimizer state, checkpoint staging), and per node against
    its RAM where the cluster says how much it has."""
    if not e.host_memory.total:
        return []
    node = f"{e.node_host_memory_gib:.1f} GiB ({e.ranks_per_node} x the worst rank)"
    if e.host_fits is None:
        node += " (the cluster does not say how much RAM a node has)"
    else:
        node += f" of {e.node_ram_gib:.0f} GiB of RAM -> {'fits' if e.host_fits else 'DOES NOT FIT'}"
    head = f"  host memory per rank, worst pipeline rank: {e.host_memory.total / GIB:.2f} GiB; per node {node}"
    return ["", head] + [f"    {k:<12} {v:9.2f} GiB" for k, v in e.host_memory.gib().items()]


def why_nothing_fits(closest: Estimate, cluster: Cluster) -> str:
    """One line: what the layout closest to fitting still needs, and what would change that."""
    if closest.peak_memory_gib <= closest.usable_gib:  # its GPUs hold it, its nodes' RAM does not
        return (f"no layout fits in memory: the closest fits on its GPUs but needs {_short_of(closest)} "
                "(offloaded optimizer state, checkpoint staging): use more GPUs (ZeRO shards that state too), "
                "nodes with more RAM, or checkpoint.async_save = false")
    gib = closest.memory.gib()
    states, acts = sum(gib[k] for k in STATES), gib["activations"]
    need = (f"the closest layout needs {closest.peak_memory_gib:.1f} GiB per GPU of {closest.usable_gib:.1f} usable "
            f"(model states {states:.1f}, activations {acts:.1f}, other {gib['other']:.1f})")
    offloaded = closest.cfg.train.offload_optimizer
    gpus = _gpus_for_states(closest, cluster, offloaded)
    if gpus > cluster.world:
        fewer = "" if offloaded or offload_unknown(cluster) else \
            f"; {_gpus_for_states(closest, cluster, True)} with train.offload_optimizer"
        fix = (f"the model states alone do not fit even sharded over the {cluster.world} GPUs: they need at least "
               f"{gpus} of these GPUs (a larger --cluster{fewer}), or GPUs with more memory")
    elif states >= closest.usable_gib:
        fix = (f"the model states alone do not fit in any layout's share of the {cluster.world} GPUs: use more "
               "GPUs (--gpus or a larger --cluster) or GPUs with more memory")
    elif gib["other"] > acts:
        fix = ("the buffers on top of them (`other`: gradient buckets, communication buffers, the allocator's "
               "allowance) do not fit: use more GPUs (--gpus or a larger --cluster) or GPUs with more memory")
    else:
        fix = ("the activations on top of them do not fit even with full recompute and one sequence per "
               "micro-batch: use a shorter --seq-len, more GPUs, or GPUs with more memory")
    return f"no layout fits in memory: {need}; {fix}"


def why_no_layout(base: Config, cluster: Cluster) -> str:
    """One line when no layout is legal: what every layout of the model on these GPUs needs of
    the global batch, and the nearest global batch and the largest GPU count that have one."""
    m, batch, world, per_node = base.model, base.train.global_batch, cluster.world, cluster.gpus_per_node
    if base.train.batch_rampup:
        flat = dataclasses.replace(base, train=dataclasses.replace(base.train, batch_rampup=[]))
        if any(True for _ in layouts(flat, world, per_node)):
            return (f"no legal layout runs every global batch of train.batch_rampup={base.train.batch_rampup}: each "
                    "must be a multiple of the data-parallel degree times the micro-batch, and its start give the "
                    "pipeline schedule enough micro-batches; use a start and an increment with more factors of 2")
        base = flat  # nor does the constant batch: say why for it

    def legal(global_batch: int, gpus: int) -> bool:
        cfg = dataclasses.replace(base, train=dataclasses.replace(base.train, global_batch=global_batch))
        return any(True for _ in layouts(cfg, gpus, min(per_node, gpus)))

    every = dataclasses.replace(base, train=dataclasses.replace(base.train, global_batch=16 * world))
    found = list(layouts(every, world, per_node))  # every split of the GPUs, whatever the batch
    if not found:
        return (f"no legal layout of {m.preset} on {world} GPUs: its heads, layers and sequence length do not "
                "split over them (use --gpus)")
    dps = sorted({x.dp for x in found})
    batches = sorted({-(-batch // d) * d for d in dps})
    nearer = next((b for b in batches if legal(b, world)), None)
    gpus = next((g for g in (world >> k for k in range(1, world.bit_length()))
                 if (g % per_node == 0 or g < per_node) and legal(batch, g)), None)
    fixes = [f"--global-batch {nearer}"] * (nearer is not None) + [f"--gpus {gpus}"] * (gpus is not None)
    return (f"no legal layout: the global batch ({batch}) must be a multiple of the data-parallel degree times "
            f"the micro-batch, and every layout of {m.preset} on {world} GPUs has dp >= {dps[0]} (tp <= "
            f"{max(x.tp for x in found)}, pp <= {max(x.pp for x in found)}, cp <= {max(x.cp for x in found)} for "
            f"{counted(m.n_layers, 'layer')} and sequence length {m.seq_len}); use {' or '.join(fixes)}")


def _gpus_for_states(e: Estimate, cluster: Cluster, offloaded: bool) -> int:
    """The fewest GPUs (whole nodes past one) whose memory holds the model states fully sharded
    (weights and gradients alone, `offloaded`): a lower bound, activations and buffers come on top."""
    m, (weights, grads, optimizer) = e.cfg.model, state_bytes_per_param(e.cfg.train.dtype)
    per_param = weights + grads + (0 if offloaded else optimizer)
    need = math.ceil(flops.parameter_count(m) * per_param / GIB / e.usable_gib)
    per_node = cluster.gpus_per_node
    return need if need <= per_node else -(-need // per_node) * per_node


def plan_text(result: Plan, base: Config, cluster: Cluster) -> str:
    """The ranking and why the best wins; or, when nothing fits, why and the closest layouts."""
    m = base.model
    lines = [f"{cluster.world} x {cluster.gpu.name} ({cluster.gpus_per_node} per node), {m.preset}: "
             f"{counted(m.n_layers, 'layer')}, d_model {m.d_model}; global batch {base.train.global_batch} x {m.seq_len} tokens, "
             f"{base.train.dtype}", model_line(m).strip(), f"{result.considered} legal layouts, {result.estimated} estimated in full", ""]
    fits = bool(result.ranked) and result.ranked[0].fits
    if not fits:
        lines += ["NO LAYOUT FITS IN MEMORY."]
        lines += [why_nothing_fits(result.ranked[0], cluster), "", "the closest to fitting:"] if result.ranked else []
    lines += table(result.ranked)
    if fits:
        lines += ["", confidence(result.ranked), "", "why the best wins:", describe(result.ranked[0])]
    if result.rejected:
        lines += ["", "faster on compute alone, but out of memory:"]
        lines += [f"  {layout_label(e)}: {_short_of(e)}" for e in result.rejected]
    return "\n".join(lines)


def _short_of(e: Estimate) -> str:
    """What an estimate that does not fit exceeds: its GPU's memory, or its node's RAM."""
    if e.peak_memory_gib > e.usable_gib:
        return (f"{e.peak_memory_gib:.1f} GiB > {e.usable_gib:.1f} usable (activations "
                f"{e.memory.gib()['activations']:.1f}, model states {sum(e.memory.gib()[k] for k in STATES):.1f})")
    return f"host memory {e.node_host_memory_gib:.0f} GiB a node > {e.node_ram_gib:.0f} GiB of RAM"


def confidence(ranked: list[Estimate]) -> str:
    """Each layout's step time with the spread the calibration error implies, and which layouts
    the model cannot tell from the best (their spreads overlap)."""
    err = CALIBRATION_MAPE
    best = ranked[0].step_time_s
    lines = [f"predicted step time +- {100 * err:.1f}% (the model's mean error on the published runs it was "
             f"checked against, docs/planner.md):"]
    d = decimals(best * (1 - err))
    lines += [f"  #{i + 1:<3}{e.step_time_s:{d + 6}.{d}f} s  [{e.step_time_s * (1 - err):.{d}f}, "
              f"{e.step_time_s * (1 + err):.{d}f}]"
              for i, e in enumerate(ranked)]
    close = [i + 1 for i, e in enumerate(ranked[1:], 1) if e.step_time_s * (1 - err) <= best * (1 + err)]
    if close:
        lines.append(f"  #{', #'.join(map(str, close))} within that spread of #1: the model cannot order them; "
                     "time the first steps of each")
    else:
        lines.append("  #1 is ahead of the others by more than that spread")
    return "\n".join(lines)
