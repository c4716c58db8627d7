"""Global batch-size ramp-up (train.batch_rampup, Megatron-LM's --rampup-batch-size): the rule on a
worked example, the data each step reads, parity of parallel layouts with one process under the
same ramp, an exact resume mid-ramp, the planner, and the configs it refuses."""

from __future__ import annotations

import dataclasses
import json
from functools import partial
from pathlib import Path

import pytest
import torch

from conftest import assert_parity, tiny_config, train_layout
from nccl_semantics import NcclSemantics
from tetrad.config import ConfigError, load_config
from tetrad.config.rampup import BatchRamp
from tetrad.model.flops import parameter_count
from tetrad.parallel.pipeline.registry import check_config
from tetrad.plan.cost import estimate
from tetrad.plan.hardware import load_cluster
from tetrad.plan.search import config_of, layouts
from tetrad.plan.recipe import sized_training
from tetrad.plan.text import ramp_lines
from tetrad.train.batches import DataPosition, split_batches
from tetrad.train.metrics import MetricsLog
from tetrad.viz.report import _timelines

# global_batch 8 from 2 in steps of 2 over 12 samples: 3 increments, one every 4 samples. Steps
# start after 0, 2, 4, 8, 14, 22 samples: batches 2, 2, 4, 6, 8, 8 (micro_batch 1: 1-4 micro-batches per dp rank).
RAMP = {"steps": 6, "global_batch": 8, "micro_batch": 1, "batch_rampup": [2, 2, 12]}
RAMPED = [2, 2, 4, 6, 8, 8]


def test_the_ramp_follows_megatrons_rule_on_a_worked_example():
    # Megatron-LM's calculator at global_batch 16, --rampup-batch-size 4 4 48: 3 increments of
    # 48/3 = 16 samples. A step starting after c samples runs 4 + 4 * floor(c / 16), 16 once c > 48:
    # c = 0, 4, 8, 12 -> 4; 16, 24 -> 8; 32, 44 -> 12; 56, 72 -> 16.
    ramp = BatchRamp(final=16, start=4, increment=4, samples=48)
    assert ramp.stages(10) == [(4, 4), (8, 2), (12, 2), (16, 2)]
    assert [ramp.advance(0, k) for k in range(11)] == [0, 4, 8, 12, 16, 24, 32, 44, 56, 72, 88]
    assert [ramp.size_at(c) for c in (15, 16, 47, 48, 49)] == [4, 8, 12, 16, 16]
    assert [ramp.steps_for(s) for s in (0, 1, 16, 17, 72, 73)] == [0, 1, 4, 5, 9, 10]
    # A resume after 28 samples (not a step boundary of this run): 28 -> 8, 36 -> 12, 48 -> 16.
    assert ramp.stages(3, consumed=28) == [(8, 1), (12, 1), (16, 1)]
    assert ramp.indivisible(4) is None and ramp.indivisible(8) == 4 and BatchRamp(16, 8, 4, 48).indivisible(8) == 12
    # The exact rule where Megatron-LM's float quotient rounds down: 9 of 18 samples is half of
    # 14 increments, 7 (9 / (18 / 14) = 6.999999999999999 in floating point).
    assert BatchRamp(final=15, start=1, increment=1, samples=18).size_at(9) == 8
    # No ramp: the constant batch.
    assert BatchRamp.of(load_config(overrides={"train": {"global_batch": 8}}).train).stages(5) == [(8, 5)]


