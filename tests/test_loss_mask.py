"""Supervised fine-tuning's loss mask: a prompt's labels are left out of the loss, and the step's
loss is the mean over the global batch's counted labels, whatever the layout cuts it into (a mean
per micro-batch or per rank would weigh each label by its batch's count). Proven on one process
against an independent cross-entropy, then every layout against one process."""

import json
from fractions import Fraction
from functools import lru_cache
from pathlib import Path

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from conftest import assert_parity, run_ranks, sft_shards, tiny_config, train_layout
from tetrad.data.packing import ExamplePacks
from tetrad.data.sources import CORPORA, TokenStream, load_tokens
from tetrad.model.layers import IGNORED_LABEL
from tetrad.config import load_config
from tetrad.train.batches import Batches, split_batches
from tetrad.train.trainer import Trainer


def _batches(sources, global_batch: int = 8) -> Batches:
    return Batches(sources, seq_len=32, global_batch=global_batch, seed=0, vocab_size=256)


def test_a_prompts_labels_are_ignored_and_the_rest_counted():
    tokens = load_tokens(sft_shards())
    batches = _batches([(1, tokens)])
    inputs, labels = batches.global_batch_at(3)
    windows = batches.windows[0]
    packed = windows.starts(np.arange(3 * 8, 4 * 8))
    rows, counted = (torch.from_numpy(a) for a in (windows.packs.read(packed), windows.packs.counted(packed)))
    assert torch.equal(inputs, rows[:, :-1])
    assert torch.equal(labels, rows[:, 1:].masked_fill(~counted[:, 1:], IGNORED_LABEL))
    assert 0 < (labels != IGNORED_LABEL).sum() < labels.numel() / 2 < (labels == IGNORED_LABEL).sum()
    assert batches.loss_tokens(3) == int((labels != IGNORED_LABEL).sum())
    # each dp rank's share, cut into micro-batches, is the global batch's
    shares = [torch.cat([y for _, y in batches.microbatches(3, rank, 2, 2)]) for rank in range(2)]
    assert torch.equal(torch.cat(shares), labels)


def test_examples_are_packed_whole_in_order_and_padded():
    """Examples of 3, 4, 2, 9 and 1 tokens (each ending in EOS 0), capacity 6: (3), (4 + 2), the
    9 cut to 6 alone, and the last 1, which the stream ends without an EOS (a split's cut)."""
    lengths = [3, 4, 2, 9, 1]
    ids = np.concatenate([np.r_[np.arange(10 * i + 1, 10 * i + n), 0] for i, n in enumerate(lengths[:-1])] + [[41]])
    mask = np.concatenate([np.r_[0, np.ones(n - 1)] for n in lengths]).astype(np.uint8)
    stream = TokenStream([ids[:8], ids[8:]], [mask[:8], mask[8:]], eos=0)  # a shard boundary inside a pack
    packs = ExamplePacks(stream, capacity=6)
    assert (packs.starts.tolist(), packs.lengths.tolist()) == ([0, 3, 9, 18], [3, 6, 6, 1])
    assert (packs.examples, packs.truncated) == (5, 1)
    rows, counted = packs.read(np.array([1, 0, 3, 2])), packs.counted(np.array([1, 0, 3, 2]))
    assert rows.tolist() == [[11, 12, 13, 0, 21, 0], [1, 2, 0, 0, 0, 0], [41, 0, 0, 0, 0, 0],
                             [31, 32, 33, 34, 35, 36]]
    assert counted.astype(int).tolist() == [[0, 1, 1, 1, 0, 1], [0, 1, 1, 0, 0, 0], [0, 0, 0, 0, 0, 0],
                                            [0, 1, 1, 1, 1, 1]]
    assert packs.fill() == pytest.approx(16 / 24)


def test_held_out_examples_are_whole():
    """data.val_fraction moves its cut back to the start of the example it falls in: every held-out
    example keeps its prompt, and a last example longer than the fraction is held out, not dropped.
    Plain streams are cut where the fraction says."""
    stream = load_tokens(sft_shards())
    head, tail = stream.held_out(0.2)
    cut = len(head)
    assert len(stream) - int(len(stream) * 0.2) - 30 < cut <= len(stream) - int(len(stream) * 0.2)
    assert stream.window(cut - 1, 1)[0] == 0 and len(head) + len(tail) == len(stream)  # an EOS ends the head
    assert stream.counted([cut], 1)[0, 0] == 0  # the tail starts with a prompt
    long_last = TokenStream([np.r_[[1, 2, 0] * 10, [5] * 40, 0]], [np.ones(71, np.uint8)], eos=0)
    assert [len(part) for part in long_last.held_out(0.05)] == [30, 41]
    plain = TokenStream([np.arange(1000) % 7], eos=0)
    assert len(plain.held_out(0.2)[0]) == 800


