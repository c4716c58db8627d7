"""Sliding-window attention (model.sliding_window): a query at position i sees keys j with
i - window < j <= i, as HF Mistral's mask. Proven against that rule written out and transformers'
own mask function, then every attention path and layout against one process with the window on
(the ring's choice of blocks checked apart, on the host, against the masks on the device; compiled
under Gemma 3's sliding layers in tests/test_attention_variants.py), as
tests/test_document_mask.py proves document masking; the HF export against MistralForCausalLM
is in tests/test_convert.py, KV-cache decoding in tests/test_generate.py."""

from functools import lru_cache

import pytest
import torch

from conftest import assert_all_within, assert_parity, doc_shards, run_ranks, tiny_config, \
    train_layout
from test_document_mask import _documents, _ring_rank, _ring_reference
from tetrad.config import ConfigError, idle_settings
from tetrad.dist.sequence import shard_sequence
from tetrad.dist.topology import Topology
from tetrad.model import attention as attn, flops
from tetrad.model.masks import ring_blocks, visibility
from tetrad.plan.memory import mask_bias_bytes
from tetrad.train.memory import ActivationMeter
from tetrad.train.trainer import build_model


def _rule(sq: int, window: int, offset: int = 0) -> torch.Tensor:
    """The window written out: query i (at position offset + i) sees key j iff i - window < j <= i."""
    return torch.tensor([[j <= i + offset and (not window or j > i + offset - window) for j in range(sq + offset)]
                         for i in range(sq)])


def test_the_mask_is_hf_mistrals():
    masking = pytest.importorskip("transformers.masking_utils")
    for window in (1, 2, 5, 16):
        hf = masking.sliding_window_causal_mask_function(window)
        positions = torch.arange(16)
        theirs = hf(torch.tensor(0), torch.tensor(0), positions[:, None], positions[None, :])
        assert torch.equal(visibility(positions, positions, window)[0, 0], theirs)
        assert torch.equal(theirs, _rule(16, window))


@pytest.mark.parametrize("window", [1, 3, 16, 40])
def test_local_attention_sees_the_window(window):
    """SDPA with the window's bias against softmax over the rule's keys (fp32, GQA)."""
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(2, 24, n, 8, generator=g) for n in (4, 2, 2))
    out = attn.local_attention(q, k, v, None, window)
    kk, vv = k.repeat_interleave(2, 2), v.repeat_interleave(2, 2)
    scores = torch.einsum("bqhd,bkhd->bhqk", q, kk) / 8 ** 0.5
    want = torch.einsum("bhqk,bkhd->bqhd", scores.masked_fill(~_rule(24, window), float("-inf")).softmax(-1), vv)
    torch.testing.assert_close(out, want, atol=1e-5, rtol=1e-5)


def test_the_ring_computes_exactly_the_blocks_the_masks_leave():
    """`ring_blocks` decides on the host which chunks of which step's block are computed and
    whether masked; against the visibility of every (query, key) pair of the step: a skipped
    step sees nothing, the rows and columns left out see nothing, and an unmasked block is seen
    exactly as the kernel's causal square (step 0) or wholly. Windows shorter and longer than a
    chunk, and at a pair's farthest key (window 2 x chunk - 1), with documents and without
    (window 0: documents alone)."""
    outcomes = set()
    cases = [(cp, chunk, window, eos) for cp in (2, 3, 4) for chunk in (1, 3, 5) for window in (0, 1, 2, 4, 5, 7, 9, 13, 99)
             for eos in (None, 0.0, 0.3, 0.9) if window or eos is not None]
    for seed, (cp, chunk, window, eos_share) in enumerate(cases):
        docs = _documents(2 * cp * chunk, batch=3, seed=seed, eos_share=eos_share) if eos_share is not None else None
        positions = torch.arange(2 * cp * chunk)
        for rank in range(cp):
            for step, block in enumerate(ring_blocks(cp, rank, chunk, window, docs.host if docs else None)):
                src = (rank - step) % cp
                ids = (shard_sequence(docs.ids, cp, rank), shard_sequence(docs.ids, cp, src)) if docs else (None, None)
                seen = visibility(shard_sequence(positions, cp, rank), shard_sequence(positions, cp, src), window, *ids)
                where = (cp, chunk, window, eos_share, rank, step)
                if block is None:
                    assert not seen.any(), where
                    outcomes.add("skipped")
                    continue
                inside = torch.zeros(seen.shape[-2:], dtype=torch.bool)
                inside[block.rows, block.cols] = True
                assert not (seen & ~inside).any(), where
                kept = seen[..., block.rows, block.cols]
                if not block.masked:
                    square = torch.ones(kept.shape[-2:], dtype=torch.bool)
                    assert torch.equal(kept.expand(3, 1, -1, -1), (square.tril() if block.causal else square)
                                       .expand(3, 1, -1, -1)), where
                outcomes.add(("masked" if block.masked else "plain", block.rows != slice(None)))
    assert outcomes == {"skipped", ("masked", True), ("masked", False), ("plain", True), ("plain", False)}


