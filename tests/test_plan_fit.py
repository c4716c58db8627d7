"""The memory check as a GPU rank starts (plan/fit.py): the planner's peak against the device's
memory, and the one-key changes that would fit, each checked against the planner itself."""

from __future__ import annotations

import re

import pytest
import torch

from tetrad.config import load_config
from tetrad.plan.cost import estimate
from tetrad.plan.fit import memory_warning, peak_gib
from tetrad.plan.hardware import load_cluster
from tetrad.plan.memory import GPU_RESERVED_GIB
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