def test_every_example_of_the_shards_is_in_one_pack_whole():
    stream = load_tokens(sft_shards())
    packs = ExamplePacks(stream, capacity=33)
    tokens = stream.window(0, len(stream))
    ends = packs.starts + packs.lengths
    assert packs.starts[0] == 0 and (packs.starts[1:] == ends[:-1]).all()  # no example left out: none is cut here
    assert (tokens[ends - 1] == 0).all() and (tokens[packs.starts[1:] - 1] == 0).all()  # each pack ends an example
    assert packs.truncated == 0 and packs.examples == int((tokens == 0).sum())


def test_a_blend_counts_every_label_of_a_source_without_a_mask():
    plain = TokenStream([np.arange(3000) % 200])
    batches = _batches([(Fraction(1, 2), load_tokens(sft_shards())), (Fraction(1, 2), plain)], global_batch=16)
    _, labels = batches.global_batch_at(0)
    plain_rows = (labels != IGNORED_LABEL).all(dim=1)
    assert 0 < int(plain_rows.sum()) < 16  # both sources are in the batch, and only the plain one is whole
    assert batches.loss_tokens(0) == int((labels != IGNORED_LABEL).sum())
    assert _batches([(1, plain)]).loss_tokens(0) == 8 * 32


def test_cross_entropy_gives_an_ignored_label_no_loss_and_no_gradient():
    from tetrad.model.layers import vocab_parallel_cross_entropy

    class OneRank:
        tp_size = 1
    logits = torch.randn(2, 5, 16, requires_grad=True)
    labels = torch.tensor([[1, IGNORED_LABEL, 3, 4, IGNORED_LABEL], [IGNORED_LABEL, 2, 2, 0, 9]])
    losses = vocab_parallel_cross_entropy(logits, labels, 12, OneRank())
    losses.sum().backward()
    ignored = labels == IGNORED_LABEL
    assert (losses[ignored] == 0).all() and (losses[~ignored] > 0).all()
    assert (logits.grad[ignored] == 0).all() and (logits.grad[~ignored].abs().sum(-1) > 0).all()


# ----------------------------------------------------------------------------- one process

def _config(parallel: dict, train: dict | None = None, source: str | None = None, **sections):
    """TINY on the SFT shards, a validation at the last step."""
    return tiny_config(parallel=parallel, data={"source": source or sft_shards(), "val_fraction": 0.2},
                       train={"eval_every": 5, **(train or {})}, **sections)


def _first_loss_by_hand(cfg):
    """(the first step's recorded loss, the mean cross-entropy over the global batch's counted
    labels by torch's own cross_entropy on the untrained model's logits)."""
    trainer = Trainer(cfg, torch.device("cpu"))
    inputs, labels = trainer.batches.global_batch_at(0)
    with torch.no_grad():
        logits = trainer.model(inputs, trainer.positions)[..., :cfg.model.vocab_size]
    by_hand = F.cross_entropy(logits.flatten(0, 1), labels.flatten(), ignore_index=IGNORED_LABEL)
    return trainer.train_step(0)["loss"], float(by_hand)


@lru_cache(maxsize=None)
def _train(name: str | None, document_mask: bool = False, micro_batch: int = 2):
    parallel, train = LAYOUTS[name] if name else ({}, {"document_mask": document_mask, "micro_batch": micro_batch})
    return train_layout(_config(parallel, train))


LAYOUTS = {  # name -> (parallel, train); the reference is one process with the same document_mask
    "dp2-zero1": ({"dp": 2, "zero": 1}, {}),
    "tp2-sp": ({"tp": 2, "sequence_parallel": True}, {}),
    "cp2-ring": ({"cp": 2, "cp_algo": "ring"}, {}),
    "pp2-1f1b-docmask": ({"pp": 2, "schedule": "1f1b"}, {"document_mask": True}),
    "dp2-pp2-zb-zero2": ({"dp": 2, "pp": 2, "schedule": "zb", "zero": 2}, {}),
}


@pytest.fixture(scope="module")
def references():
    """The one-process runs first (a forked single-rank job hangs once the pytest process has
    computed with its OpenMP pool)."""
    return {masked: _train(None, document_mask=masked) for masked in (False, True)}


def test_the_first_loss_is_the_mean_over_counted_labels(references):
    recorded, by_hand = run_ranks(_first_loss_by_hand, 1, _config({}))[0]
    assert recorded == pytest.approx(by_hand, rel=1e-6)


def test_the_mask_changes_training(tmp_path, references):
    """The same tokens without their masks train otherwise: the masks are read."""
    unmasked = tmp_path / "unmasked"
    unmasked.mkdir()
    for f in Path(sft_shards()).iterdir():
        if f.suffix != ".mask":
            (unmasked / f.name).write_bytes(f.read_bytes())
    index = json.loads((unmasked / "index.json").read_text())
    (unmasked / "index.json").write_text(json.dumps({**index, "loss_mask": False}))
    plain = train_layout(_config({}, source=str(unmasked)))
    assert abs(plain[0][0] - references[False][0][0]) > 1e-2, (plain[0], references[False][0])


