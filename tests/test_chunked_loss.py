"""The head and its cross-entropy fused in chunks (train.loss_chunk_tokens, model/chunked_loss.py):
the loss and gradients plain torch gives (ignored labels, chunks that do not divide the tokens,
16-bit), the weight's gradient into its GRAD_SINK chunk by chunk; every layout trains as the
unfused one process does (the vocabulary split over tp, SP's gathered or re-gathered input, cp's
shards, the pipeline's last stage and zero-bubble's BI, tied embeddings, MTP depths, MoE, ZeRO,
16-bit, NCCL's semantics); validation reports the same loss; the runtime's
counted activations fall by the fp32 softmax; a negative chunk is refused in one line."""

from __future__ import annotations

from functools import lru_cache, partial

import pytest
import torch
import torch.nn.functional as F

from conftest import assert_parity, first_step_gradients, rank_histories, sft_shards, tiny_config, train_layout
from nccl_collectives import NcclTrainer
from nccl_semantics import NcclSemantics
from tetrad.config import ConfigError, load_config
from tetrad.dist.topology import Topology
from tetrad.model.chunked_loss import chunked_head_loss
from tetrad.model.execution import GRAD_SINK, Execution
from tetrad.model.layers import IGNORED_LABEL, vocab_parallel_cross_entropy
from tetrad.parallel.data import SINK_MIN_NUMEL


