"""Position reset at document starts (train.reset_positions, Megatron-LM's --reset-position-ids):
each token's position is its offset within its document. Proven against running each document on
its own (with document masking), then every layout family against one process with the key on."""

import json
from functools import lru_cache

import pytest
import torch

from conftest import DOC_EOS as EOS, assert_all_within, assert_parity, doc_shards, run_ranks, tiny_config, \
    train_layout
from tetrad.config import ConfigError
from tetrad.data.checks import check_data
from tetrad.dist.sequence import shard_sequence
from tetrad.dist.topology import Topology
from tetrad.model.documents import Documents, document_positions
from tetrad.train.batches import split_batches
from tetrad.train.trainer import Trainer, build_model


def _offsets(row: list[int]) -> list[int]:
    """Each token's offset within its document, the plain way."""
    out, at = [], 0
    for token in row:
        out.append(at)
        at = 0 if token == EOS else at + 1
    return out


def test_positions_restart_after_each_eos():
    x = torch.tensor([[5, 6, EOS, 7, EOS, EOS, 8, 9, 9, 9, 9, 9, EOS, 1, 2, 3],
                      [EOS, 1, 2, 3, 4, 5, 6, 7, 8, 9, 1, 2, 3, 4, 5, 6]])
    got = document_positions(x, EOS)
    assert got[0].tolist() == [0, 1, 2, 0, 1, 0, 0, 1, 2, 3, 4, 5, 6, 0, 1, 2]
    assert got[1].tolist() == [0, 0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14]
    g = torch.Generator().manual_seed(0)
    many = torch.randint(1, 9, (3, 64), generator=g)
    many[torch.rand(many.shape, generator=g) < 0.1] = EOS
    assert document_positions(many, EOS).tolist() == [_offsets(r) for r in many.tolist()]


def _shard_positions(cp: int, reset: bool = True):
    """Each cp rank's positions of one step's micro-batches, as the trainer cuts them; the
    windows; and whether each is the trainer's one shared positions tensor."""
    cfg = tiny_config(parallel={"cp": cp}, data={"source": doc_shards()}, train={"reset_positions": reset})
    trainer = Trainer(cfg, torch.device("cpu"))
    micro = trainer.batches.microbatches(0, 0, 1, cfg.train.micro_batch)
    positions = [m[3] for m in trainer._sequence_shards(micro)]
    return positions, [x for x, _ in micro], [p is trainer.positions for p in positions]


def test_cp_ranks_hold_the_true_offsets_of_their_chunks():
    """A document that crosses a cp chunk boundary goes on counting in the next chunk, on whichever
    rank holds it: each rank's positions are the whole window's offsets at its tokens."""
    cp, crossed = 2, False
    for rank, (positions, windows, _) in enumerate(run_ranks(_shard_positions, cp, cp)):
        for got, x in zip(positions, windows):
            whole = torch.tensor([_offsets(r) for r in x.tolist()])
            assert torch.equal(got, shard_sequence(whole, cp, rank))
            chunk = got.shape[1] // 2  # each rank holds two chunks; the window's first starts at 0
            crossed |= bool((got[:, chunk] > 0).any()) or (rank > 0 and bool((got[:, 0] > 0).any()))
    assert crossed  # some document did cross a chunk boundary


def _model_apart(pos: str):
    """The model's logits over packed windows, with the mask and reset positions, against each
    document alone at positions 0, 1, ...; and the logits with positions running on."""
    cfg = tiny_config(model={"pos": pos})
    model = build_model(cfg, Topology.single())
    g = torch.Generator().manual_seed(2)
    x = torch.randint(1, cfg.model.vocab_size, (2, cfg.model.seq_len), generator=g)
    x[torch.rand(x.shape, generator=g) < 0.15] = EOS
    docs, reset = Documents.of_windows(x, EOS, torch.device("cpu")), document_positions(x, EOS)
    spans = [(r, a, b) for r in range(2) for a, b in _spans(docs.ids[r])]
    with torch.no_grad():
        logits = model(x, reset, docs=docs)
        running = model(x, torch.arange(cfg.model.seq_len), docs=docs)
        errors = [float((logits[r:r + 1, a:b] - model(x[r:r + 1, a:b], torch.arange(b - a))).abs().max())
                  for r, a, b in spans]
    return errors, float((logits - running).abs().max())


