"""The planner's view of the head's loss fused in chunks (train.loss_chunk_tokens,
model/chunked_loss.py): what a waiting micro-batch's loss keeps (a few bytes a token instead of
the fp32 softmax) against the runtime's count and a rank's resident set; its second logits GEMM
in time and HFU; its collectives, which are the unfused loss's; and `plan` and the start-up check
reaching for it where a layout fits only with it."""

from __future__ import annotations

import dataclasses
import json

import pytest
import torch

from conftest import rank_histories, run_ranks, tiny_config, train_layout
from tetrad.config import load_config
from tetrad.model import flops
from tetrad.plan.activations import CHUNKED_SAVED_PER_TOKEN
from tetrad.plan.cli import plan_command
from tetrad.plan.comm_bytes import comm_bytes_per_step
from tetrad.plan.cost import estimate
from tetrad.plan.ends import end_costs
from tetrad.plan.fit import memory_warning
from tetrad.plan.hardware import load_cluster
from tetrad.plan.search import PLANNED_LOSS_CHUNK, plan
from tetrad.train.trainer import Trainer

VOCAB = {"d_model": 256, "n_heads": 8, "n_kv_heads": 4, "ffn_hidden": 768, "seq_len": 128, "n_layers": 4,
         "vocab_size": 16384}


def _cfg(parallel: dict, chunk: int, model: dict = VOCAB, **train):
    return tiny_config(model=model, parallel=parallel,
                       train={"steps": 2, "device": "cpu", "warmup": 1, "micro_batch": 2, "global_batch": 8,
                              "loss_chunk_tokens": chunk, **train})


def _chunked(cfg, chunk: int):
    return dataclasses.replace(cfg, train=dataclasses.replace(cfg.train, loss_chunk_tokens=chunk))


# Counted on 2026-12-08 (saved activations, last stage): one process 21.83 MiB against 22.78
# predicted, tp2 SP 12.06 / 12.52, pp2 1F1B 6.05 / 6.26, pp2 zero-bubble 10.05 / 10.28; the
# unfused runs counted 16 MiB more each (the fp32 softmax, 256 tokens x 16384 x 4 bytes), and with
# two MTP depths 48 MiB more (three heads), as the estimates say.
COUNTED = [({}, {}, {}), ({"tp": 2, "sequence_parallel": True}, {}, {}),
           ({"tp": 2, "sequence_parallel": True, "sp_regather": True}, {}, {}),
           ({"pp": 2}, {}, {}), ({"pp": 2, "schedule": "zb"}, {}, {}), ({}, {"dtype": "bf16"}, {}),
           ({"pp": 2, "stage_layers": [2, 2]}, {}, {"mtp_layers": 2})]


@pytest.mark.parametrize("parallel,train,model", COUNTED, ids=lambda x: "-".join(f"{k}{v}" for k, v in x.items()) or "-")
def test_the_last_stage_keeps_what_the_estimate_says(parallel, train, model):
    cfg = _cfg(parallel, 48, {**VOCAB, **model}, **train)
    want = estimate(cfg, load_cluster("cpu")).memory_by_rank[-1]
    last = [h[-1]["memory_bytes"] for c, h in rank_histories(cfg) if c["pp"] == cfg.parallel.pp - 1][0]
    # With two MTP depths the estimate counts 1.44 MiB more than the runtime, chunked or not (75.28
    # against 73.84 MiB unfused; 27.29 against 25.85 fused, +5.6%): the depths' own count, not the loss's.
    rel = 0.06 if model.get("mtp_layers") else 0.05
    assert want.activations - want.transient == pytest.approx(last["activations"], rel=rel), (want, last)


def test_the_estimate_keeps_a_few_bytes_a_token_instead_of_the_softmax():
    """One process, one micro-batch waiting: the saved activations fall by the fp32 softmax less
    the fused loss's bytes a token, and the transient to one chunk's logits."""
    plain, fused = (estimate(_cfg({}, chunk), load_cluster("cpu")).memory_by_rank[0] for chunk in (0, 48))
    tokens = 2 * 128
    saved = (plain.activations - plain.transient) - (fused.activations - fused.transient)
    assert saved == pytest.approx(tokens * (4 * VOCAB["vocab_size"] - CHUNKED_SAVED_PER_TOKEN))
    # fp32: the unfused logits' gradient beside the kept softmax; a chunk's logits and logsumexp's work
    assert (plain.transient, fused.transient) == pytest.approx((4 * tokens * VOCAB["vocab_size"], 6 * 48 * VOCAB["vocab_size"]))


def _peak(cfg):
    return Trainer(cfg, torch.device("cpu")).fit()[-1]["peak_memory_gib"]