@pytest.mark.dist
@pytest.mark.parametrize("cp,window,masked,dtype", [
    (2, 3, False, torch.float32),    # window < a chunk of 8: partial blocks
    (2, 11, False, torch.float32),   # window > a chunk: partial blocks across chunks
    (4, 3, False, torch.float32),    # window < a chunk of 4: steps skipped, blocks halved and masked
    (4, 6, False, torch.float32),    # window > a chunk: skipped, partial and plain blocks
    (4, 7, False, torch.float32),    # the farthest key of adjacent chunks just out of the window
    (4, 6, True, torch.float32),     # with document masking
    (4, 6, False, torch.bfloat16)])
def test_context_parallel_attention_matches_one_process(cp, window, masked, dtype):
    """Ring and all-to-all attention (and the ring on the math kernel) against one process, as
    test_document_mask's with the window."""
    cases = {shape: run_ranks(_ring_reference, 1, *shape, window, masked)[0] for shape in ((4, 4), (8, 4))}
    for errors in run_ranks(_ring_rank, cp, cp, cases, dtype, window):
        for errs in errors.values():
            # fp32: the ring's merge order. bf16 against fp32: 8 bits of O(1) values (as
            # test_document_mask's; measured below 0.03).
            assert_all_within(errs, 1e-5 if dtype == torch.float32 else 0.05)


# ----------------------------------------------------------------------------- training parity

WINDOW = 6  # < a cp=2 chunk of TINY's 32 tokens, > a cp=4 chunk
LAYOUTS = {  # name -> (parallel, train, model)
    "dp2-zero1": ({"dp": 2, "zero": 1}, {}, {}),
    "tp2-sp": ({"tp": 2, "sequence_parallel": True}, {}, {}),
    "cp2-ring": ({"cp": 2, "cp_algo": "ring"}, {}, {}),
    "cp4-ring": ({"cp": 4, "cp_algo": "ring"}, {}, {}),
    "cp4-ring-selective-op": ({"cp": 4, "cp_algo": "ring"}, {"recompute": "selective-op"}, {"sliding_window": 3}),
    "cp2-alltoall": ({"cp": 2, "cp_algo": "alltoall"}, {}, {}),
    "pp2-1f1b": ({"pp": 2, "schedule": "1f1b"}, {}, {}),
    "pp2-zb": ({"pp": 2, "schedule": "zb"}, {}, {}),
    "pp2-vpp2-interleaved-full": ({"pp": 2, "vpp": 2, "schedule": "interleaved"}, {"recompute": "full"},
                                  {"n_layers": 4}),
    "dp2-zero3-selective": ({"dp": 2, "zero": 3}, {"recompute": "selective"}, {}),
    "cp4-ring-documents": ({"cp": 4, "cp_algo": "ring"}, {"document_mask": True}, {}),
    "tp2-documents": ({"tp": 2}, {"document_mask": True}, {}),
}


