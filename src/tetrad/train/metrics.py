"""Per-step metrics: where a step's time went (StepClock), MFU/HFU (FlopRate), and their outputs:
`RUN_DIR/metrics.jsonl` (a contract, docs/design.md), the rank-0 progress bar or plain log lines and,
optionally, TensorBoard and wandb."""

from __future__ import annotations

import contextlib
import datetime
import json
import sys
import time
from collections import defaultdict
from collections.abc import Callable
from pathlib import Path

import torch
from tqdm import tqdm

from tetrad import device as devices
from tetrad.config.sections import zero_shard
from tetrad.dist.layout import REPORTED
from tetrad.model import flops
from tetrad.plan.cost import mfu_peak
from tetrad.plan.hardware import GPU, GPUS

# Fields every line carries (docs/design.md, metrics.jsonl contract; tests/test_breakdown.py checks them).
CONTRACT_FIELDS = ("step", "loss", "lr", "grad_norm", "global_batch", "step_time_s", "tokens_per_s", "mfu",
                   "compute_s", "exposed_comm_s", "bubble_s", "comm_bytes")
# The parts a step's time is split into (StepClock): they tile the step, so they add up to step_time_s.
PARTS = ("compute_s", "exposed_comm_s", "bubble_s", "optimizer_s", "data_s")


class StepClock:
    """Splits one step's time into parts that tile it: each part runs from the previous one's end
    mark (the step's start, for the first) to its own, so the host glue between phases belongs
    to the next phase and the parts add up to the step's time (`elapsed`) exactly. Each is
    measured, not left over:

    - exposed communication per group and the pipeline bubble: tetrad.comm's time blocked in
      collectives (waits on pipeline neighbours, "pp", are the bubble);
    - compute: the forward/backward phase (the schedule's actions and the host work between
      them) less the collectives waited on inside it;
    - optimizer: gradient reduction, clipping and the update, less their collective waits;
    - data: fetching the step's batches.

    Every time is read between two marks of the device's clock (`comm.clock`, device.py): host
    timers on CPU; stream events on an accelerator, where the host only enqueues and a host timer
    would find the waits empty and the time at the next synchronisation. Marks are read in
    `breakdown`, after the step's synchronisation, so measuring adds none.
    """

    def __init__(self, comm):
        self.comm = comm
        # Per part: (start mark, end mark, the slice of comm.spans made inside it).
        self.parts: dict[str, list[tuple]] = defaultdict(list)
        self._first = self._last = None  # the step's start mark; the last part's end mark

    def start(self) -> None:
        self.comm.reset()
        self.parts.clear()
        self._first = self._last = self.comm.clock.mark()

    @contextlib.contextmanager
    def part(self, name: str):
        """Time a phase of the step, from the previous part's end, and the collective waits (by
        group) inside it."""
        first = len(self.comm.spans)
        try:
            yield
        finally:
            end = self.comm.clock.mark()
            self.parts[name].append((self._last, end, slice(first, len(self.comm.spans))))
            self._last = end

    def elapsed(self) -> float:
        """The step's time so far: from `start` to the last part's end (read after the step's
        synchronisation on an accelerator)."""
        return self.comm.clock.seconds(self._first, self._last)

    def _less_waits(self, name: str) -> float:
        """Part `name`'s time less the collective waits inside it."""
        clock, spans = self.comm.clock, self.comm.spans
        return sum(clock.seconds(start, end) - sum(self.comm.seconds_by_group(spans[inside]).values())
                   for start, end, inside in self.parts[name])

    def breakdown(self) -> dict:
        """The parts (seconds)."""
        comm_s = self.comm.seconds_by_group()
        return {"compute_s": self._less_waits("forward_backward"),
                "exposed_comm_s": sum(s for g, s in comm_s.items() if g != "pp"),
                "bubble_s": comm_s.get("pp", 0.0),
                "optimizer_s": self._less_waits("optimizer"),
                "data_s": self._less_waits("data"),
                "exposed_comm_s_by_group": {g: comm_s.get(g, 0.0) for g in REPORTED}}