@pytest.mark.parametrize("dtype", ["fp32", "bf16"])
def test_a_ranks_peak_resident_set_is_the_estimate_within_15_percent(dtype):
    """A vocabulary that dwarfs the layers, fused in chunks of 256 of 1024 tokens: measured on
    2026-12-08 437 MiB (fp32) and 467 MiB (bf16) against 443 and 493 predicted; unfused, 756 and
    716 measured."""
    cfg = tiny_config(model={"d_model": 256, "n_heads": 8, "n_kv_heads": 2, "ffn_hidden": 768, "seq_len": 256,
                             "vocab_size": 32768, "n_layers": 2},
                      train={"steps": 2, "device": "cpu", "warmup": 1, "micro_batch": 4, "global_batch": 4,
                             "loss_chunk_tokens": 256, "dtype": dtype})
    measured = run_ranks(_peak, 1, cfg, spawn=True)[0]  # spawned: a fresh heap, as test_plan_runtime's
    predicted = estimate(cfg, load_cluster("cpu")).peak_memory_gib
    assert predicted == pytest.approx(measured, rel=0.15), (predicted, measured)
    assert predicted < estimate(_chunked(cfg, 0), load_cluster("cpu")).peak_memory_gib - 0.15


def test_backward_makes_the_logits_again_in_time_and_in_hfu():
    """A chunk as long as the micro-batch: the same GEMM shape, so the head's backward grows by
    exactly its forward's logits and cross-entropy passes; HFU counts one more head per head."""
    cluster = load_cluster("dgx-h100")
    cfg = load_config(overrides=["--model.preset=llama3-8b", "--train.dtype=bf16", "--model.seq_len=2048",
                                 "--train.micro_batch=1", "--model.mtp_layers=1"])
    (_, plain), (_, fused) = end_costs(cfg, cluster), end_costs(_chunked(cfg, 2048), cluster)
    m = cfg.model
    cross_entropy_pass = 2048 * m.vocab_size * (3 * 2 + 8) / cluster.gpu.hbm_bytes_per_s / 2
    assert fused[0] == plain[0] and fused[2] == plain[2]  # forward and the weight gradient's GEMM unchanged
    assert fused[1] - plain[1] == pytest.approx(plain[2] + cross_entropy_pass)  # the logits GEMM and pass again
    assert (flops.hardware_flops_per_token(m, "none", loss_chunked=True) - flops.hardware_flops_per_token(m, "none")
            == 2 * 2 * m.d_model * m.vocab_size)  # the main head and the depth's
    assert estimate(_chunked(cfg, 2048), cluster).step_time_s > estimate(cfg, cluster).step_time_s


@pytest.mark.parametrize("parallel", [{"tp": 2}, {"tp": 2, "sequence_parallel": True},
                                      {"tp": 2, "sequence_parallel": True, "sp_regather": True}])
def test_the_fused_loss_sends_the_unfused_bytes(parallel):
    cfg = tiny_config(parallel=parallel, train={"steps": 2, "device": "cpu", "loss_chunk_tokens": 24})
    _, _, history = train_layout(cfg)
    assert all(r["comm_bytes"] == comm_bytes_per_step(cfg) == comm_bytes_per_step(_chunked(cfg, 0)) for r in history)


LONG_8B = ["--model.preset=llama3-8b", "--model.seq_len=8192", "--train.global_batch=8", "--train.dtype=bf16"]


def test_plan_chunks_the_loss_where_a_layout_fits_only_so():
    """Llama-3-8B at 8k tokens on 8 H100s: its fastest layouts on paper (ZeRO-3, no recompute)
    need 84 GiB with the logits made whole and fit with them in chunks; without chunking the
    plan's best is another, slower layout."""
    base, cluster = load_config(overrides=LONG_8B), load_cluster("dgx-h100")
    best = plan(base, cluster, top=3).ranked
    assert best[0].fits and best[0].cfg.train.loss_chunk_tokens == PLANNED_LOSS_CHUNK
    assert not estimate(_chunked(best[0].cfg, 0), cluster).fits
    unchunked = plan(base, cluster, top=3, chunk_loss=False).ranked
    assert not any(e.cfg.train.loss_chunk_tokens for e in unchunked)
    assert unchunked[0].step_time_s > best[0].step_time_s
    # Another stack's plan is that stack's: it has no fused loss to reach for.
    assert not any(e.cfg.train.loss_chunk_tokens for e in plan(base, cluster, top=3, stack="deepspeed").ranked)


def test_plan_command_keeps_a_loss_chunk_the_user_set(capsys):
    args = ["--model", "llama3-8b", "--cluster", "dgx-h100", "--top", "3", "--json"]
    assert plan_command(args + LONG_8B[1:]) == 0
    assert json.loads(capsys.readouterr().out)[0]["train"]["loss_chunk_tokens"] == PLANNED_LOSS_CHUNK
    assert plan_command(args + LONG_8B[1:] + ["--train.loss_chunk_tokens=0"]) == 0
    assert all(e["train"]["loss_chunk_tokens"] == 0 for e in json.loads(capsys.readouterr().out))


def test_the_start_up_check_names_the_chunked_loss_where_it_fits():
    cfg = load_config(overrides=LONG_8B + ["--parallel.dp=8", "--parallel.zero=3", "--train.micro_batch=1"])
    warning = memory_warning(cfg, load_cluster("dgx-h100").gpu.hbm_gib)
    assert warning and f"--train.loss_chunk_tokens={PLANNED_LOSS_CHUNK} (" in warning