def _config(parallel: dict, train: dict, model: dict):
    """TINY with the window, on the document shards where documents are masked."""
    data = {"source": doc_shards()} if train.get("document_mask") else {}
    return tiny_config(parallel=parallel, model={"sliding_window": WINDOW, **model}, data=data, train=train)


def _reference_key(name: str) -> tuple:
    _, train, model = LAYOUTS[name]
    return model.get("sliding_window", WINDOW), model.get("n_layers", 2), train.get("document_mask", False)


@lru_cache(maxsize=None)
def _train(name: str | None, key: tuple = (WINDOW, 2, False)):
    if name is not None:
        return train_layout(_config(*LAYOUTS[name]))
    window, layers, documents = key
    return train_layout(_config({}, {"document_mask": documents}, {"sliding_window": window, "n_layers": layers}))


@pytest.fixture(scope="module")
def references():
    """The one-process runs first (a forked single-rank job hangs once the pytest process has
    computed with its OpenMP pool)."""
    return {key: _train(None, key) for key in sorted({_reference_key(name) for name in LAYOUTS} | {(0, 2, False)})}


def test_the_window_changes_training(references):
    assert abs(references[0, 2, False][0][-1] - references[WINDOW, 2, False][0][-1]) > 1e-2


@pytest.mark.dist
@pytest.mark.parametrize("name", list(LAYOUTS))
def test_layout_matches_single_process(name, references):
    # As test_document_mask's: fp32, only orders of sums differ (the ring's merge, tp pieces, dp x cp).
    assert_parity(_train(name), references[_reference_key(name)], atol=2e-4, loss_atol=2e-6)


# ----------------------------------------------------------------------------- memory, FLOPs, config

def _saved_by_depth():
    """Bytes autograd saves for one forward of 1 and 3 layers, with a window and without."""
    out = {}
    for layers in (1, 3):
        for window in (0, 8):
            cfg = tiny_config(model={"n_layers": layers, "seq_len": 64, "sliding_window": window})
            model = build_model(cfg, Topology.single())
            x = torch.randint(1, cfg.model.vocab_size, (2, 64), generator=torch.Generator().manual_seed(4))
            meter = ActivationMeter()
            with meter.measuring():
                model(x, torch.arange(64))
            out[layers, window] = meter.peak
    return out, mask_bias_bytes(cfg)


def test_the_layers_share_one_window_bias_that_the_planner_counts():
    """A window alone is one [1, 1, S, S] bias for the micro-batch (not per row, not per layer),
    kept once by every layer, and the estimate counts it."""
    saved, planned = run_ranks(_saved_by_depth, 1)[0]
    for layers in (1, 3):
        assert saved[layers, 8] - saved[layers, 0] == 64 * 64 * 4 == planned


def test_attention_flops_count_the_windows_keys():
    """FLOPs per token of the attention core count the window's keys where it is shorter than the
    sequence (the MFU numerator and `tetrad estimate`'s)."""
    full = tiny_config(model={"seq_len": 32}).model
    windowed = tiny_config(model={"seq_len": 32, "sliding_window": 4}).model
    assert flops.attention_core_flops(windowed, 32) == flops.attention_core_flops(full, 32) / 8 == 2 * 2 * 4 * 4 * 16
    assert flops.attention_core_flops(tiny_config(model={"seq_len": 32, "sliding_window": 64}).model, 32) == \
        flops.attention_core_flops(full, 32)
    saved = 3 * 2 * (2 * 2 * (32 - 4) * 4 * 16)  # train x layers x the keys left out
    assert flops.model_flops_per_token(full) - flops.model_flops_per_token(windowed) == saved


def test_a_negative_window_is_refused_saying_what_to_set():
    with pytest.raises(ConfigError, match=r"model.sliding_window=-1 is out of range: it must be an integer in \[0, .*; it is "
                                          r"how many keys each query sees.*set 0 for no window"):
        tiny_config(model={"sliding_window": -1})
    assert any("model.sliding_window=32 does nothing" in note
               for note in idle_settings(tiny_config(model={"sliding_window": 32})))
    assert not idle_settings(tiny_config(model={"sliding_window": 31}))