def device_profile(device: torch.device) -> GPU | None:
    """The built-in hardware profile of this device (plan/hardware.py), for MFU: "CPU" (one rank
    of a CPU machine, what the planner's "cpu" cluster uses) on CPU; on an accelerator the
    profile whose model number its name contains (the first such, e.g. H100-SXM for any H100);
    None when none matches."""
    if device.type == "cpu":
        return GPUS["CPU"]
    name = devices.accelerator_properties(device).name if device.type == "cuda" else ""
    return next((g for g in GPUS.values() if g.name.split("-")[0] in name), None)


class FlopRate:
    """MFU and HFU of a step with the planner's FLOP convention (model/flops.py: causal attention
    counted in full, recomputation only in HFU): this rank's share of the model FLOPs of the
    step's global batch (a ramp-up's smaller one included), per second of step time, over the peak
    of `device_profile` (fp32's, or TF32's under train.tf32, for fp32 training, else the 16-bit
    peak, as `tetrad estimate`); on a CPU, the profile's core times the rank's intra-op threads."""

    def __init__(self, cfg, device: torch.device):
        m, t = cfg.model, cfg.train
        per_sample = m.seq_len / cfg.parallel.world_size  # a rank's share of one sample's tokens
        self.model_flops = flops.model_flops_per_token(m) * per_sample
        self.hardware_flops = flops.hardware_flops_per_token(m, t.recompute,
                                                             loss_chunked=t.loss_chunk_tokens > 0) * per_sample
        gpu = device_profile(device)
        cores = torch.get_num_threads() if device.type == "cpu" else 1  # the CPU profile is one core's
        self.peak = mfu_peak(gpu, t.dtype, t.tf32) * cores if gpu else None

    def __call__(self, step_time_s: float, global_batch: int) -> dict:
        if self.peak is None:
            return {"mfu": None, "hfu": None}
        per_second = global_batch / step_time_s / self.peak
        return {"mfu": self.model_flops * per_second, "hfu": self.hardware_flops * per_second}


class MetricsLog:
    """Rank 0's outputs of each optimizer step: a line of `RUN_DIR/metrics.jsonl`; a progress bar
    when stdout is a terminal, else a plain log line every `run.log_every` steps (a SLURM log
    reads line by line); optionally TensorBoard scalars (RUN_DIR/tensorboard/) and wandb. Once
    stdout's reader has left (`| head`) it says so to `on_closed` (the run stops and saves:
    stopping.py), prints no more lines there, and its notes go to stderr."""

    def __init__(self, cfg, first_step: int, enabled: bool, on_closed: Callable[[], None] = lambda: None):
        self.enabled, self.total, self.every, self.first_step = enabled, cfg.train.steps, cfg.run.log_every, first_step
        self.on_closed, self.closed = on_closed, False
        self.final_batch = cfg.train.global_batch  # a line names the step's batch while a ramp-up is below it
        self.file = self.bar = self.board = self.wandb = None
        self.start = time.perf_counter()
        if not enabled:
            return
        run_dir = Path(cfg.run.dir)
        run_dir.mkdir(parents=True, exist_ok=True)
        self.file = open(run_dir / "metrics.jsonl", "a" if first_step else "w")
        if sys.stdout.isatty():
            self.bar = tqdm(total=self.total, initial=first_step, desc="train", unit="step",
                            dynamic_ncols=True, file=sys.stderr, mininterval=0.5)
        if cfg.run.tensorboard:  # optional dependencies; config validation has checked they are installed
            from torch.utils.tensorboard import SummaryWriter
            self.board = SummaryWriter(str(run_dir / "tensorboard"), purge_step=first_step + 1)
        if cfg.run.wandb:
            import wandb
            self.wandb = wandb.init(project=cfg.run.wandb_project, name=cfg.run.wandb_name or run_dir.name,
                                    dir=str(run_dir), config=cfg.to_dict())

    def log(self, record: dict) -> None:
        if not self.enabled:
            return
        self.file.write(json.dumps(record) + "\n")
        self.file.flush()
        if self.bar is not None:
            self.bar.set_postfix_str(progress_line(record), refresh=False)
            self.bar.update(1)
        elif record["step"] % self.every == 0 or record["step"] in (self.first_step + 1, self.total) \
                or "val_loss" in record:
            self._print(self.plain_line(record))
        if self.board is not None:
            for tag, value in scalars(record):
                self.board.add_scalar(tag, value, record["step"])
        if self.wandb is not None:
            self.wandb.log(dict(scalars(record)), step=record["step"])

    def note(self, text: str) -> None:
        """A message line from rank 0 that does not tear the progress bar."""
        if self.bar is not None:
            self.bar.write(text, file=sys.stdout)
        elif self.enabled:
            self._print(text, notes=True)

    def _print(self, text: str, notes: bool = False) -> None:
        """A line on stdout while it has a reader; after, a note on stderr and the rest nowhere."""
        if not self.closed:
            try:
                print(text, flush=True)
                return
            except BrokenPipeError:
                self.closed = True
                self.on_closed()
        if notes:
            print(text, file=sys.stderr, flush=True)

    def plain_line(self, record: dict) -> str:
        """E.g. "step 20/200 | loss 4.2107, 812 tok/s | ... | lr 3.00e-03 | 0:00:41 elapsed, 0:06:09 left"."""
        elapsed = time.perf_counter() - self.start
        done = record["step"] - self.first_step
        left = elapsed / done * (self.total - record["step"])
        ramping = f"batch {record['global_batch']}, " if record.get("global_batch", self.final_batch) != self.final_batch else ""
        return (f"step {record['step']}/{self.total} | {progress_line(record)} | {ramping}lr {record['lr']:.2e} | "
                f"{_clock(elapsed)} elapsed, {_clock(left)} left")

    def close(self) -> None:
        if self.enabled:
            if self.bar is not None:
                self.bar.close()
            self.file.close()
            if self.board is not None:
                self.board.close()
            if self.wandb is not None:
                self.wandb.finish()