def _inputs(dtype=torch.float32, tokens=30, d=16, vocab=50, seed=0):
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(2, tokens // 2, d, generator=gen).to(dtype).requires_grad_()
    w = (torch.randn(vocab, d, generator=gen) * 0.3).to(dtype).requires_grad_()
    labels = torch.randint(0, vocab, (2, tokens // 2), generator=gen)
    labels[0, :4] = IGNORED_LABEL  # a prompt the loss leaves out
    return x, w, labels


def _fused(x, w, labels, chunk):
    return chunked_head_loss(x, w, labels, w.shape[0], Topology.single(), Execution(loss_chunk=chunk), chunk)


def _plain(x, w, labels):
    return F.cross_entropy(F.linear(x, w).float().flatten(0, 1), labels.flatten(), reduction="sum",
                           ignore_index=IGNORED_LABEL)


def _grads(loss_fn, x, w, labels):
    x.grad = w.grad = None
    loss = loss_fn(x, w, labels)
    loss.backward()
    return loss.detach(), x.grad.clone(), w.grad.clone()


@pytest.mark.parametrize("chunk", [1, 7, 30, 1000])
def test_the_loss_and_gradients_are_plain_torchs(chunk):
    x, w, labels = _inputs()
    got, want = _grads(partial(_fused, chunk=chunk), x, w, labels), _grads(_plain, x, w, labels)
    for a, b, name in zip(got, want, ("loss", "input gradient", "weight gradient")):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6, msg=name)
    assert want[0] > 0 and got[2].abs().max() > 0


def test_an_ignored_label_gives_its_position_no_gradient():
    x, w, labels = _inputs()
    _, grad_x, _ = _grads(partial(_fused, chunk=7), x, w, labels)
    assert grad_x[0, :4].abs().max() == 0 and grad_x[0, 4:].abs().min() > 0


def test_bf16_is_as_close_to_fp32_as_the_unfused_bf16_loss():
    """bf16 inputs and weight: the fused loss (its weight gradient summed in fp32 over 4 chunks,
    cast once) within bf16's rounding of the fp32 reference, as the unfused bf16 path is (its
    logits rounded to bf16 once, as the fused loss's are)."""
    ref = _grads(_plain, *_inputs())
    x, w, labels = _inputs(torch.bfloat16)
    unfused = _grads(lambda x, w, y: vocab_parallel_cross_entropy(F.linear(x, w), y, w.shape[0],
                                                                   Topology.single()).sum(), x, w, labels)
    fused = _grads(partial(_fused, chunk=8), x, w, labels)
    for i, name in enumerate(("loss", "input gradient", "weight gradient")):
        scale = ref[i].abs().max()
        err_fused = ((fused[i].float() - ref[i]).abs().max() / scale).item()
        err_unfused = ((unfused[i].float() - ref[i]).abs().max() / scale).item()
        assert fused[i].dtype == (torch.float32 if i == 0 else torch.bfloat16)
        assert err_fused < 2e-2 and err_fused < 2 * err_unfused + 4e-3, (name, err_fused, err_unfused)


def test_the_weights_sink_takes_every_chunks_part_and_autograd_none():
    """A weight with a GRAD_SINK (the reducer's, parallel/data/lifecycle.py: addmm into its view of
    the bucket): each chunk's g^T x goes there, the sum is the weight's gradient, autograd gets None."""
    x, w, labels = _inputs()
    bucket, calls = torch.zeros_like(w), []

    def sink(a, b):
        calls.append(a.shape)
        bucket.addmm_(a, b)

    setattr(w, GRAD_SINK, sink)
    loss = _fused(x, w, labels, chunk=7)
    loss.backward()
    delattr(w, GRAD_SINK)
    assert w.grad is None and len(calls) == 5  # 30 tokens in chunks of 7
    torch.testing.assert_close(bucket, _grads(_plain, x, w, labels)[2], rtol=1e-5, atol=1e-6)


# ----------------------------------------------------------------------------- every layout

CHUNK = {"loss_chunk_tokens": 24}  # micro_batch 2 x seq 32: 64 tokens a micro-batch, in 3 chunks
TIED = {"tie_embeddings": True}
MTP = {"mtp_layers": 2, "n_layers": 4}
MOE = {"n_experts": 4, "experts_per_token": 2}
GRADIENT_LAYOUTS = {  # name: (parallel, model, data)
    "dp2": ({"dp": 2}, {}, {}), "tp2": ({"tp": 2}, {}, {}),
    "tp2-sp": ({"tp": 2, "sequence_parallel": True}, {}, {}),
    "tp2-sp-regather": ({"tp": 2, "sequence_parallel": True, "sp_regather": True}, {}, {}),
    "tp2-padded-vocab": ({"tp": 2}, {"vocab_size": 257}, {}),  # 129 rows a rank, the last one padding
    "cp2-ring": ({"cp": 2}, {}, {}), "cp2-alltoall": ({"cp": 2, "cp_algo": "alltoall"}, {}, {}),
    "pp2-1f1b": ({"pp": 2}, {}, {}), "pp2-zb": ({"pp": 2, "schedule": "zb"}, {}, {}),
    "pp2-interleaved": ({"pp": 2, "vpp": 2, "schedule": "interleaved"}, {"n_layers": 4}, {}),
    "tied-pp2": ({"pp": 2}, TIED, {}), "tied-tp2-sp": ({"tp": 2, "sequence_parallel": True}, TIED, {}),
    "mtp-pp2-zb": ({"pp": 2, "schedule": "zb"}, MTP, {}), "mtp-tp2-sp": ({"tp": 2, "sequence_parallel": True}, MTP, {}),
    "moe-tp2-sp": ({"tp": 2, "sequence_parallel": True}, MOE, {}),
    "sft-dp2": ({"dp": 2}, {"vocab_size": 256}, {"source": "sft"}),
}


def _layout_config(parallel, model, data, chunk: dict, **train):
    data = {"source": sft_shards()} if data.get("source") == "sft" else data
    return tiny_config(parallel=parallel, model=model, data=data, train={**chunk, **train})


@lru_cache(maxsize=None)
def _one_process_gradients(name: str):
    _, model, data = GRADIENT_LAYOUTS[name]
    return first_step_gradients(_layout_config({}, model, data, {}))


@pytest.mark.dist
@pytest.mark.parametrize("name", GRADIENT_LAYOUTS)
def test_the_first_step_gradient_is_the_unfused_one_process_s(name):
    parallel, model, data = GRADIENT_LAYOUTS[name]
    got = first_step_gradients(_layout_config(parallel, model, data, CHUNK))
    ref = _one_process_gradients(name)
    assert got.keys() == ref.keys()
    for key in ref:
        torch.testing.assert_close(got[key], ref[key], rtol=1e-4, atol=1e-7, msg=key)


@lru_cache(maxsize=None)
def _one_process(dtype: str):
    return train_layout(_layout_config({}, {}, {}, {}, dtype=dtype))


# (Compiled blocks leave the head outside them: the fused loss runs eagerly, as the unfused head does.)
# A padded vocabulary trained: a padding row that got a gradient would move and then leak into the
# logits (its first-step gradient alone reads as the unpadded one: the row starts at zero). A
# vocabulary of 1024 makes the head (1024 x 64) large enough for the reducer's GRAD_SINK
# (SINK_MIN_NUMEL): its weight gradient written into the bucket chunk by chunk, counted once.
SUNK = {"vocab_size": 1024}
TRAINED = {"dp2-zero3": ({"dp": 2, "zero": 3}, {}), "dp2-zero2": ({"dp": 2, "zero": 2}, {}),
           "tp2-padded-vocab": ({"tp": 2}, {"vocab_size": 257}), "dp2-sink": ({"dp": 2}, SUNK),
           "dp2-pp2-zb-sink": ({"dp": 2, "pp": 2, "schedule": "zb"}, SUNK),
           "dp2-mtp-sink": ({"dp": 2}, {**SUNK, **MTP})}


@lru_cache(maxsize=None)
def _one_process_of(model: tuple):
    return train_layout(_layout_config({}, dict(model), {}, {}))


def test_the_sink_cases_head_is_large_enough_for_a_sink():
    assert SUNK["vocab_size"] * tiny_config().model.d_model >= SINK_MIN_NUMEL


@pytest.mark.dist
@pytest.mark.parametrize("name", TRAINED)
def test_training_matches_the_unfused_one_process(name):
    parallel, model = TRAINED[name]
    ref = _one_process_of(tuple(model.items()))
    assert_parity(train_layout(_layout_config(parallel, model, {}, CHUNK)), ref, atol=1e-4)


@pytest.mark.dist
@pytest.mark.parametrize("dtype", ["bf16", "fp16"])
def test_16_bit_training_matches_the_unfused_one_process_within_rounding(dtype):
    """dp2 ZeRO-1 in 16 bits: the logits rounded as the unfused head's, the weight gradient summed
    over 3 chunks in fp32; within the fuzzer's 16-bit bounds (tools/fuzz_layouts.py DTYPE_ATOL)."""
    got = train_layout(_layout_config({"dp": 2, "zero": 1}, {}, {}, CHUNK, dtype=dtype))
    ref = _one_process(dtype)
    torch.testing.assert_close(torch.tensor(got[0]), torch.tensor(ref[0]), rtol=0, atol={"bf16": 2e-2, "fp16": 1e-2}[dtype])
    assert got[0][-1] < got[0][0]


@pytest.mark.dist
def test_dp2_pp2_zero_bubble_under_nccl_semantics_matches_the_unfused_one_process():
    """The fused loss's tp-free last stage under NCCL's ordering of point-to-point and timing of
    collectives (tests/nccl_semantics.py, nccl_collectives.py): its weight gradient made in BI."""
    cfg = _layout_config({"dp": 2, "pp": 2, "schedule": "zb", "zero": 1}, {}, {}, CHUNK)
    got = train_layout(cfg, transport=partial(NcclSemantics, timeout_s=20), trainer_class=NcclTrainer)
    got[2][-1].pop("posted")
    assert_parity(got, _one_process("fp32"), atol=1e-4)


@pytest.mark.dist
def test_tp2_under_nccl_semantics_matches_the_unfused_one_process():
    """Under tp the fused loss's three all-reduces per micro-batch and its input gradient's
    all-reduce, issued non-blocking before the last chunk's weight gradient, under NCCL's timing."""
    cfg = _layout_config({"tp": 2}, {}, {}, CHUNK)
    got = train_layout(cfg, transport=partial(NcclSemantics, timeout_s=20), trainer_class=NcclTrainer)
    got[2][-1].pop("posted")
    assert_parity(got, _one_process("fp32"), atol=1e-4)


def test_validation_reports_the_unfused_loss():
    val = []
    for chunk in ({}, CHUNK):
        history = train_layout(_layout_config({}, {}, {"val_fraction": 0.05}, chunk, eval_every=2, eval_steps=2))[2]
        val.append([r["val_loss"] for r in history if "val_loss" in r])
    assert len(val[0]) == 3 and val[0] == pytest.approx(val[1], rel=1e-6)


def test_the_counted_activations_fall_by_the_fp32_softmax():
    """One process, a vocabulary of 16384 over 256 tokens a micro-batch: the runtime's count of
    saved activations (train/memory.py) is 16 MiB lower fused (the softmax kept for backward)
    and higher by only the loss's few bytes a token (measured 37.83 -> 21.83 MiB, 2026-12-08)."""
    counted = []
    for chunk in (0, 48):
        cfg = tiny_config(model={"d_model": 256, "n_heads": 8, "n_kv_heads": 4, "ffn_hidden": 768, "seq_len": 128,
                                 "n_layers": 2, "vocab_size": 16384},
                          train={"steps": 2, "device": "cpu", "warmup": 1, "micro_batch": 2, "global_batch": 4,
                                 "loss_chunk_tokens": chunk})
        counted.append(rank_histories(cfg)[0][1][-1]["memory_bytes"]["activations"])
    softmax, kept = 256 * 16384 * 4, 256 * 14
    assert counted[0] - counted[1] == pytest.approx(softmax - kept, rel=1e-3)


def test_a_negative_chunk_is_refused_in_one_line():
    with pytest.raises(ConfigError, match="loss_chunk_tokens") as refused:
        load_config(overrides=["--train.loss_chunk_tokens=-1"])
    assert "\n" not in str(refused.value)
