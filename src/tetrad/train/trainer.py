"""The training loop. Runs on every rank after the process group exists.

A step: each micro-batch's forward and backward (the loss divided by the global batch's count of
labels the loss counts, so accumulation and data parallelism give the single-device gradient), the gradient reduction
over dp x cp, clipping by the true global norm, the AdamW update, metrics on rank 0.
"""

from __future__ import annotations

import contextlib
import datetime
import functools
import json
import math
import os
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from tetrad import device as devices
from tetrad.config import Config
from tetrad.config.sections import zero_shard
from tetrad.dist import autotune, watchdog
from tetrad.dist.layout import GRAD, REPORTED, WEIGHT_SPLIT_DIMS, Layout
from tetrad.dist.sequence import shard_sequence
from tetrad.dist.topology import Topology
from tetrad.model.llama import set_execution
from tetrad.model.sharding import full_state_dict, initial_value
from tetrad.model.layers import DropoutSeeds
from tetrad.model import mtp
from tetrad.parallel.data import GradReducer, ShardedAdamW
from tetrad.parallel.pipeline.registry import check_config
from tetrad.data.blend import blend_parts
from tetrad.train.batches import Batches, DataPosition, split_batches
from tetrad.train.checkpoint import Checkpointer
from tetrad.train.checkpoint.recovery import schedule_changes
from tetrad.train.expert_bias import ExpertBias
from tetrad.train.building import build_model, execution_for, starting_weights
from tetrad.train.memory import ActivationMeter
from tetrad.train.metrics import FlopRate, MetricsLog, StepClock, layout_label
from tetrad.train import telemetry
from tetrad.train.optim import lr_at
from tetrad.train.pipelines import StepPipelines, pipeline_links
from tetrad.train.precision import LossScaler
from tetrad.train.preflight import memory_watch
from tetrad.train.stopping import StopSignals, divergence_note, stop_name