def _clock(seconds: float) -> str:
    return str(datetime.timedelta(seconds=round(seconds)))


def layout_label(p) -> str:
    """A [parallel] section in a few words, e.g. "dp2 tp2 pp2 cp1 zero1 sp" ("zero3 shard8": hybrid
    ZeRO's blocks; "ep2": expert parallelism): what sets a step's communication."""
    words = [f"dp{p.dp}", f"tp{p.tp}", f"pp{p.pp}", f"cp{p.cp}"] + ([f"vpp{p.vpp}"] if p.vpp > 1 else [])
    words += [f"ep{p.ep}"] if p.ep > 1 else []
    words += [f"zero{p.zero}"] + ([f"shard{zero_shard(p)}"] if zero_shard(p) else [])
    return " ".join(words + (["sp"] if p.sequence_parallel and p.tp > 1 else []))


def progress_line(record: dict) -> str:
    """Loss, throughput, MFU and the time split, e.g.
    "loss 4.2107, 812 tok/s, mfu 3.1% | compute 41% comm 30% bubble 22% opt 6% data 0%"
    (", val_loss ..." on evaluation steps and ", mtp 4.5012 4.9821" under multi-token prediction after the loss)."""
    step = record["step_time_s"]
    mfu = f", mfu {100 * record['mfu']:.1f}%" if record.get("mfu") is not None else ""
    val = f", val_loss {record['val_loss']:.4f}" if "val_loss" in record else ""
    if "mtp_loss" in record:  # multi-token prediction's depths, 1 first
        val += ", mtp " + " ".join(f"{loss:.4f}" for loss in record["mtp_loss"])
    split = " ".join(f"{name} {100 * record[key] / step:.0f}%" for name, key in
                     (("compute", "compute_s"), ("comm", "exposed_comm_s"), ("bubble", "bubble_s"),
                      ("opt", "optimizer_s"), ("data", "data_s")) if key in record)
    return f"loss {record['loss']:.4f}{val}, {record['tokens_per_s']:.0f} tok/s{mfu} | {split}"


def scalars(record: dict, prefix: str = ""):
    """(tag, number) for every numeric field, nested dicts as "comm_bytes/tp", lists by 1-based
    place ("mtp_loss/1": depth 1's)."""
    for key, value in record.items():
        if key == "step":
            continue
        if isinstance(value, list):
            value = {str(i): v for i, v in enumerate(value, 1)}
        if isinstance(value, dict):
            yield from scalars(value, f"{prefix}{key}/")
        elif isinstance(value, (int, float)):
            yield f"{prefix}{key}", float(value)