def test_accumulation_does_not_reweigh_labels(references):
    """micro_batch 1 and 2 cut the batch into micro-batches of different label counts: the same run.
    Only the order of sums differs; AdamW amplifies it in a weight whose gradient nearly cancels:
    1.3e-5 on the 2-core AVX-512/AMX Xeon (2026-12-05), past 1e-5. A reweighing moves the losses
    and the gradient norms, which keep their bounds."""
    assert_parity(_train(None, micro_batch=1), references[False], atol=5e-5)


@pytest.mark.dist
@pytest.mark.parametrize("name", list(LAYOUTS))
def test_layout_matches_single_process(name, references):
    # fp32: only orders of sums differ (tp pieces, dp x cp, micro-batches), as test_document_mask's.
    got, ref = _train(name), references[LAYOUTS[name][1].get("document_mask", False)]
    assert_parity(got, ref, atol=2e-4, loss_atol=2e-6)
    assert got[2][-1]["val_loss"] == pytest.approx(ref[2][-1]["val_loss"], rel=1e-5)  # validation masks too


def test_tetrad_data_then_train_counts_the_responses(tmp_path):
    """The user's path: `tetrad data --prompt-key` on JSON Lines, then `tetrad train` on the folder
    with document masking. Each step's loss_tokens is the count of response tokens (and EOS) among
    the step's labels, read here from the written masks by the windows the data gives."""
    from tetrad.cli import main
    text = CORPORA["licenses"].read_text()[:20_000].split()
    records = [{"prompt": " ".join(text[i:i + 6]), "response": " ".join(text[i + 6:i + 9])} for i in range(0, 2400, 9)]
    (tmp_path / "sft.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
    out, run = tmp_path / "sft", tmp_path / "run"
    assert main(["data", str(tmp_path / "sft.jsonl"), "--out", str(out), "--vocab-size", "300", "--workers", "1",
                 "--prompt-key", "prompt", "--json-key", "response"]) == 0
    assert main(["train", f"--data.source={out}", "--train.document_mask=true", "--train.steps=3",
                 "--model.seq_len=32", "--train.global_batch=4", "--train.micro_batch=2", f"--run.dir={run}"]) == 0
    steps = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    batches, _ = split_batches(load_config(run / "config.toml"))  # the run's own data, as it resolved it
    counted = [int((batches.global_batch_at(i)[1] != IGNORED_LABEL).sum()) for i in range(3)]
    assert [r["loss_tokens"] for r in steps] == counted
    assert all(0 < c < 4 * 32 / 2 for c in counted)  # three response words after six prompt words: well under half


def test_a_few_short_examples_fill_windows():
    """Packs need an example, not seq_len + 2 tokens: three 8-token examples make windows of 32
    (a small held-out set of fine-tuning examples is not refused for being short)."""
    ids = np.tile(np.r_[np.arange(1, 8), 0], 3)
    stream = TokenStream([ids], [np.tile(np.r_[np.zeros(4), np.ones(4)], 3).astype(np.uint8)], eos=0)
    inputs, labels = _batches([(1, stream)], global_batch=2).global_batch_at(0)
    assert inputs.shape == (2, 32) and inputs[0, :24].tolist() == ids.tolist()[:24]
    assert (labels != IGNORED_LABEL).sum() == 2 * 3 * 4  # every pack holds the three examples


@pytest.mark.dist
def test_a_packed_run_resumes_in_another_layout(references):
    """Steps 1-2 on dp2 ZeRO-1, a checkpoint, steps 3-5 resumed on tp2 with SP: the packs, their
    order and the normaliser follow on, and the five steps are the one-process run's."""
    first = _config(*LAYOUTS["dp2-zero1"], checkpoint={"every": 2, "keep": 3})
    losses, _, history = train_layout(first)
    step2 = str(Path(first.run.dir) / "checkpoints" / "step_00000002")
    later = train_layout(_config(*LAYOUTS["tp2-sp"], checkpoint={"resume": step2}))
    assert len(later[0]) == 3  # steps 3-5
    assert_parity((losses[:2] + later[0], later[1], history[:2] + later[2]), references[False], atol=2e-4,
                  loss_atol=2e-6)


@pytest.mark.dist
@pytest.mark.parametrize("parallel", [{"pp": 2, "vpp": 2, "schedule": "interleaved", "cp": 2},
                                      {"dp": 2, "pp": 2, "schedule": "zb", "zero": 3}], ids=["interleaved-cp2", "zb-zero3"])
def test_packed_sft_under_nccl_ordering_equals_gloo(parallel):
    """Under NCCL's ordering (tests/nccl_semantics.py: in-order communicator queues, rendezvous
    sends) the pipeline carries the masked labels' micro-batches, and validation, as gloo does:
    the same losses bit for bit, nothing hung."""
    from functools import partial
    from nccl_semantics import NcclSemantics

    def run(transport=None):
        cfg = _config(parallel, {"document_mask": True}, model={"n_layers": 4})
        return [(r["loss"], r["loss_tokens"], r.get("val_loss")) for r in train_layout(cfg, transport=transport)[2]]
    ordered, gloo = run(partial(NcclSemantics, timeout_s=20)), run()
    assert ordered == gloo and gloo[-1][2] is not None