def _spans(ids: torch.Tensor) -> list[tuple[int, int]]:
    ids = ids.tolist()
    starts = [i for i in range(len(ids)) if i == 0 or ids[i] != ids[i - 1]]
    return list(zip(starts, starts[1:] + [len(ids)]))


@pytest.mark.parametrize("pos", ["rope", "learned"])
def test_packed_window_equals_each_document_alone(pos):
    errors, reset_vs_running = run_ranks(_model_apart, 1, pos)[0]
    assert_all_within(errors, 1e-5)
    if pos == "learned":
        assert reset_vs_running > 1e-2  # the reset moves every later document's positions
    else:  # RoPE sees only offsets within a document, which the mask keeps to: rounding alone
        assert reset_vs_running < 1e-5


def _window_by_row_positions():
    """A windowed, document-masked model's logits given each row's positions ([b, s], as the reset
    gives them) and given the one [s] tensor, over windows without an EOS (the same offsets)."""
    cfg = tiny_config(model={"sliding_window": 3})
    model = build_model(cfg, Topology.single())
    x = torch.randint(1, cfg.model.vocab_size, (2, cfg.model.seq_len), generator=torch.Generator().manual_seed(3))
    docs = Documents.of_windows(x, EOS, torch.device("cpu"))  # the mask's bias is built once for the layers
    with torch.no_grad():
        by_row = model(x, document_positions(x, EOS), docs=docs)
        shared = model(x, torch.arange(cfg.model.seq_len), docs=docs)
    return float((by_row - shared).abs().max())


def test_a_sliding_window_masks_as_much_with_positions_per_row():
    """The layers' shared mask (window and documents) measures the sequence from the positions'
    last dimension: per-row positions [b, s] were read as a sequence of b tokens (a shape error)."""
    assert run_ranks(_window_by_row_positions, 1)[0] < 1e-6


def test_without_the_key_every_micro_batch_shares_one_positions_tensor():
    """The model keeps the RoPE tables of the positions tensor it was last given (Transformer.rope):
    with the key off they are computed once per run, not once per micro-batch."""
    positions, _, shared = run_ranks(_shard_positions, 1, 1, False)[0]
    assert len(positions) > 1 and all(shared), shared
    positions, _, shared = run_ranks(_shard_positions, 1, 1, True)[0]
    assert not any(shared)


# ----------------------------------------------------------------------------- training parity

# RoPE without the mask (Megatron-LM allows --reset-position-ids alone): tokens attend across
# documents, so the reset changes what they see (under the mask RoPE's offsets within a document
# would not change; learned positions below take the mask).
GEMMA3 = {"norm": "gemma_rmsnorm", "mlp": "geglu", "scale_embeddings": True, "sandwich_norm": True, "qk_norm": True,
          "sliding_window": 5, "layer_types": ["sliding_attention", "full_attention"], "rope_local_base_freq": 100.0,
          "rope_scaling": {"rope_type": "linear", "factor": 8.0}}
LAYOUTS = {  # name -> (parallel, model, document_mask, train)
    "dp2-zero3-selective": ({"dp": 2, "zero": 3}, {}, False, {"recompute": "selective"}),
    "tp2-sp": ({"tp": 2, "sequence_parallel": True}, {}, False, {}),
    "cp2-ring": ({"cp": 2, "cp_algo": "ring"}, {}, False, {}),
    "cp2-ring-selective-op": ({"cp": 2, "cp_algo": "ring"}, {}, False, {"recompute": "selective-op"}),
    "cp2-alltoall": ({"cp": 2, "cp_algo": "alltoall"}, {}, False, {}),
    "pp2-1f1b": ({"pp": 2, "schedule": "1f1b"}, {}, False, {}),
    "pp2-zb": ({"pp": 2, "schedule": "zb"}, {}, False, {}),
    "pp2-vpp2-interleaved-full": ({"pp": 2, "vpp": 2, "schedule": "interleaved"}, {"n_layers": 4}, False,
                                  {"recompute": "full"}),
    "tp2-sp-learned-masked": ({"tp": 2, "sequence_parallel": True}, {"pos": "learned"}, True, {}),
    "cp2-ring-window-masked": ({"cp": 2, "cp_algo": "ring"}, {"sliding_window": 5}, True, {}),
    # the all-to-all path builds the shared bias from [b, s] positions too; cp3's chunks of 8 are
    # the window exactly (off-diagonal pairs seen wholly or not at all, none in part)
    "cp2-alltoall-window-masked": ({"cp": 2, "cp_algo": "alltoall"}, {"sliding_window": 5}, True, {}),
    "cp3-ring-window-of-a-chunk-masked": ({"cp": 3, "cp_algo": "ring"}, {"seq_len": 48, "sliding_window": 8}, True, {}),
    # Gemma 3: each row's positions through both RoPEs (the sliding layer's own theta, the global
    # one's linear scaling), a cp rank's chunks holding their true offsets
    "cp2-ring-gemma3": ({"cp": 2, "cp_algo": "ring"}, GEMMA3, False, {}),
    "tp2-sp-gemma3-masked": ({"tp": 2, "sequence_parallel": True}, GEMMA3, True, {}),
}


