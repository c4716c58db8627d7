"""Tensor parallelism (with and without sequence parallelism): parity with one process, the
counted bytes against the analytical count, and that the layers compose with DP."""

import pytest
import torch

from conftest import TINY, assert_parity, run_ranks, tiny_config, train_layout
from tetrad.model.sharding import spec_of
from tetrad.train.trainer import Trainer

pytestmark = pytest.mark.dist

# Models the parallel runs are compared on; each is trained once on one process (module fixture).
MODELS = {
    # GQA (4 query heads, 2 KV heads), untied, vocab 257: tp=2 pads it to 258.
    "gqa": {"vocab_size": 257},
    # GQA at tp=4 needs 4 KV heads (8 query heads); tied, vocab 258: tp=4 pads it to 260.
    "gqa8-tied": {"n_heads": 8, "n_kv_heads": 4, "vocab_size": 258, "tie_embeddings": True},
    # MHA, 4 heads, vocab 256 (divisible by every tp), untied.
    "mha": {"n_kv_heads": 4, "vocab_size": 256},
    # GPT style: LayerNorm (weight and bias), GELU, learned positions (replicated parameters that
    # under SP see only a sequence chunk), tied, vocab 257.
    "gpt-tied": {"n_kv_heads": 4, "vocab_size": 257, "norm": "layernorm", "mlp": "gelu", "pos": "learned",
                 "tie_embeddings": True},
}

CASES = [  # (model, parallel)
    ("gqa", {"tp": 2}),
    ("gqa", {"tp": 2, "sequence_parallel": True}),
    ("gqa8-tied", {"tp": 4}),
    ("gqa8-tied", {"tp": 4, "sequence_parallel": True}),
    ("mha", {"tp": 4}),
    ("mha", {"tp": 4, "sequence_parallel": True}),
    ("mha", {"tp": 2, "sequence_parallel": True}),
    ("gpt-tied", {"tp": 2}),
    ("gpt-tied", {"tp": 2, "sequence_parallel": True}),
    # SP gathering each column-parallel input again in backward (the tied head's too).
    ("gqa", {"tp": 2, "sequence_parallel": True, "sp_regather": True}),
    ("gpt-tied", {"tp": 2, "sequence_parallel": True, "sp_regather": True}),
    ("gqa", {"dp": 2, "tp": 2}),
    ("gqa", {"dp": 2, "tp": 2, "sequence_parallel": True}),
]


@pytest.fixture(scope="module")
def references():
    """One single-process run per model, trained on first use and shared by its cases."""
    cache = {}

    def get(model):
        if model not in cache:
            cache[model] = train_layout(tiny_config(model=MODELS[model]))
        return cache[model]
    return get


@pytest.mark.parametrize("model,parallel", CASES, ids=[f"{m}-{'-'.join(f'{k}{v}' for k, v in p.items())}"
                                                        for m, p in CASES])
def test_tp_matches_single_process(references, model, parallel):
    # fp32. TP changes only the order of sums: a row-parallel matmul adds tp partial sums, the
    # loss's sum-exp is added over vocabulary slices, and under SP replicated-parameter gradients
    # are added over sequence chunks; ~1e-7 relative per operation. Losses agree to ~1e-7.
    # Parameters: Adam divides each update by sqrt(v): for entries whose gradient is near zero a
    # 1e-7 relative gradient difference becomes a visible update difference. After 5 steps at
    # lr 1e-2 one process differs from itself by up to 3e-5 beyond rtol between micro_batch 1
    # and 2 (gqa8-tied), and gqa8-tied tp4 with SP by 6e-5: atol 1e-4 (1/100 of one step).
    got = train_layout(tiny_config(model=MODELS[model], parallel=parallel))
    assert_parity(got, references(model), atol=1e-4)


def expected_tp_bytes(sequence_parallel: bool) -> int:
    """Bytes `tetrad.comm` counts on the tp group per optimizer step, rank 0, TINY config.

    Conventions (comm/ops.py): all-reduce counts the tensor, all-gather its (gathered) output,
    reduce-scatter its (unscattered) input, so each collective below counts one full [b, s, h]
    activation, A bytes, whatever tp is.
    """
    m, t = TINY["model"], TINY["train"]
    b, s, h, layers = t["micro_batch"], m["seq_len"], m["d_model"], m["n_layers"]
    micro_batches = t["global_batch"] // b  # dp = 1: all micro-batches on this rank
    fp32 = 4
    A = b * s * h * fp32  # one activation of the residual stream
    if sequence_parallel:
        # forward per layer: all-gather before q/k/v, reduce-scatter after wo, the same for the
        # MLP (all-gather before w1/w3, reduce-scatter after w2); backward the mirror image
        # (reduce-scatter of the input gradient, all-gather of the output gradient): 8 A.
        # Embedding: reduce-scatter forward, all-gather backward; head: all-gather of the final
        # hidden forward, reduce-scatter of its gradient backward: 4 A.
        per_layer, outside = 8 * A, 4 * A
    else:
        # forward per layer: all-reduce after wo and after w2; backward: all-reduce of the input
        # gradient of q/k/v (one for the three: they share the input) and of w1/w3: 4 A.
        # Embedding: all-reduce forward; head: all-reduce of its input gradient backward: 2 A.
        per_layer, outside = 4 * A, 2 * A
    # Vocab-parallel cross-entropy: max, sum-exp and target logit, one fp32 per token each.
    loss = 3 * b * s * fp32
    per_micro_batch = layers * per_layer + outside + loss
    # Once per step: the step's sums over the job (6 fp32: squared gradient norm, loss, a flag
    # per stop signal and one for a closed stdout), and under SP the gradients of the replicated norm weights (2 per layer +
    # the final one, h each) summed over the sequence chunks.
    per_step = 6 * fp32 + ((2 * layers + 1) * h * fp32 if sequence_parallel else 0)
    return micro_batches * per_micro_batch + per_step


@pytest.mark.parametrize("sequence_parallel", [False, True])
def test_tp_bytes_match_analytical_count(sequence_parallel):
    _, _, history = train_layout(tiny_config(parallel={"tp": 2, "sequence_parallel": sequence_parallel}))
    expected = expected_tp_bytes(sequence_parallel)
    assert [r["comm_bytes"]["tp"] for r in history] == [expected] * len(history)
    assert all(r["comm_bytes"]["dp"] == 0 for r in history)


def _replicated_params(cfg):
    """This rank's tp-replicated parameters (norm weights) after training."""
    trainer = Trainer(cfg, torch.device("cpu"))
    trainer.fit()
    return {name: p.detach().clone() for name, p in trainer.model.named_parameters() if spec_of(p)[2] == 1}


@pytest.mark.parametrize("sequence_parallel", [False, True])
def test_tp_dropout_keeps_replicas_identical(sequence_parallel):
    # With dropout the run cannot match one process (other masks), but the tp replicas of every
    # replicated parameter must stay bitwise identical: without SP all tp ranks draw one mask
    # (ResidualDropout's shared generator), with SP their gradients are summed over tp.
    cfg = tiny_config(model={"dropout": 0.1}, parallel={"tp": 2, "sequence_parallel": sequence_parallel})
    rank0, rank1 = run_ranks(_replicated_params, 2, cfg)
    for name in rank0:
        assert torch.equal(rank0[name], rank1[name]), name
    assert any(not torch.equal(p, torch.ones_like(p)) for p in rank0.values())  # they did train
