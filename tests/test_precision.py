"""Mixed precision: bf16 and fp16 track the fp32 loss curve across layouts and ZeRO stages, fp16
survives an overflow on one rank, the model-state bytes of the mixed-precision recipe, optimizer
offload as a code path on CPU, torch.compile, and bad input."""

import math

import pytest
import torch

from conftest import grad_norms, run_ranks, tiny_config, train_layout
from tetrad.cli import main
from tetrad.config import ConfigError, load_config, validate_device
from tetrad.train.precision import LossScaler
from tetrad.train.trainer import Trainer
from tetrad.viz.report import write_report

pytestmark = pytest.mark.dist

# Loss tolerances against the fp32 run (5 Adam steps, loss 5.56 -> 3.73, ~0.5 per step). bf16
# keeps 8 significant bits (relative rounding 2^-9 = 2e-3 on every weight and activation); the
# largest difference seen is 1.9e-3 (dp=2 x tp=2). fp16 keeps 11 bits (2^-11 = 5e-4); seen 5e-4.
# Parameters are not compared: Adam turns the sign of a near-zero gradient into a full step.
LOSS_ATOL = {"bf16": 5e-3, "fp16": 2e-3}
# The first step's gradient norm, the same parameters with rounded activations and gradients:
# seen 4.4e-4 relative (bf16, cp2 x tp2 + SP) and 3.5e-5 (fp16).
NORM_RTOL = {"bf16": 2e-3, "fp16": 2e-4}


@pytest.fixture(scope="module")
def reference():
    return train_layout(tiny_config())


def _dtypes(cfg):
    """Dtypes of this rank's parameters and of its optimizer's state tensors."""
    trainer = Trainer(cfg, torch.device("cpu"))
    trainer.train_step(0)
    state = {v.dtype for s in trainer.optimizer.state.values() for v in s.values() if v.ndim}
    return {p.dtype for p in trainer.params}, state


@pytest.mark.parametrize("dtype, parallel", [
    ("bf16", {}),
    ("bf16", {"dp": 2, "tp": 2, "zero": 1}),
    ("bf16", {"dp": 2, "zero": 3}),
    ("fp16", {"dp": 2, "tp": 2}),
    ("fp16", {"dp": 2, "zero": 2}),
    ("bf16", {"dp": 2, "pp": 2}),
    ("fp16", {"pp": 2, "schedule": "zb"}),
    ("bf16", {"cp": 2, "tp": 2, "sequence_parallel": True}),
])
def test_low_precision_tracks_fp32(reference, dtype, parallel):
    cfg = tiny_config(parallel=parallel, train={"dtype": dtype})
    losses, _, history = train_layout(cfg)
    ref_losses = reference[0]
    torch.testing.assert_close(torch.tensor(losses), torch.tensor(ref_losses), rtol=0, atol=LOSS_ATOL[dtype])
    # AdamW and clipping hide a gradient scaled by a constant; the gradient norm does not.
    torch.testing.assert_close(grad_norms(history)[0], grad_norms(reference[2])[0], rtol=NORM_RTOL[dtype], atol=0)
    assert losses != ref_losses  # it did run in low precision
    assert not any(r["skipped"] for r in history)
    assert {r["loss_scale"] for r in history} == ({2.0**16} if dtype == "fp16" else {1.0})


@pytest.mark.parametrize("dtype, torch_dtype", [("bf16", torch.bfloat16), ("fp16", torch.float16)])
def test_low_precision_parameters_fp32_optimizer(dtype, torch_dtype):
    params, state = run_ranks(_dtypes, 1, tiny_config(train={"dtype": dtype}))[0]
    assert params == {torch_dtype}
    assert state == {torch.float32}  # Adam's moments of the fp32 master weights


def _poisoned_run(cfg, rank, step):
    """Train, adding inf to one parameter's gradient on `rank` at `step`; return the history and
    whether this rank's parameters were unchanged across that step."""
    trainer = Trainer(cfg, torch.device("cpu"))
    poison = {"on": False}
    if trainer.topo.rank == rank:
        trainer.params[-1].register_hook(lambda g: g + math.inf if poison["on"] else g)
    history, unchanged = [], None
    for i in range(cfg.train.steps):
        poison["on"] = i == step
        before = [p.detach().clone() for p in trainer.params] if i == step else None
        history.append(trainer.train_step(i))
        if before is not None:
            unchanged = all(torch.equal(a, p) for a, p in zip(before, trainer.params))
    return history, unchanged


