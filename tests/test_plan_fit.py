"""The memory check as a GPU rank starts (plan/fit.py): the planner's peak against the device's
memory, and the one-key changes that would fit, each checked against the planner itself; and
the same for CPU ranks against the host's free memory, before they start."""

from __future__ import annotations

import re

import pytest
import torch

from tetrad.config import load_config
from tetrad.plan.cost import estimate
from tetrad.plan.fit import host_gib, host_memory_warning, memory_warning, peak_gib
from tetrad.plan.hardware import load_cluster
from tetrad.plan.memory import GIB, GPU_RESERVED_GIB, memory_by_rank
from tetrad.plan.stacks import load_stack
from tetrad.train.preflight import memory_watch

LLAMA3_8B_DP8 = ["--model.preset=llama3-8b", "--model.seq_len=2048", "--train.dtype=bf16", "--parallel.dp=8",
                 "--train.micro_batch=2", "--train.global_batch=64"]


def test_an_8b_model_on_80_gib_names_the_changes_that_fit():
    cfg = load_config(overrides=LLAMA3_8B_DP8)
    h100 = load_cluster("dgx-h100")
    assert peak_gib(cfg) == estimate(cfg, h100).peak_memory_gib  # what `tetrad estimate` prints
    warning = memory_warning(cfg, h100.gpu.hbm_gib)
    usable = h100.gpu.hbm_gib - GPU_RESERVED_GIB
    assert warning.startswith(f"tetrad: warning: the planner predicts a peak of {peak_gib(cfg):.1f} GiB")
    named = re.findall(r"(--[\w.]+=\w+) \(([\d.]+) GiB\)", warning)
    assert [flag for flag, _ in named] == ["--parallel.zero=2", "--parallel.zero=3", "--train.offload_optimizer=true"]
    for flag, gib in named:  # each named change fits, as its own estimate says
        changed = peak_gib(load_config(overrides=LLAMA3_8B_DP8 + [flag]))
        assert f"{changed:.1f}" == gib and changed <= usable
    for flag in ("--train.recompute=full", "--parallel.zero=1", "--train.micro_batch=1"):  # and these do not
        assert peak_gib(load_config(overrides=LLAMA3_8B_DP8 + [flag])) > usable


def test_no_warning_where_it_fits_and_plan_where_no_single_key_does():
    assert memory_warning(load_config(overrides=LLAMA3_8B_DP8 + ["--parallel.zero=3"]), 80.0) is None
    longer = load_config(overrides=LLAMA3_8B_DP8 + ["--model.seq_len=4096"])
    assert memory_warning(longer, 80.0).endswith("no change of one key fits; `tetrad plan` ranks the layouts that do")


def test_memory_watch_warns_on_rank_0_and_adds_the_planner_to_an_out_of_memory(capsys):
    cfg = load_config(overrides=LLAMA3_8B_DP8)
    with memory_watch(cfg, None):  # not a GPU: nothing said
        pass
    assert capsys.readouterr().err == ""
    with pytest.raises(torch.OutOfMemoryError) as raised:
        with memory_watch(cfg, 80.0):
            raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB.")
    assert capsys.readouterr().err.startswith("tetrad: warning: the planner predicts a peak of 163.7 GiB")
    message = str(raised.value)
    assert message.startswith("CUDA out of memory. Tried to allocate 2.00 GiB.\ntetrad: the planner predicted a peak "
                              "of 163.7 GiB on the busiest rank against 79.0 GiB usable, above it")
    saved = {flag: peak_gib(cfg) - peak_gib(load_config(overrides=LLAMA3_8B_DP8 + [flag]))
             for flag in ("--parallel.zero=3", "--parallel.zero=2", "--train.offload_optimizer=true")}
    assert sorted(saved.values(), reverse=True) == list(saved.values())  # the three largest, in that order
    assert message.endswith("Largest predicted savings of one key: "
                            + ", ".join(f"{flag} (-{gib:.1f} GiB)" for flag, gib in saved.items()))
    # Where the planner said it fits, an out-of-memory means the prediction was short.
    fitting = load_config(overrides=LLAMA3_8B_DP8 + ["--parallel.zero=3"])
    with pytest.raises(torch.OutOfMemoryError, match="under it: the prediction was short; please report it"):
        with memory_watch(fitting, 80.0):
            raise torch.OutOfMemoryError("CUDA out of memory.")
    assert capsys.readouterr().err == ""


def test_cpu_ranks_are_warned_of_the_hosts_free_memory_with_what_fits_there():
    """CPU ranks share one host: each pipeline rank's planner peak, repeated over its dp*tp*cp
    ranks, plus a process each, against the memory the host has free (before: nothing said, and a
    seq_len of 100000 on the tiny model grew to 15 GiB here unannounced). The changes named fit by
    the same count, and none is moving the optimizer to the host it is already on."""
    base = ["--model.seq_len=8192", "--parallel.pp=2", "--parallel.dp=2", "--train.global_batch=16"]
    cfg = load_config(overrides=base)
    stages = [m.total / GIB for m in memory_by_rank(cfg, load_stack("tetrad"), is_cpu=True)]
    assert len(stages) == 2 and stages[0] != stages[1]
    need = host_gib(cfg, 4, 0.25)
    assert need == pytest.approx(2 * sum(stages) + 4 * 0.25)
    assert host_memory_warning(cfg, 4, need + 0.1, 0.25) is None
    free = need * 0.7
    warning = host_memory_warning(cfg, 4, free, 0.25)
    assert warning.startswith(f"tetrad: warning: the planner predicts {need:.1f} GiB for this run's 4 CPU rank(s), "
                              f"above the {free:.1f} GiB this host has free")
    named = re.findall(r"(--[\w.]+=[\w-]+) \(([\d.]+) GiB\)", warning)
    assert named and not any("offload" in flag for flag, _ in named), warning
    for flag, gib in named:
        changed = host_gib(load_config(overrides=base + [flag]), 4, 0.25)
        assert f"{changed:.1f}" == gib and changed <= free