class Trainer:
    def __init__(self, cfg: Config, device: torch.device, trains: bool = True):
        check_config(cfg)  # the registry's rules, which load_config cannot run: ConfigError, as `tetrad train`
        self.cfg, p = cfg, cfg.parallel
        # Memory is measured from here: on CPU a forked rank starts with its parent's pages.
        self.memory = devices.PeakMemory(device)
        # Every group starts with the start-up timeout; after the first step, the collective one.
        self.topo = Topology(Layout.of(p), device, p.ranks_per_node,
                             timeout=datetime.timedelta(seconds=p.startup_timeout_s),
                             pipeline_links=pipeline_links(cfg), comm_options=p.comm_options,
                             zero_shard=zero_shard(p))
        # Dropout differs per rank but is reproducible; weights come from the logical init.
        torch.manual_seed((cfg.train.seed + 7919 * self.topo.rank) % 2**63)
        self.activations = ActivationMeter()
        self.model = build_model(cfg, self.topo, execution_for(cfg, hold=self.activations.hold),
                                 materialise=p.zero != 3)
        set_execution(self.model, cfg.train.recompute, cfg.train.compile)
        self.dropout = DropoutSeeds(self.model)  # tp-shared masks: a function of (seed, step)
        self.expert_bias = ExpertBias(self.model, cfg.model.router_bias_update_rate, self.topo)
        self.params = [q for q in self.model.parameters() if q.requires_grad]
        dtype = devices.DTYPES[cfg.train.dtype]
        self.run_dir = Path(cfg.run.dir)
        self.checkpointer = Checkpointer.for_run(cfg, self.topo, self.run_dir)
        # "auto" bucket size and hierarchical reduction, measured on this job's links (collective),
        # or, resuming in the saved layout, what the saved run chose (checkpointer.py).
        grad_bytes = 4 * sum(q.numel() for q in self.params)
        parallel = self.checkpointer.resolve_auto(lambda: autotune.resolve(cfg.parallel, self.topo, grad_bytes))
        # ZeRO-3: each rank builds only its shard of the initial weights (build_model gave them no memory).
        shard_init = functools.partial(initial_value, seed=cfg.train.seed, weights=starting_weights(cfg)) \
            if p.zero == 3 else None
        # Buckets, ZeRO; casts the parameters to `dtype` behind fp32 master weights.
        self.grads = GradReducer(self.params, self.topo, parallel, self.model, dtype=dtype,
                                 offload=cfg.train.offload_optimizer, init=shard_init, trains=trains)
        self.optimizer = self.grads.build_optimizer(cfg.train) if trains else None  # not: weights alone, to evaluate
        self.scaler = LossScaler(enabled=cfg.train.dtype == "fp16")
        # val_parts: empty without held-out tokens (data.val_*); validation refuses eval_every without them.
        self.batches, val = split_batches(cfg)
        self.val_parts = val.split() if val is not None else []  # (weight, batches) of each source
        self.data_position = DataPosition(self.batches)
        tokens = cfg.model.seq_len // p.cp // (p.tp if self.model.execution.sequence_parallel else 1)
        shape = (cfg.train.micro_batch, tokens, cfg.model.d_model)
        # An executor per micro-batch count: a batch ramp-up (train.batch_rampup) changes it.
        self.pipelines = StepPipelines(cfg, self.model, self.topo, self.grads, shape, dtype)
        self.pipeline = self.pipelines(cfg.microbatches)  # the executor of the last step run
        self.clock = StepClock(self.topo.comm)  # where each step's time went (metrics.py)
        self.layout = layout_label(p)
        # This rank's tokens' true positions (context parallel: its two chunks of the sequence).
        self.positions = shard_sequence(torch.arange(cfg.model.seq_len, device=device), p.cp, self.topo.local_rank("cp"))
        self.signals = StopSignals()  # entered by fit; its flags ride on each step's all-reduce
        self.stop_signal = 0  # the signal the last step's ranks agreed on (0: none)
        self._activations_measured = 0  # micro-batches of the step last measured (0: none yet)
        self._counted_states: dict[str, int] | None = None
        self.flop_rate = FlopRate(cfg, device)
        self.telemetry = telemetry.for_device(device)  # None where the device reports nothing

    def forward_backward(self, microbatches, loss_tokens: int, grad_scale: float = 1.0) -> torch.Tensor:
        """Summed token loss of this rank's micro-batches (zero off the last pipeline stage); gradients
        (of the loss times `grad_scale`, fp16's loss scale, over the global batch's `loss_tokens`:
        Batches.loss_tokens) accumulate in the reducer's buckets. Every dp rank runs as many."""
        m, execution = self.cfg.model, self.model.execution
        local = self._sequence_shards(microbatches, m.mtp_layers)
        self.pipeline = self.pipelines(len(microbatches))
        # Mixture of experts: the load-balancing loss's mean over MoE layers (MTP's too) and the global batch's sequences
        # (a dense model has none, and no layer reads it)
        sequences = len(microbatches) * self.cfg.train.micro_batch * self.cfg.parallel.dp
        execution.router_loss.grad_scale = grad_scale * m.router_aux_loss / (max(m.routed_layers, 1) * sequences)
        # Multi-token prediction: each depth's summed loss over the step's counted labels, weighed (model/mtp.py)
        execution.mtp_loss.grad_scale = grad_scale * m.mtp_loss_weight / (max(m.mtp_layers, 1) * loss_tokens)
        return self.pipeline.run(local, grad_scale / loss_tokens)

    def _sequence_shards(self, microbatches, ahead: int = 0) -> list[tuple]:
        """Context parallel: this rank's two load-balanced chunks of every sequence (context.py);
        beside them the whole window's document ids (or None: no masking) and the chunks'
        positions: the one shared tensor (its RoPE tables stay cached), or under
        train.reset_positions the micro-batch's own offsets within documents, [b, s]. `ahead`
        (training, model.mtp_layers): the labels carry multi-token prediction's targets, made from
        the whole windows (mtp.pack_targets)."""
        cp, cp_rank, device = self.topo.size("cp"), self.topo.local_rank("cp"), self.topo.device

        def shard(t: torch.Tensor) -> torch.Tensor:
            return shard_sequence(t.to(device), cp, cp_rank)
        local = []
        for x, y in microbatches:
            reset, docs = self.batches.positions(x), self.batches.documents(x, device)
            if ahead:
                y = mtp.pack_targets(x, y, ahead, None if docs is None else torch.from_numpy(docs.host))
            local.append((shard(x), shard(y), docs, self.positions if reset is None else shard(reset)))
        return local

    def evaluate(self) -> dict:
        """The record's validation fields. `val_loss`: the mean token loss over `eval_steps`
        held-out global batches (the same ones each time; fewer if the held-out windows fill
        fewer). For a blend each source is evaluated apart, as Megatron-LM's multiple validation
        sets are: `val_loss_by_source`, and `val_loss` their mean at the blend's weights."""
        d = self.cfg.data
        parts = self.val_parts
        losses = [self._validation_loss(batches) for _, batches in parts]
        val_loss = float(sum(weight * loss for (weight, _), loss in zip(parts, losses)))
        if len(parts) == 1:
            return {"val_loss": val_loss}
        names = [name for _, name in blend_parts(d.val_source or d.source)]
        return {"val_loss": val_loss, "val_loss_by_source": dict(zip(names, losses))}

    @torch.no_grad()
    def _validation_loss(self, val: Batches) -> float:
        """The mean token loss over `val`'s evaluation batches (their labels the loss counts), in the training
        layout with a forward-only pipeline schedule, summed over ranks as a step's loss is. No dropout."""
        cfg, topo = self.cfg, self.topo
        total = torch.zeros((), device=topo.device)
        batches = val.eval_batches(cfg.train.eval_steps)
        self.model.eval()
        try:
            for i in range(batches):
                micro = val.microbatches(i, topo.coords["dp"], cfg.parallel.dp, cfg.train.micro_batch)
                total += self.pipelines.eval.run(self._sequence_shards(micro), 1.0)
        finally:
            self.model.train()
        self.grads.release_gathered()  # not in `finally`: after a failure it could wait on a dead rank
        topo.comm.all_reduce(total, GRAD)
        topo.comm.all_reduce(total, "pp")
        return float(total) / sum(val.loss_tokens(i) for i in range(batches))

    def _evaluates_after(self, step: int) -> bool:
        """Whether validation runs after 0-based `step`: every eval_every steps and at the last."""
        every = self.cfg.train.eval_every
        return every > 0 and ((step + 1) % every == 0 or step + 1 == self.cfg.train.steps)

    def train_step(self, step: int) -> dict:
        cfg, topo = self.cfg, self.topo
        lr = lr_at(step, cfg.train)
        for group in self.optimizer.param_groups:
            group["lr"] = lr
        self.dropout.at_step(step)
        clock = self.clock
        clock.start()
        with clock.part("data"):
            batch = self.batches.size(step)  # train.global_batch, or a ramp-up's smaller one
            micro = self.batches.microbatches(step, topo.coords["dp"], cfg.parallel.dp, cfg.train.micro_batch)
            loss_tokens = self.batches.loss_tokens(step)
        scale = self.scaler.scale
        with clock.part("forward_backward"), devices.phase("forward_backward", topo.device), \
                self._activation_meter(step, len(micro)):
            loss_sum = self.forward_backward(micro, loss_tokens, grad_scale=scale)
        with clock.part("optimizer"), devices.phase("grad_reduce", topo.device):
            self.grads.reduce()  # dp x cp (and, under SP, tp for tp-replicated parameters)
        with clock.part("optimizer"), devices.phase("optimizer", topo.device):
            self.expert_bias.reduce()
            grad_norm, loss, self.stop_signal, aux, max_load, ahead = self._step_sums(loss_sum, scale, loss_tokens)
            self.grads.clip(grad_norm, cfg.train.grad_clip, loss_scale=scale)
            # The norm is reduced over the whole job: every rank steps, or every rank skips.
            finite = math.isfinite(grad_norm)
            at_floor = not self.scaler.enabled or self.scaler.scale <= self.scaler.min_scale
            stepped = self.scaler.update(finite) and finite
            if stepped:
                self.optimizer.step()
            self.expert_bias.update()  # the step's tokens were routed, stepped or not
            model_states = self._model_states(stepped)  # gradients still held: their peak
            # ShardedAdamW's zero_grad clears the buckets too; plain AdamW's (fp32 ZeRO-0) p.grad
            # are the buckets', which GradReducer.zero_grad clears: one of the two, not both.
            (self.optimizer if isinstance(self.optimizer, ShardedAdamW) else self.grads).zero_grad()
        devices.synchronize(topo.device)
        step_time = clock.elapsed()
        peak = self.memory.bytes()
        sent = topo.comm.bytes_by_group()
        return {
            "step": step + 1, "loss": loss, "lr": lr, "grad_norm": grad_norm, "global_batch": batch, "loss_tokens": loss_tokens,
            "step_time_s": step_time, "tokens_per_s": batch * cfg.model.seq_len / step_time,
            **self.flop_rate(step_time, batch),
            # Waits on a pipeline neighbour are the bubble; every other collective wait is exposed comm.
            **clock.breakdown(),
            "comm_bytes": {g: sent.get(g, 0) for g in REPORTED},
            "layout": self.layout,  # a resume may change it: the report tells the layouts apart
            "loss_scale": scale, "skipped": not stepped,
            # Non-finite with no loss scale left to lower (fp32/bf16 have none): fit() stops the run.
            **({"diverged": True} if not finite and at_floor else {}),
            "peak_memory_gib": peak / 2**30,
            # Model states counted from this rank's tensors; activations: the peak of what autograd
            # saved for backward (train/memory.py); peak: device.peak_memory_bytes.
            "memory_bytes": {"peak": peak, **model_states, "activations": self.activations.peak},
            **({"moe_aux_loss": aux / (cfg.model.routed_layers * batch)} if cfg.model.n_experts else {}),
            **({"moe_max_load": max_load} if max_load is not None else {}),
            **({"mtp_loss": mtp.mean_losses(ahead)} if ahead else {}),
            **devices.accelerator_fields(topo.device),
            **(self.telemetry.take() if self.telemetry else {}),
        }

    def _step_sums(self, loss_sum: torch.Tensor, loss_scale: float,
                   loss_tokens: int) -> tuple[float, float, int, float, float | None, list[float]]:
        """The step's numbers that need the whole job, in one all-reduce (over dp x cp, tp, pp)
        and one read: the global gradient norm (unscaled: the same on every rank, non-finite on
        all when any rank's gradient overflowed), the mean token loss (summed from the last
        pipeline stage of each dp x cp replica, once per tp group, over `loss_tokens`), the stop
        signal any rank received (stopping.py), the MoE layers' summed load-balancing loss
        (every layer's, each sequence's: model/execution.py RouterLoss; once per tp group),
        where expert biases move, the largest expert load of any stage (ExpertBias.loads; else None)
        and multi-token prediction's summed depth losses and counted targets (mtp.step_sums; else [])."""
        topo = self.topo
        aux = self.model.execution.router_loss.take()  # None: no MoE layer here (or a pipeline stage without)
        moe = self.cfg.model.n_experts > 0  # a dense model's all-reduce has no place for it (plan/comm_bytes.py)
        aux = torch.zeros_like(loss_sum) if aux is None or topo.tp_rank else aux.to(loss_sum)
        loss = loss_sum if topo.tp_rank == 0 else torch.zeros_like(loss_sum)
        flags = torch.tensor(self.signals.flags(), device=topo.device)
        biased = self.expert_bias.rate > 0
        loads = [self.expert_bias.loads().to(loss_sum)] if biased else []  # a float per stage
        depths = self.cfg.model.mtp_layers
        ahead = mtp.step_sums(self.model.execution.mtp_loss, depths, loss_sum, topo.tp_rank == 0)  # 2 floats a depth
        sums = torch.cat([self.grads.norm_sq().view(1), loss.view(1), *([aux.view(1)] if moe else []), *loads, ahead,
                          flags])
        for group in (GRAD, *WEIGHT_SPLIT_DIMS):
            topo.comm.all_reduce(sums, group)
        norm_sq, loss, *signals = sums.tolist()
        aux = signals.pop(0) if moe else 0.0
        max_load = max(signals.pop(0) for _ in range(self.cfg.parallel.pp)) if biased else None
        ahead, signals = signals[:2 * depths], signals[2 * depths:]
        return math.sqrt(norm_sq) / loss_scale, loss / loss_tokens, self.signals.agreed(signals), aux, max_load, ahead

    def _activation_meter(self, step: int, microbatches: int):
        """Count saved activations (train/memory.py) on the first step this trainer runs and of each
        micro-batch count (a ramp-up's), and on every step that prints a log line (run.log_every):
        the lines between carry the latest peak, without a Python hook per saved tensor."""
        if self._activations_measured == microbatches and (step + 1) % self.cfg.run.log_every:
            return contextlib.nullcontext()
        self._activations_measured = microbatches
        return self.activations.measuring()

    def _model_states(self, stepped: bool) -> dict[str, int]:
        """Bytes of model states this rank holds (GradReducer.model_state_bytes), counted on the
        first step that updated (the optimizer's state exists from then on): the same tensors
        every step after."""
        if self._counted_states is None or not stepped:
            counted = self.grads.model_state_bytes(self.optimizer)
            if not stepped:
                return counted
            self._counted_states = counted
        return self._counted_states

    def job_state(self) -> dict:
        """What a checkpoint keeps beside the model and optimizer, replicated: the loss scale, the
        data's place (for a resume under another global batch) and the MoE layers' expert biases
        (each layer's the same on every rank holding it)."""
        return {"scaler": self.scaler, DataPosition.NAME: self.data_position, ExpertBias.NAME: self.expert_bias}

    def fit(self) -> list[dict]:
        cfg, ckpt, is_logger = self.cfg, self.checkpointer, self.topo.rank == 0
        params = dict(self.model.named_parameters())
        stateful = self.job_state()
        local = {"grads": self.grads}
        start = ckpt.resume(params, self.optimizer, self.run_dir / "metrics.jsonl", stateful, local)
        schedule = schedule_changes(self.run_dir / "config.toml", cfg.train) if start else []
        changes = [*ckpt.behaviour_changes, *schedule]  # said on the resume line
        if is_logger:  # after resume, which reads the config.toml of the run whose metrics are there
            self.run_dir.mkdir(parents=True, exist_ok=True)
            (self.run_dir / "config.toml").write_text(cfg.to_toml())
        log = MetricsLog(cfg, start, is_logger, self.signals.stdout_closed)  # `| head`: a stop, as SIGTERM
        if start >= cfg.train.steps:
            log.note(f"tetrad: {ckpt.resumed_from} is step {start} and train.steps = {cfg.train.steps}: nothing left "
                     "to train; raise train.steps to continue this run, or use a new run.dir")
        elif start:
            log.note(f"tetrad: resumed from {ckpt.resumed_from} (step {start}); continuing at step {start + 1}"
                     + "".join(f"; {change}" for change in changes))
        history = []
        profiler = telemetry.step_profiler(cfg.train.profile, start, self.run_dir / "traces" / f"rank{self.topo.rank}.json",
                                           self.topo.device)
        try:
            with self.signals, profiler or contextlib.nullcontext():
                for step in range(start, cfg.train.steps):
                    with _naming_step(step):
                        record = self.train_step(step)
                        if step == start:  # start-up and compilation are over: the shorter timeout
                            watchdog.set_timeouts(cfg.parallel.collective_timeout_s, world_too=False)
                        if record.get("diverged"):
                            history.append(record)
                            log.log(record)
                            log.note(divergence_note(record, ckpt.root, self.scaler.enabled))
                            break
                        if self._evaluates_after(step):
                            record.update(self.evaluate())
                        history.append(record)
                        log.log(record)
                        self.data_position.step = step + 1
                        ckpt.maybe_save(step + 1, params, self.optimizer, stateful, local)
                        if step == cfg.train.steps - 1:
                            self._write_timeline()
                        if profiler is not None:
                            profiler.step()
                        if self.stop_signal and step + 1 < cfg.train.steps:
                            self._save_and_stop(step + 1, self.stop_signal, ckpt, (params, self.optimizer, stateful, local), log)
                            break
                ckpt.finish()  # a checkpoint still being written in the background
        finally:
            log.close()
            if self.telemetry:
                self.telemetry.stop()
        return history

    def _save_and_stop(self, step: int, signum: int, ckpt: Checkpointer, state: tuple, log: MetricsLog) -> None:
        """Save after `step` (unless `checkpoint.every` just did) before a stop that a signal asked for."""
        path = ckpt.ensure_saved(step, *state)
        log.note(f"tetrad: stopping on {stop_name(signum)} after step {step} of {self.cfg.train.steps}; "
                 f"saved {path}. Run the same command again to resume.")

    def _write_timeline(self) -> None:
        """The step's measured pipeline timeline, one file per pipeline rank (those at dp, cp
        and tp coordinate 0), for `tetrad report`: RUN_DIR/timeline/pp<rank>.json."""
        if self.cfg.parallel.pp == 1 or any(c for d, c in self.topo.coords.items() if d != "pp"):
            return
        folder = self.run_dir / "timeline"
        folder.mkdir(parents=True, exist_ok=True)
        rows = [[self.topo.coords["pp"], t.kind, t.mb, t.chunk, t.start, t.end] for t in self.pipeline.timeline()]
        (folder / f"pp{self.topo.coords['pp']}.json").write_text(json.dumps(rows))

    def full_state(self) -> dict[str, torch.Tensor]:
        """Logical parameters of this rank's chunk (gathered over tp), for tests and export."""
        with self.grads.gathered():  # ZeRO-3 holds only shards
            return full_state_dict(self.model, self.topo)


@contextlib.contextmanager
def _naming_step(step: int):
    """A collective timeout anywhere in a step's iteration (the step, evaluation, the save, the
    stop-signal agreement) names the step it happened in."""
    try:
        yield
    except watchdog.CollectiveTimeout as e:
        raise watchdog.CollectiveTimeout(f"at step {step + 1}: {e}") from None


def train_on_this_rank(cfg: Config, device_type: str, work: Callable[[Trainer], Any] = Trainer.fit, trains: bool = True):
    """Entry point of a rank inside an initialised process group (local or torchrun): `work` of its
    Trainer, `fit` (the step records) or a script's own; `trains=False` builds it forward-only (`tetrad
    eval`). Memory and groups end with it: `tetrad check` trains twice in one torchrun process."""
    device = devices.bind_rank(device_type, int(os.environ.get("LOCAL_RANK", "0")))
    devices.set_fp32_matmul(device, cfg.train.tf32)
    with memory_watch(cfg, devices.memory_gib(device) if trains else None):  # its figures: a training step's
        trainer = Trainer(cfg, device, trains=trains)
        with contextlib.closing(trainer.grads):  # its hooks would keep the weights alive past the run
            result = work(trainer)
    trainer.topo.close()
    return result
