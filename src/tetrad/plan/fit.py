"""Will a run fit its GPUs? The planner's peak per rank (memory_by_rank, what `tetrad estimate`
prints) against the device's memory, checked as the ranks start, with the one-key changes that
would fit: an out-of-memory that would come minutes into start-up, or at a pipeline schedule's
peak hours later, is named before the first step, with what to change. An out-of-memory that
happens anyway gets the planner's view added to torch's message (`oom_note`)."""

from __future__ import annotations

from dataclasses import replace

from tetrad.config import Config, ConfigError, validate
from tetrad.plan.memory import GIB, GPU_RESERVED_GIB, memory_by_rank
from tetrad.plan.search import PLANNED_LOSS_CHUNK, RECOMPUTE
from tetrad.plan.stacks import load_stack


def peak_gib(cfg: Config) -> float:
    """The largest pipeline rank's predicted peak on a GPU, in GiB."""
    return max(m.total for m in memory_by_rank(cfg, load_stack("tetrad"), is_cpu=False)) / GIB


def host_gib(cfg: Config, ranks: int, rank_base_gib: float) -> float:
    """What `ranks` CPU ranks of `cfg` on one host are predicted to hold at their peaks, in GiB:
    each pipeline rank's planner peak, repeated over its dp*tp*cp ranks, plus `rank_base_gib`
    each (a process with torch loaded, which the planner does not count)."""
    stages = [m.total for m in memory_by_rank(cfg, load_stack("tetrad"), is_cpu=True)]
    return ranks * (sum(stages) / len(stages) / GIB + rank_base_gib)


def host_memory_warning(cfg: Config, ranks: int, available_gib: float, rank_base_gib: float) -> str | None:
    """CPU ranks share the host's memory: a warning (None: it fits) when `ranks` of them are
    predicted to need more than the `available_gib` free as they start, where Linux's
    out-of-memory killer would end the run with SIGKILL, with the one-key changes that fit."""
    need = host_gib(cfg, ranks, rank_base_gib)
    if need <= available_gib:
        return None
    fits = [f"{flag} ({gib:.1f} GiB)" for flag, gib in
            ((f, host_gib(c, ranks, rank_base_gib)) for f, c in _one_key_changes(cfg, on_host=True))
            if gib <= available_gib]
    fix = f"changes of one key that fit: {', '.join(fits)}" if fits else "no change of one key fits"
    return (f"tetrad: warning: the planner predicts {need:.1f} GiB for this run's {ranks} CPU rank(s), above the "
            f"{available_gib:.1f} GiB this host has free: it will likely be killed for memory; {fix}")


def _one_key_changes(cfg: Config, on_host: bool = False) -> list[tuple[str, Config]]:
    """Changes of one key that lower memory and keep the training the same: the head's loss fused
    in chunks (the cheapest in time: one more head GEMM), more recomputation, a higher ZeRO stage,
    the optimizer on the host (unless it is there already: `on_host`), smaller micro-batches,
    sequence parallelism."""
    p, t = cfg.parallel, cfg.train
    out = [] if t.loss_chunk_tokens else [(f"--train.loss_chunk_tokens={PLANNED_LOSS_CHUNK}",
                                           replace(cfg, train=replace(t, loss_chunk_tokens=PLANNED_LOSS_CHUNK)))]
    out += [(f"--train.recompute={mode}", replace(cfg, train=replace(t, recompute=mode)))
            for mode in RECOMPUTE[RECOMPUTE.index(t.recompute) + 1:]]
    if p.dp * p.cp > 1:
        out += [(f"--parallel.zero={zero}", replace(cfg, parallel=replace(p, zero=zero))) for zero in range(p.zero + 1, 4)]
    if not t.offload_optimizer and not on_host:
        out.append(("--train.offload_optimizer=true", replace(cfg, train=replace(t, offload_optimizer=True))))
    if t.micro_batch > 1:
        out.append((f"--train.micro_batch={t.micro_batch // 2}", replace(cfg, train=replace(t, micro_batch=t.micro_batch // 2))))
    if p.tp > 1 and not p.sequence_parallel:
        out.append(("--parallel.sequence_parallel=true", replace(cfg, parallel=replace(p, sequence_parallel=True))))
    valid = []
    for flag, changed in out:
        try:
            validate(changed)
        except ConfigError:
            continue
        valid.append((flag, changed))
    return valid


def memory_warning(cfg: Config, device_gib: float) -> str | None:
    """A warning when the predicted peak exceeds the usable part of a `device_gib` device (None
    when it fits), naming each one-key change that would fit, the cheapest in time first."""
    usable = device_gib - GPU_RESERVED_GIB
    peak = peak_gib(cfg)
    if peak <= usable:
        return None
    fits = [f"{flag} ({gib:.1f} GiB)" for flag, gib in ((f, peak_gib(c)) for f, c in _one_key_changes(cfg))
            if gib <= usable]
    fix = (f"changes of one key that fit: {', '.join(fits)}" if fits else
           "no change of one key fits; `tetrad plan` ranks the layouts that do")
    return (f"tetrad: warning: the planner predicts a peak of {peak:.1f} GiB on the busiest rank, above the "
            f"{usable:.1f} GiB usable of this {device_gib:.0f} GiB device: this run will likely run out of memory; "
            f"{fix}")


def oom_note(cfg: Config, device_gib: float) -> str:
    """What tetrad adds to an out-of-memory error: the planner's peak against the usable memory
    (under it, the prediction was short: worth reporting) and the one-key changes that lower it
    most, by the same model."""
    usable, peak = device_gib - GPU_RESERVED_GIB, peak_gib(cfg)
    savings = sorted(((peak - peak_gib(c), flag) for flag, c in _one_key_changes(cfg)), reverse=True)
    biggest = ", ".join(f"{flag} (-{saved:.1f} GiB)" for saved, flag in savings[:3] if saved > 0.05)
    verdict = ("above it, as tetrad warned at the start" if peak > usable else
               "under it: the prediction was short; please report it with RUN_DIR/config.toml")
    return (f"tetrad: the planner predicted a peak of {peak:.1f} GiB on the busiest rank against {usable:.1f} GiB "
            f"usable, {verdict}. Largest predicted savings of one key: {biggest or 'none'}")
