"""`tetrad check`: a few steps of the user's config in its layout and in data parallelism over
the same ranks, judged as `tetrad compare` judges two runs."""

from __future__ import annotations

import os
import subprocess
import sys

import gc

import pytest
import torch

from conftest import run_ranks, tiny_config
from tetrad.check import check_runs
from tetrad.cli import main
from tetrad.plan.search import PLANNED_LOSS_CHUNK
from tetrad.config import ConfigError, load_config

SMALL = ["--model.n_layers=2", "--model.d_model=32", "--model.n_heads=4", "--model.n_kv_heads=2",
         "--model.ffn_hidden=64", "--model.seq_len=16", "--train.device=cpu"]


def _config(tmp_path, *overrides):
    return load_config(overrides=[*SMALL, f"--run.dir={tmp_path}", *overrides])


def test_reference_is_data_parallel_over_the_same_ranks(tmp_path):
    cfg = _config(tmp_path, "--parallel.tp=2", "--parallel.pp=2", "--parallel.sequence_parallel=true",
                  "--parallel.vpp=1", "--parallel.schedule=zb", "--train.global_batch=12", "--train.micro_batch=3",
                  "--checkpoint.every=5", "--checkpoint.dir=/elsewhere", "--train.eval_every=2",
                  "--data.val_fraction=0.1", "--train.batch_rampup=[6, 6, 24]")
    layout, reference = check_runs(cfg, 3, None)
    assert layout.parallel == cfg.parallel
    assert (layout.train.steps, layout.train.eval_every, layout.checkpoint.every) == (3, 0, 0)
    assert layout.train.batch_rampup == reference.train.batch_rampup == []
    assert layout.checkpoint.dir == "" and layout.checkpoint.resume == "never"  # the user's checkpoints untouched
    assert layout.run.dir == str(tmp_path / "check" / "layout")
    p = reference.parallel
    assert (p.dp, p.tp, p.pp, p.cp, p.zero, p.sequence_parallel) == (4, 1, 1, 1, 3, False)
    assert reference.train.recompute == "full" and reference.train.micro_batch == 3
    assert (layout.train.loss_chunk_tokens, reference.train.loss_chunk_tokens) == (0, PLANNED_LOSS_CHUNK)
    assert reference.run.dir == str(tmp_path / "check" / "reference")
    assert (reference.model, reference.data, reference.train.lr) == (cfg.model, cfg.data, cfg.train.lr)

    # A global batch of 6 over 4 ranks: the reference takes the 2 ranks that divide it.
    _, reference = check_runs(_config(tmp_path, "--parallel.tp=2", "--parallel.pp=2", "--train.global_batch=6",
                                      "--train.micro_batch=2"), 3, None)
    assert (reference.parallel.dp, reference.train.micro_batch) == (2, 1)

    # The reference shards over all of its ranks, whatever blocks hybrid ZeRO's layout had.
    _, reference = check_runs(_config(tmp_path, "--parallel.dp=2", "--parallel.tp=2", "--parallel.zero=3",
                                      "--parallel.zero_shard=1", "--train.global_batch=4", "--train.micro_batch=1"),
                              3, None)
    assert (reference.parallel.dp, reference.parallel.zero, reference.parallel.zero_shard) == (4, 3, 0)


def test_an_expert_parallel_layout_has_a_reference_without_it(tmp_path):
    """The reference (its dp need not be a multiple of ep) holds every expert, ep = 1; the layout
    keeps its ep."""
    layout, reference = check_runs(_config(tmp_path, "--model.n_experts=4", "--parallel.dp=4", "--parallel.ep=2",
                                           "--train.global_batch=8", "--train.micro_batch=2"), 3, None)
    assert layout.parallel.ep == 2
    assert (reference.parallel.dp, reference.parallel.ep, reference.parallel.zero) == (4, 1, 3)


def test_refusals_name_the_fix(tmp_path):
    with pytest.raises(ConfigError, match="multiple of 4"):  # under torchrun the reference needs every rank
        check_runs(_config(tmp_path, "--parallel.tp=2", "--parallel.pp=2", "--train.global_batch=6",
                           "--train.micro_batch=2"), 3, 4)
    with pytest.raises(ConfigError, match="--parallel.grad_codec=none"):
        check_runs(_config(tmp_path, "--parallel.dp=2", "--parallel.grad_codec=int8", "--train.global_batch=4",
                           "--train.micro_batch=2"), 3, None)
    assert main(["check", *SMALL, "--steps=0"]) == 2


def test_tp_and_pp_agree_with_data_parallel(tmp_path, capsys):
    code = main(["check", *SMALL, "--parallel.tp=2", "--parallel.pp=2", "--train.global_batch=8",
                 "--train.micro_batch=2", f"--run.dir={tmp_path}", "--steps=2"])
    out = capsys.readouterr().out
    assert code == 0, out
    assert "parallel.dp: 1 -> 4" in out and "parallel.zero: 0 -> 3" in out and "train.recompute: none -> full" in out
    assert f"train.loss_chunk_tokens: 0 -> {PLANNED_LOSS_CHUNK}" in out  # how the reference runs, not what
    assert "training keys that differ" not in out and "BEYOND" not in out
    assert out.rstrip().endswith("dp1 tp2 pp2 cp1 zero0 agrees with dp4 tp1 pp1 cp1 zero3")
    for run in ("layout", "reference"):
        assert len((tmp_path / "check" / run / "metrics.jsonl").read_text().splitlines()) == 2
    assert not (tmp_path / "check" / "layout" / "checkpoints").exists()


def test_under_torchrun_both_runs_share_the_job(tmp_path):
    """Each torchrun process trains twice: the process group is joined and left once per run."""
    out = subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2", "-m", "tetrad", "check",
         *SMALL, "--parallel.cp=2", "--train.global_batch=4", "--train.micro_batch=2", f"--run.dir={tmp_path}",
         "--steps=2"],
        capture_output=True, text=True, timeout=180, env={**os.environ, "TMPDIR": str(tmp_path)})
    assert out.returncode == 0, out.stderr[-2000:]
    assert "dp1 tp1 pp1 cp2 zero0 agrees with dp2 tp1 pp1 cp1 zero3" in out.stdout
    assert out.stdout.count("agrees with") == 1  # rank 0 alone judges


def _parameters_left_by(cfg) -> int:
    from tetrad.train.trainer import train_on_this_rank
    gc.collect()
    before = sum(type(o) is torch.nn.Parameter for o in gc.get_objects())
    train_on_this_rank(cfg, "cpu")
    gc.collect()
    return sum(type(o) is torch.nn.Parameter for o in gc.get_objects()) - before


@pytest.mark.parametrize("parallel, world", [({}, 1), ({"dp": 2, "pp": 2, "zero": 3, "schedule": "zb"}, 4)])
def test_a_run_leaves_nothing_for_the_next_in_its_process(parallel, world):
    """Under torchrun `tetrad check` trains twice in one process, the reference after the user's
    layout. Autograd holds the gradient hooks from C++, out of the garbage collector's sight, and
    they reached the parameters again through the reducer: every parameter, bucket and ZeRO-3
    shard of the first run stayed alive (on a GPU, device memory the reference lacks). Fails
    without GradReducer.close: 21 parameters left on the one rank, 10-11 a rank of the four."""
    cfg = tiny_config(parallel=parallel, train={"steps": 1, "dtype": "bf16" if world > 1 else "fp32"})
    assert run_ranks(_parameters_left_by, world, cfg) == [0] * world
