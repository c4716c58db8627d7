"""Shared helpers for tests: real multi-process gloo runs through tetrad's own launcher."""

from __future__ import annotations

import os
import tempfile

import pytest
import torch

from tetrad import launch
from tetrad.config import load_config
from tetrad.train.trainer import Trainer

# Short process-group timeouts turn a mismatched collective into a fast failure; the deadline
# ends a hung test instead of blocking the suite.
PG_TIMEOUT_S = 60
DEADLINE_S = 300

# Tiny shapes: the whole suite must stay within minutes on 2 cores (docs/design.md, Testing).
TINY = {"model": {"n_layers": 2, "d_model": 64, "n_heads": 4, "n_kv_heads": 2, "ffn_hidden": 128,
                  "seq_len": 32},
        "train": {"steps": 5, "global_batch": 8, "micro_batch": 2, "warmup": 2, "lr": 1e-2}}


def run_ranks(fn, world_size: int, *args, timeout_s: float = DEADLINE_S, spawn: bool = False):
    """Run fn(*args) on `world_size` forked (or spawned) gloo ranks and return every rank's result."""
    return launch.run_local(fn, world_size, args, timeout_s=timeout_s, pg_timeout_s=PG_TIMEOUT_S, spawn=spawn)


def tiny_config(**sections):
    """The TINY test config with per-section overrides, e.g. tiny_config(parallel={"dp": 2})."""
    merged = {name: dict(values) for name, values in TINY.items()}
    for name, values in sections.items():
        merged.setdefault(name, {}).update(values)
    merged.setdefault("run", {}).setdefault("dir", tempfile.mkdtemp(prefix="tetrad-test-run-"))
    return load_config(overrides=merged)


def _train_rank(cfg, transport=None):
    trainer = Trainer(cfg, torch.device("cpu"))
    if transport is not None:
        trainer.topo.comm.transport = transport()
    history = trainer.fit()
    return [r["loss"] for r in history], trainer.full_state(), history


def train_layout(cfg, transport=None, timeout_s: float = DEADLINE_S):
    """Train `cfg` on dp*tp*pp*cp ranks; return (per-step losses, merged logical parameters, rank-0 history).
    `transport`: a factory, called on every rank, of the point-to-point transport its comm posts
    through (e.g. tests/nccl_semantics.py); torch.distributed's own when None."""
    results = run_ranks(_train_rank, cfg.parallel.world_size, cfg, transport, timeout_s=timeout_s)
    state = {}
    for _, rank_state, _ in results:
        state.update(rank_state)
    return results[0][0], state, results[0][2]


def assert_parity(got, ref, atol=1e-5):
    """`got` and `ref` are train_layout results. fp32 parallel runs differ from one process only in
    the order of sums (over ranks, micro-batches, tp pieces): ~1e-7 relative per step on the
    loss, a little more on parameters after Adam's 5 steps; callers with tp pass a wider `atol`."""
    losses, state, _ = got
    ref_losses, ref_state, _ = ref
    torch.testing.assert_close(torch.tensor(losses), torch.tensor(ref_losses), rtol=1e-5, atol=1e-6)
    assert state.keys() == ref_state.keys()
    for name in ref_state:
        torch.testing.assert_close(state[name], ref_state[name], rtol=1e-4, atol=atol, msg=name)
    assert ref_losses[-1] < ref_losses[0]  # the run learned something: the comparison is not vacuous


def model_state_after_reduce(cfg):
    """Bytes of model states held after one step's reduction (their peak), and the parameter count."""
    trainer = Trainer(cfg, torch.device("cpu"))
    trainer.train_step(0)  # creates the optimizer state
    micro = trainer.batches.microbatches(1, trainer.topo.coords["dp"], cfg.parallel.dp, cfg.train.micro_batch)
    trainer.forward_backward(micro)
    trainer.grads.reduce()
    return trainer.grads.model_state_bytes(trainer.optimizer), sum(p.numel() for p in trainer.params)


@pytest.fixture(autouse=True, scope="session")
def _scratch_tmpdir():
    """Keep torch's and the launcher's temporary files in one scratch folder (docs/platform.md)."""
    with tempfile.TemporaryDirectory(prefix="tetrad-tests-") as tmp:
        old = os.environ.get("TMPDIR")
        os.environ["TMPDIR"] = tmp
        tempfile.tempdir = None
        yield
        if old is None:
            os.environ.pop("TMPDIR", None)
        else:
            os.environ["TMPDIR"] = old
        tempfile.tempdir = None