def test_fp16_overflow_skips_the_step_on_every_rank():
    # dp=2 x tp=2: the inf on rank 3 reaches its dp peer through the gradient all-reduce, but its
    # tp peers only through the agreed verdict (the global gradient norm).
    cfg = tiny_config(parallel={"dp": 2, "tp": 2, "zero": 1}, train={"dtype": "fp16"})
    results = run_ranks(_poisoned_run, 4, cfg, 3, 2)
    for history, unchanged in results:
        assert [r["skipped"] for r in history] == [False, False, True, False, False]
        assert [r["loss_scale"] for r in history] == [2.0**16] * 3 + [2.0**15] * 2
        assert not math.isfinite(history[2]["grad_norm"])
        assert unchanged  # no rank stepped
    losses = [r["loss"] for r in results[0][0]]
    assert all(math.isfinite(x) for x in losses) and losses[-1] < losses[0]  # training went on


def _poisoned_fit(cfg, rank, step):
    """fit(), adding inf to one parameter's gradient on `rank` from 0-based `step` on; the history
    and whether every parameter is still finite."""
    trainer = Trainer(cfg, torch.device("cpu"))
    per_step = cfg.train.global_batch // (cfg.parallel.dp * cfg.train.micro_batch)  # one hook call each
    calls = {"n": 0}

    def poison(grad):
        calls["n"] += 1
        return grad + math.inf if calls["n"] > step * per_step else grad
    if trainer.topo.rank == rank:
        trainer.params[-1].register_hook(poison)
    history = trainer.fit()
    return history, all(bool(torch.isfinite(p).all()) for p in trainer.params)


@pytest.mark.parametrize("dtype", ["fp32", "bf16"])
def test_a_non_finite_gradient_without_loss_scaling_stops_the_run_unapplied(dtype, tmp_path, capfd):
    # Megatron-LM stops on a NaN gradient; stepping on would write NaN weights into every later
    # checkpoint. Every rank stops at the same step (the verdict is the global gradient norm).
    cfg = tiny_config(parallel={"dp": 2, "tp": 2, "zero": 1}, train={"dtype": dtype})
    for history, finite in run_ranks(_poisoned_fit, 4, cfg, 3, 2):
        assert [r["step"] for r in history] == [1, 2, 3] and history[-1]["diverged"] and history[-1]["skipped"]
        assert not any("diverged" in r for r in history[:-1])
        assert finite  # the step was not applied
    # The command exits 1 and says what to do; no checkpoint of the step is written.
    args = ["train", "--train.lr=1e4", "--train.warmup=0", "--train.grad_clip=0", "--checkpoint.every=1",
            f"--run.dir={tmp_path}"]
    assert main(args) == 1
    out = capfd.readouterr().out  # the note comes from the rank's process
    assert "step 2: the gradient norm is nan" in out and "the step was not applied and the run stops" in out
    assert f"resumes from {tmp_path}/checkpoints/step_00000001" in out
    assert not (tmp_path / "checkpoints" / "step_00000002").exists()
    page, _ = write_report(tmp_path, sample_count=0)
    assert "The run diverged: at step 2 the gradient norm was nan" in page.read_text()


def test_fp16_stops_only_once_its_loss_scale_can_fall_no_further():
    cfg = tiny_config(train={"dtype": "fp16", "steps": 20})
    [(history, finite)] = run_ranks(_poisoned_fit, 1, cfg, 0, 0)  # every gradient inf from the start
    # 2^16 halves to the floor 1.0 over 16 skipped steps; the 17th overflow at the floor stops the run.
    assert [r["loss_scale"] for r in history] == [2.0**(16 - i) for i in range(17)]
    assert all(r["skipped"] for r in history) and [bool(r.get("diverged")) for r in history] == [False] * 16 + [True]
    assert finite


def test_loss_scaler_grows_and_backs_off():
    scaler = LossScaler(enabled=True, init_scale=8.0, growth_interval=2, min_scale=2.0)
    verdicts = [True, True, False, True, False, False, False]
    steps = [(scaler.update(ok), scaler.scale) for ok in verdicts]
    # doubles after 2 good steps, halves (and skips) on an overflow, the count restarts, floor 2.
    assert steps == [(True, 8.0), (True, 16.0), (False, 8.0), (True, 8.0), (False, 4.0), (False, 2.0),
                     (False, 2.0)]
    off = LossScaler(enabled=False)
    assert off.scale == 1.0 and off.update(False)


@pytest.mark.parametrize("saved, resumed, scales", [
    ("fp32", "fp16", [2.0**16] * 2),  # a fresh fp16 run's scale, not the unscaled run's 1
    ("fp16", "bf16", [1.0] * 2),  # bf16 scales nothing
    ("fp16", "fp16", [2.0**10] * 2),  # the saved scale carries on
])
def test_a_resume_under_another_dtype_scales_the_loss_as_that_dtype_needs(tmp_path, saved, resumed, scales):
    run = {"dir": str(tmp_path)}
    first = Trainer(tiny_config(train={"steps": 2, "dtype": saved}, checkpoint={"every": 2}, run=run), torch.device("cpu"))
    first.scaler.scale = 2.0**10 if first.scaler.enabled else 1.0
    first.fit()
    cfg = tiny_config(train={"steps": 4, "dtype": resumed}, checkpoint={"every": 2}, run=run)
    history = Trainer(cfg, torch.device("cpu")).fit()
    assert [r["loss_scale"] for r in history] == scales