def test_each_step_reads_the_next_samples_of_the_run():
    cfg = tiny_config(train=RAMP, parallel={"dp": 2})
    batches, _ = split_batches(cfg)
    assert [batches.size(step) for step in range(6)] == RAMPED
    assert [batches.first_sample(step) for step in range(6)] == [0, 2, 4, 8, 14, 22]
    constant, _ = split_batches(tiny_config(train={"global_batch": 2}))
    for step in range(6):  # sample j is the same whatever the batches around it
        inputs, labels = batches.global_batch_at(step)
        first = batches.first_sample(step) // 2
        expected = torch.cat([constant.global_batch_at(first + k)[0] for k in range(RAMPED[step] // 2)])
        assert torch.equal(inputs, expected)
        shares = [batches.microbatches(step, rank, 2, 1) for rank in (0, 1)]
        assert torch.equal(torch.cat([x for share in shares for x, _ in share]), inputs)
        assert all(len(share) == RAMPED[step] // 2 for share in shares)
    position = DataPosition(batches)
    position.step = 3
    state = position.state_dict()
    assert state == {"step": 3, "samples": 8}
    resumed, _ = split_batches(cfg)
    DataPosition(resumed).load_state_dict(state)
    assert [resumed.size(step) for step in range(3, 6)] == RAMPED[3:]


@pytest.fixture(scope="module")
def reference():
    return train_layout(tiny_config(model={"n_layers": 4}, train=RAMP))


def test_one_process_runs_the_ramp_and_normalises_by_each_steps_batch(reference):
    _, _, history = reference
    assert [r["global_batch"] for r in history] == RAMPED
    for r in history:
        assert r["tokens_per_s"] * r["step_time_s"] == pytest.approx(r["global_batch"] * 32)
    work = [r["mfu"] * r["step_time_s"] / r["global_batch"] for r in history]  # FLOPs per sample
    assert work == pytest.approx([work[0]] * len(work))
    # Step 1 reads samples 0-1 from the same weights as a constant batch of 2: the same loss and
    # gradient (the mean over the step's 2 x 32 tokens, not the final batch's 8 x 32).
    small = dict(RAMP, global_batch=2, batch_rampup=[])
    _, _, flat = train_layout(tiny_config(model={"n_layers": 4}, train=small))
    assert (history[0]["loss"], history[0]["grad_norm"]) == (flat[0]["loss"], flat[0]["grad_norm"])


LAYOUTS = [{"dp": 2, "pp": 2}, {"dp": 2, "zero": 3}, {"pp": 2, "vpp": 2, "schedule": "interleaved"},
           {"pp": 2, "schedule": "zb"}, {"dp": 2, "pp": 2, "schedule": "gpipe", "zero": 2},
           {"tp": 2, "cp": 2, "sequence_parallel": True}]


@pytest.mark.dist
@pytest.mark.parametrize("parallel", LAYOUTS, ids=lambda p: "-".join(f"{k}{v}" for k, v in p.items()))
def test_a_ramped_parallel_run_matches_one_process(reference, parallel):
    got = train_layout(tiny_config(model={"n_layers": 4}, parallel=parallel, train=RAMP))
    assert [r["global_batch"] for r in got[2]] == RAMPED
    assert_parity(got, reference, atol=1e-4 if parallel.get("tp", 1) > 1 else 1e-5)  # tp: test_pipeline's bound


# Under NCCL's ordering (tests/nccl_semantics.py): each new micro-batch count's schedule posts its
# links' transfers in its own order at both ends, and evaluation's, at the final count, runs between.
NCCL_RAMPS = [({"pp": 3, "vpp": 2, "schedule": "interleaved"}, 9, [3, 3, 12]),
              ({"pp": 2, "dp": 2, "zero": 3, "schedule": "zb"}, 8, [2, 2, 12])]


@pytest.mark.dist
@pytest.mark.parametrize("parallel, global_batch, rampup", NCCL_RAMPS, ids=["interleaved-pp3", "zb-dp2-zero3"])
def test_a_ramp_under_nccl_ordering_equals_gloo(parallel, global_batch, rampup):
    def run(transport=None):
        train = {"steps": 5, "eval_every": 2, "eval_steps": 1, "micro_batch": 1, "global_batch": global_batch,
                 "batch_rampup": rampup}
        cfg = tiny_config(model={"n_layers": 6}, parallel=parallel, data={"val_fraction": 0.1}, train=train)
        return [(r["global_batch"], r["loss"], r.get("val_loss")) for r in train_layout(cfg, transport=transport)[2]]
    ordered, gloo = run(partial(NcclSemantics, timeout_s=20)), run()
    assert ordered == gloo and len({batch for batch, _, _ in gloo}) >= 3


def _logged(run_dir) -> list[dict]:
    return [json.loads(line) for line in (Path(run_dir) / "metrics.jsonl").read_text().splitlines()]


@pytest.mark.dist
def test_a_resume_mid_ramp_continues_exactly(tmp_path):
    # A constant learning rate, so that a run cut at step 3 (train.steps=3) trains its steps as the
    # uninterrupted run does. Step 4 starts after 8 samples with a batch of 6: mid-ramp.
    train = dict(RAMP, lr_schedule="constant", warmup=0)
    cfg = tiny_config(train=train, checkpoint={"every": 1})
    train_layout(cfg)
    whole = _logged(cfg.run.dir)
    run = {"dir": str(tmp_path / "cut")}
    train_layout(tiny_config(train=dict(train, steps=3), checkpoint={"every": 3}, run=run))
    train_layout(tiny_config(train=train, checkpoint={"every": 3}, run=run))
    cut = _logged(run["dir"])
    assert [r["global_batch"] for r in cut] == RAMPED
    # Same arithmetic from bitwise-restored state on the same samples: exact equality.
    assert [(r["loss"], r["grad_norm"]) for r in cut] == [(r["loss"], r["grad_norm"]) for r in whole]
    # Resumed in another layout, the ramp and the samples continue as well (equal to rounding).
    other = {"dir": str(tmp_path / "other")}
    train_layout(tiny_config(train=dict(train, steps=3), checkpoint={"every": 3}, run=other))
    train_layout(tiny_config(train=train, parallel={"dp": 2, "zero": 1}, checkpoint={"every": 3}, run=other))
    moved = _logged(other["dir"])
    assert [r["global_batch"] for r in moved] == RAMPED
    torch.testing.assert_close(torch.tensor([r["loss"] for r in moved]), torch.tensor([r["loss"] for r in whole]),
                               rtol=1e-5, atol=1e-6)


def test_the_planner_estimates_the_final_batch_and_searches_layouts_that_run_the_ramp():
    cluster = load_cluster("dgx-h100")
    model = {"preset": "llama3-8b", "n_layers": 8}
    train = {"global_batch": 64, "micro_batch": 1, "dtype": "bf16"}
    ramped = {**train, "batch_rampup": [8, 8, 10000]}
    parallel = {"pp": 2, "dp": 4}
    flat = estimate(load_config(overrides={"model": model, "parallel": parallel, "train": train}, runtime=False),
                    cluster)
    ramp = estimate(load_config(overrides={"model": model, "parallel": parallel, "train": ramped}, runtime=False),
                    cluster)
    assert ramp.to_json() == flat.to_json()  # peak memory and step time: the final (largest) batch's
    for schedule in ("1f1b", "gpipe"):  # no batch of the ramp holds more (GPipe holds every micro-batch)
        cfg = load_config(overrides={"model": model, "parallel": {**parallel, "schedule": schedule}, "train": train},
                          runtime=False)
        peaks = [estimate(dataclasses.replace(cfg, train=dataclasses.replace(cfg.train, global_batch=b)),
                          cluster).peak_memory_gib for b in range(8, 72, 8)]
        assert peaks == sorted(peaks)
    # 7 increments of 10,000 / 7 samples: 8 until 1,429 samples are read (179 steps: 1,432), 16 until
    # 2,858 (90 steps: 2,872), 24 until 4,286 (59 steps). train.steps = 200 ends at 16, after 1,768.
    assert BatchRamp(64, 8, 8, 10000).stages(400)[:3] == [(8, 179), (16, 90), (24, 59)]
    assert ramp_lines(ramp, cluster, "tetrad")[1].startswith(
        "  batch ramp-up  200 of the 200 steps run global batches 8..16 (1,768 samples) in ")
    base = load_config(overrides={"model": model, "train": ramped}, runtime=False)
    found = list(layouts(base, 8, 8))
    assert found and all(8 % (x.micro_batch * x.dp) == 0 for x in found)
    assert len(found) < len(list(layouts(load_config(overrides={"model": model, "train": train}, runtime=False), 8, 8)))
    for layout in found:
        config_of(base, layout)  # raises ConfigError for a layout validation or the schedule registry refuses


@pytest.mark.parametrize("train, parallel, message", [
    ({"batch_rampup": [4, 4]}, {}, r"must be \[start, increment, samples\]"),
    ({"batch_rampup": [16, 4, 100]}, {}, "starts at 16, which must be below global_batch=16"),
    ({"batch_rampup": [4, 5, 100]}, {}, "global_batch - start = 12 is not a multiple of increment=5"),
    ({"batch_rampup": [4, 0, 100]}, {}, r"train.batch_rampup\[1\]=0 is out of range"),
    ({"batch_rampup": [4, 4, 0]}, {}, r"train.batch_rampup\[2\]=0 is out of range"),
    ({"batch_rampup": [2, 2, 100], "micro_batch": 2}, {"dp": 2}, "runs a global batch of 2, which is not divisible by "
                                                                  "micro_batch\\*dp = 4"),
    ({"batch_rampup": [4, 2, 100], "micro_batch": 2}, {"dp": 2}, "runs a global batch of 6"),
    ({"rampup_batch_size": [4, 4, 100]}, {}, "did you mean 'train.batch_rampup'"),
])
def test_a_ramp_that_cannot_run_is_refused(train, parallel, message):
    with pytest.raises(ConfigError, match=message):
        load_config(overrides={"train": {"global_batch": 16, **train}, "parallel": parallel})


def test_a_ramp_too_small_for_the_pipeline_schedule_is_refused():
    cfg = load_config(overrides={"model": {"n_layers": 4}, "parallel": {"pp": 2, "vpp": 2, "schedule": "interleaved"},
                                 "train": {"global_batch": 8, "micro_batch": 1, "batch_rampup": [1, 1, 10]}})
    with pytest.raises(ConfigError, match=r"needs at least 2 micro-batches per step; train.batch_rampup=\[1, 1, 10\] "
                                          "starts at a global batch of 1: 1 per step. Raise its start to 2"):
        check_config(cfg)
    check_config(dataclasses.replace(cfg, train=dataclasses.replace(cfg.train, batch_rampup=[2, 2, 10])))


def test_a_long_ramp_is_checked_without_walking_its_batches():
    # 2**28 - 1 increments: validation and the registry never list them; the data's position walks
    # one stretch of equal batches at a time, as stepping through the rule one step at a time does.
    train = {"global_batch": 2**30, "micro_batch": 4, "batch_rampup": [4, 4, 2**31 - 1]}
    check_config(load_config(overrides={"train": train}))
    batches, _ = split_batches(tiny_config(train=train))
    consumed = 0
    for _ in range(3000):
        consumed += batches.ramp.size_at(consumed)
    assert batches.first_sample(3000) == consumed


def test_plan_write_counts_the_ramps_smaller_steps_in_token_budgets():
    # GPT-3's 375M-token warm-up is 45,777 samples of 8,192 tokens. Ramped 128 -> 512 by 128 over
    # 100,000 samples (33,333.3 an increment): 261 steps of 128 (33,408 samples), then 49 of 256
    # (45,952): 310 steps, where the constant batch of 512 takes 90.
    train = {"global_batch": 512, "micro_batch": 1, "batch_rampup": [128, 128, 100_000]}
    cfg = load_config(overrides={"model": {"preset": "llama3-8b"}, "train": train}, runtime=False)
    sized, notes = sized_training(cfg, set(), 1.0)
    assert sized.train.warmup == 310
    flat, _ = sized_training(dataclasses.replace(cfg, train=dataclasses.replace(cfg.train, batch_rampup=[])), set(), 1.0)
    assert flat.train.warmup == 90
    budget, ramp = 20 * parameter_count(cfg.model) / 8192, BatchRamp.of(cfg.train)  # samples of 20 tokens/parameter
    assert ramp.advance(0, sized.train.steps - 1) < budget <= ramp.advance(0, sized.train.steps)
    assert sized.train.steps > flat.train.steps
    assert any("after train.batch_rampup's smaller ones" in note for note in notes)


@pytest.mark.dist
def test_the_report_simulates_the_last_steps_micro_batches(tmp_path):
    # A run that ends mid-ramp: its last step ran 8 / (micro_batch * dp) = 2 micro-batches, not the
    # final batch's 4; 1F1B over pp=2 at uniform stage costs idles (p-1)/(m+p-1) = 1/3 of rank-time.
    cfg = tiny_config(parallel={"pp": 2, "dp": 2}, run={"dir": str(tmp_path)},
                      train={"steps": 3, "global_batch": 16, "micro_batch": 2, "batch_rampup": [4, 4, 24]})
    _, _, history = train_layout(cfg)
    assert [r["global_batch"] for r in history] == [4, 4, 8]
    _, text = _timelines(tmp_path, cfg, tmp_path)
    assert "simulated 33.3%" in text


def test_a_log_line_names_the_batch_while_the_ramp_is_below_the_final_one():
    cfg = load_config(overrides=["--train.global_batch=16", "--train.micro_batch=2", "--train.batch_rampup=[4, 4, 24]"])
    log = MetricsLog(cfg, 0, enabled=False)
    record = {"step": 1, "loss": 5.0, "tokens_per_s": 100.0, "step_time_s": 1.0, "lr": 1e-3}
    assert "| batch 4, lr 1.00e-03 |" in log.plain_line({**record, "global_batch": 4})
    assert "| lr 1.00e-03 |" in log.plain_line({**record, "global_batch": 16})
