"""The memory check as a GPU rank starts (plan/fit.py): the planner's peak against the device's
memory, and the one-key changes that would fit, each checked against the planner itself."""

from __future__ import annotations

import re

from tetrad.config import load_config
from tetrad.plan.cost import estimate
from tetrad.plan.fit import memory_warning, peak_gib
from tetrad.plan.hardware import load_cluster
from tetrad.plan.memory import GPU_RESERVED_GIB

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