def _offload_run(cfg):
    trainer = Trainer(cfg, torch.device("cpu"))
    history = trainer.fit()
    separate = all(m.untyped_storage().data_ptr() != f.untyped_storage().data_ptr()
                   for m, f in zip(trainer.grads.masters, trainer.grads.flat))
    return [r["loss"] for r in history], trainer.full_state(), separate


@pytest.mark.parametrize("dtype, zero", [("fp32", 0), ("bf16", 1)])
def test_offload_is_the_same_arithmetic(dtype, zero):
    # On CPU the "offloaded" masters are separate CPU copies: the path an accelerator run takes
    # (gradient shard to the CPU, AdamW there, parameters back), with the same elementwise AdamW.
    # So demand bit equality with the run that keeps everything in place.
    base = tiny_config(parallel={"dp": 2, "zero": zero}, train={"dtype": dtype})
    off = tiny_config(parallel={"dp": 2, "zero": zero}, train={"dtype": dtype, "offload_optimizer": True})
    base_losses, base_state = run_ranks(_offload_run, 2, base)[0][:2]
    losses, state, separate = run_ranks(_offload_run, 2, off)[0]
    assert separate
    assert losses == base_losses
    assert all(torch.equal(state[k], base_state[k]) for k in base_state)


def _compiled_run(cfg):
    """Losses of a compiled run and what torch._dynamo counted in this rank while it ran."""
    from torch._dynamo.utils import counters
    counters.clear()
    history = Trainer(cfg, torch.device("cpu")).fit()
    return [r["loss"] for r in history], {kind: dict(counts) for kind, counts in counters.items()}


def test_compile_matches_eager(reference):
    # Inductor compiles C++ kernels: minutes on a busy 2-core machine, hence the longer deadline.
    losses, counts = run_ranks(_compiled_run, 1, tiny_config(train={"compile": True}), timeout_s=900)[0]
    # It really compiled: dynamo captured the block body as a graph, AOT autograd compiled its
    # backward too, and nothing fell back to eager through a graph break.
    assert counts.get("frames", {}).get("ok", 0) > 0 and counts.get("stats", {}).get("unique_graphs", 0) > 0, counts
    assert counts.get("aot_autograd", {}).get("ok", 0) > 0 and not counts.get("graph_break"), counts
    # Inductor fuses elementwise chains and may reorder reductions: fp32 rounding, ~1e-6 relative.
    torch.testing.assert_close(torch.tensor(losses), torch.tensor(reference[0]), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("train, parallel, message", [
    ({"offload_optimizer": True, "device": "cpu"}, {}, "offload_optimizer=false"),
    ({"dtype": "fp16"}, {"grad_codec": "int8"}, "grad_codec"),
])
def test_bad_input_fails_at_validation(train, parallel, message):
    with pytest.raises(ConfigError, match=message):
        load_config(overrides={"parallel": parallel, "train": train})


def test_compile_is_accepted_in_every_layout():
    """Refused with tp or cp > 1 until the collectives ran eagerly between compiled regions
    (tests/test_compile.py trains these layouts compiled)."""
    cfg = load_config(overrides={"parallel": {"tp": 2, "cp": 2, "pp": 2, "schedule": "zb", "sequence_parallel": True},
                                 "train": {"compile": True, "global_batch": 4}})
    assert cfg.train.compile and cfg.parallel.world_size == 8


def test_offload_without_accelerator_names_the_fix():
    cfg = load_config(overrides={"train": {"offload_optimizer": True}})  # device auto: resolved later
    with pytest.raises(ConfigError, match="offload_optimizer=false"):
        validate_device(cfg, "cpu")


def test_fp16_without_fp16_matmul_names_the_fix(monkeypatch):
    cfg = load_config(overrides={"train": {"dtype": "fp16"}})
    validate_device(cfg, "cpu")  # this CPU multiplies fp16

    def no_half(a, b):  # what torch said on CPUs without fp16 GEMM before 2.1
        raise RuntimeError('"addmm_impl_cpu_" not implemented for \'Half\'')
    monkeypatch.setattr(torch.Tensor, "__matmul__", no_half)
    with pytest.raises(ConfigError, match="use train.dtype='bf16'"):
        validate_device(cfg, "cpu")