def _config(parallel: dict, model: dict, mask: bool, reset: bool = True, **train):
    return tiny_config(parallel=parallel, model=model, data={"source": doc_shards(), "val_fraction": 0.2},
                       train={"document_mask": mask, "reset_positions": reset, "eval_every": 5, **train})


@lru_cache(maxsize=None)
def _train(name: str | None, reset: bool = True, model: str = "{}", mask: bool = False):
    """`model`: the one-process run's [model] keys as JSON (hashable, lists and tables too)."""
    parallel, model, mask, train = LAYOUTS[name] if name else ({}, json.loads(model), mask, {})
    return train_layout(_config(parallel, model, mask, reset, **train))


def _reference(name: str):
    _, model, mask, _ = LAYOUTS[name]
    return _train(None, model=json.dumps(model, sort_keys=True), mask=mask)


@pytest.fixture(scope="module")
def references():
    """The one-process runs first (a forked single-rank job hangs once the pytest process has
    computed with its OpenMP pool)."""
    return {name: _reference(name) for name in LAYOUTS}


def test_the_reset_changes_training(references):
    for model, mask in (("{}", False), ('{"pos": "learned"}', True)):
        running, reset = _train(None, reset=False, model=model, mask=mask), _train(None, model=model, mask=mask)
        assert abs(running[0][-1] - reset[0][-1]) > 1e-3, (running[0], reset[0])


@pytest.mark.dist
@pytest.mark.parametrize("name", list(LAYOUTS))
def test_layout_matches_single_process(name, references):
    # tests/test_document_mask.py's bounds: fp32, only orders of sums differ.
    got, ref = _train(name), references[name]
    assert_parity(got, ref, atol=2e-4, loss_atol=2e-6)
    assert got[2][-1]["val_loss"] == pytest.approx(ref[2][-1]["val_loss"], rel=1e-5)  # validation resets too


# ----------------------------------------------------------------------------- validation

def test_data_without_an_eos_is_refused():
    with pytest.raises(ConfigError, match=r"train.reset_positions: 'licenses' does not say which token ends a "
                                          r"document.*set train.reset_positions=false"):
        check_data(tiny_config(train={"reset_positions": True}))
    check_data(tiny_config(train={"reset_positions": True}, data={"source": doc_shards()}))


def test_megatron_name_points_at_the_key():
    with pytest.raises(ConfigError, match=r"did you mean 'train.reset_positions'"):
        tiny_config(train={"reset_position_ids": True})


@pytest.mark.dist
def test_compiled_layout_matches_single_process(references):
    """Each micro-batch's RoPE tables enter the compiled blocks as new tensors of one shape: no
    recompile after step 1, no graph break (tests/test_compile.py's counts)."""
    from test_compile import CountingTrainer
    parallel, model, mask, _ = LAYOUTS["cp2-ring"]
    got = train_layout(_config(parallel, model, mask, compile=True), trainer_class=CountingTrainer, timeout_s=900)
    frames = [record["frames_compiled"] for record in got[2]]
    assert frames[0] > 0 and frames == frames[:1] * len(frames), frames
    assert got[2][-1]["other_breaks"] == [], got[2][-1]["other_breaks"]
    assert_parity(got, references["cp2-ring"], atol=2e-4, loss_atol=2e-6)  # tests/test_compile.py's cp2 bounds


def test_validation_and_each_source_of_a_blend_reset_too():
    cfg = tiny_config(data={"source": f"1 {doc_shards()} 1 {doc_shards()}", "val_fraction": 0.2},
                      train={"reset_positions": True})
    train, val = split_batches(cfg)
    x, _ = val.global_batch_at(0)
    for batches in (train, val, *(part for b in (train, val) for _, part in b.split())):
        assert torch.equal(batches.positions(x), document_positions(x, EOS)) and batches.documents(x, "cpu") is None
