"""Activation recomputation: `full`, `selective` and `selective-op` give the losses and gradients of `none`
(exactly: the recompute repeats the same operations on the same inputs, or under ring cp
selective-op hands back the ring's kept result), dropout included, with tp's shared dropout
generator and ZeRO-3's block hooks; and the measured activation memory falls
none > selective > selective-op > full."""

import pytest
import torch

from conftest import run_ranks, tiny_config
from tetrad.train.trainer import Trainer

pytestmark = pytest.mark.dist

MODES = ("none", "selective", "selective-op", "full")


def _losses_and_grads(cfg):
    """Losses of every step, the reduced fp32 gradient this rank's optimizer reads in the first
    (per bucket), the measured activation peaks, and the saved bytes still live at the end."""
    trainer = Trainer(cfg, torch.device("cpu"))
    micro = trainer.batches.microbatches(0, trainer.topo.coords["dp"], cfg.parallel.dp, cfg.train.micro_batch)
    trainer.forward_backward(micro, trainer.batches.loss_tokens(0))
    trainer.grads.reduce()
    grads = [trainer.grads.owned_grad(bucket).clone() for bucket in trainer.grads.buckets]
    trainer.optimizer.zero_grad()
    history = [trainer.train_step(step) for step in range(cfg.train.steps)]
    return ([r["loss"] for r in history], grads, [r["memory_bytes"]["activations"] for r in history],
            trainer.activations.live)


def _run(recompute, world=1, **sections):
    train = {"recompute": recompute, **sections.pop("train", {})}
    return run_ranks(_losses_and_grads, world, tiny_config(train=train, **sections))


@pytest.mark.parametrize("case", [
    {},  # one process
    {"model": {"dropout": 0.1}, "parallel": {"tp": 2}},  # tp ranks draw one mask from a shared generator
    {"model": {"dropout": 0.1}, "parallel": {"tp": 2, "sequence_parallel": True}},  # the default generator
    # Gemma's sandwich norms: the recompute runs past the row linear's all-reduce, whose partial sums
    # selective-op may keep (reduced in place, they were summed twice: mappings._ReduceFromTP)
    {"model": {"sandwich_norm": True}, "parallel": {"tp": 2}},
    {"parallel": {"dp": 2, "zero": 3}},  # ZeRO-3 gathers around every block
    {"parallel": {"cp": 2}},  # ring cp: selective-op's recompute replays the ring (RingReplay)
    {"model": {"dropout": 0.1}, "parallel": {"cp": 4}},
    # zero-bubble: the replay runs inside BI's recompute, micro-batches interleaved on each stage
    {"model": {"n_layers": 4}, "parallel": {"pp": 2, "cp": 2, "schedule": "zb"},
     "train": {"micro_batch": 1, "global_batch": 4}},
], ids=["single", "tp2-dropout", "tp2-sp-dropout", "tp2-sandwich", "dp2-zero3", "cp2-ring", "cp4-ring-dropout", "pp2-cp2-zb"])
def test_recompute_gives_the_same_losses_and_gradients(case):
    parallel = case.get("parallel", {})
    world = parallel.get("tp", 1) * parallel.get("dp", 1) * parallel.get("cp", 1) * parallel.get("pp", 1)
    # Three steps, not TINY's five: the third already trains on weights two recomputed steps moved
    # and draws dropout masks after two steps' draws (a generator the replay leaves advanced shows).
    case = {**case, "train": {"steps": 3, **case.get("train", {})}}
    base = _run("none", world, **{k: dict(v) for k, v in case.items()})
    for mode in ("selective", "selective-op", "full"):
        other = _run(mode, world, **{k: dict(v) for k, v in case.items()})
        for (losses, grads, _, live), (ref_losses, ref_grads, _, _) in zip(other, base):
            assert losses == ref_losses, mode
            assert live == 0, mode  # every saved or kept tensor was released after backward
            assert len(grads) == len(ref_grads)
            for k, (grad, ref) in enumerate(zip(grads, ref_grads)):
                assert torch.equal(grad, ref), (mode, k)
    assert base[0][0][-1] < base[0][0][0]


def test_activation_memory_falls_with_recompute():
    # A log line every step: the trainer's meter counts every step (else the first and each log step).
    measured = {mode: _run(mode, run={"log_every": 1})[0] for mode in MODES}
    peaks = {mode: m[2][-1] for mode, m in measured.items()}
    # TINY, fp32, one micro-batch of 2 x 32 tokens in flight: full keeps each block's input, the
    # loss and head; selective drops the rotated q, k and the attention core's log-sum-exp;
    # selective-op keeps each block's input, the attention's outputs and 4 of its 7 matmuls' outputs.
    assert peaks["none"] > peaks["selective"] > peaks["selective-op"] > peaks["full"] > 0, peaks
    for mode, m in measured.items():
        assert len(set(m[2])) == 1, (mode, m[2])  # the same every step: nothing leaks between steps
        assert m[3] == 0, mode  # every saved tensor was released after backward
