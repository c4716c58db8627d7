"""Pipeline schedules under NCCL's ordering (tests/nccl_semantics.py), and that transport's own
semantics: what gloo hides, on CPU (DESIGN.md, "NCCL semantics on CPU")."""

from __future__ import annotations

import time
from functools import partial

import pytest
import torch
import torch.distributed as dist

from conftest import assert_parity, doc_shards, run_ranks, tiny_config, train_layout
from layout_draws import parity_atol
from nccl_semantics import NcclSemantics
from tetrad.parallel.pipeline.registry import SCHEDULES, schedule_spec

pytestmark = pytest.mark.dist

# A deadlock fails the transport's queue after TIMEOUT_S; the job's deadline backs it up.
TIMEOUT_S = 20
DEADLINE_S = 120


def _order_across_neighbours(batched: bool):
    """Rank 1 posts a receive from rank 0, then a send to rank 2; rank 0 sends only after a
    pause. Returns (when rank 0 posted its send, when rank 2's receive completed)."""
    transport, rank = NcclSemantics(timeout_s=TIMEOUT_S), dist.get_rank()
    buffer = torch.zeros(4)

    def post(send: bool, peer: int):
        if batched:
            return transport.batch_isend_irecv([dist.P2POp(dist.isend if send else dist.irecv, buffer, peer)])[0]
        return (transport.isend if send else transport.irecv)(buffer, peer)
    when = None
    if rank == 0:
        time.sleep(2.0)
        when = time.time()
        post(True, 1).wait()
    elif rank == 1:
        first, second = post(False, 0), post(True, 2)
        second.wait()
        first.wait()
    else:
        post(False, 1).wait()
        when = time.time()
    transport.close()
    return when


@pytest.mark.parametrize("batched", [True, False], ids=["batched", "plain"])
def test_a_groups_batched_point_to_point_runs_in_posting_order(batched):
    """Batched, rank 1's send to rank 2 waits behind its earlier receive from rank 0 (one
    communicator for the group); plain isend/irecv use a communicator per pair and do not."""
    sent, received = run_ranks(_order_across_neighbours, 3, batched, timeout_s=DEADLINE_S)[::2]
    assert (received >= sent) == batched, (sent, received)


def _two_transfers_with_crossed_tags():
    transport, rank = NcclSemantics(timeout_s=TIMEOUT_S), dist.get_rank()
    if rank == 0:
        works = [transport.batch_isend_irecv([dist.P2POp(dist.isend, torch.full((2,), v), 1, tag=t)])[0]
                 for v, t in ((1.0, 7), (2.0, 3))]
        out = []
    else:
        out = [torch.zeros(2), torch.zeros(2)]
        works = [transport.batch_isend_irecv([dist.P2POp(dist.irecv, buf, 0, tag=t)])[0]
                 for buf, t in zip(out, (3, 7))]
    for w in works:
        w.wait()
    transport.close()
    return [float(t[0]) for t in out]


def test_tags_are_ignored():
    """Transfers match by order on a communicator, as NCCL's do: the receive tagged 3 gets the
    first send (tagged 7)."""
    assert run_ranks(_two_transfers_with_crossed_tags, 2, timeout_s=DEADLINE_S)[1] == [1.0, 2.0]


# --------------------------------------------------------------------------- pipeline parity

REFERENCES: dict = {}


def _parity_runs(schedule: str, pp: int):
    vpp = schedule_spec(schedule).default_vpp()
    layers, m = 2 * pp, pp + 1  # one layer per interleaved stage; m that pp does not divide
    train = {"micro_batch": 1, "global_batch": m, "steps": 2}
    cfg = tiny_config(model={"n_layers": layers}, parallel={"pp": pp, "vpp": vpp, "schedule": schedule}, train=train)
    if (layers, m) not in REFERENCES:
        REFERENCES[layers, m] = train_layout(tiny_config(model={"n_layers": layers}, train=train))
    return cfg, REFERENCES[layers, m]


@pytest.mark.parametrize("pp", [2, 3, 4])
@pytest.mark.parametrize("schedule", list(SCHEDULES))
def test_schedule_matches_single_process_under_nccl_ordering(schedule, pp):
    """Interleaved with pp >= 3 deadlocked here while every link shared the "pp" group's
    communicator: a receive posted early from one neighbour blocked the sends to the other."""
    cfg, reference = _parity_runs(schedule, pp)
    assert_parity(train_layout(cfg, transport=partial(NcclSemantics, timeout_s=TIMEOUT_S), timeout_s=DEADLINE_S),
                  reference)


@pytest.mark.parametrize("recompute,masked,window", [("none", False, 0), ("full", False, 0), ("selective-op", False, 0),
                                                      ("none", True, 0), ("none", False, 5), ("selective-op", True, 3)])
def test_context_parallel_ring_is_unchanged_under_nccl_ordering(recompute, masked, window):
    """CP's ring passes K/V as one batched send and receive per pass (one queue item, run as one
    NCCL group): the same numbers as on gloo, bit for bit; under full recompute the ring runs
    again inside the backward, under selective-op its kept result is replayed without sending.
    Under document masking or a sliding window a block no row sees is skipped (a window shorter
    than the ring's reach skips whole steps), its K/V still passed on in order."""
    def run(transport=None):
        model = {"sliding_window": window, **({"vocab_size": 256} if masked else {})}
        cfg = tiny_config(parallel={"cp": 4}, train={"steps": 2, "recompute": recompute, "document_mask": masked},
                          model=model, **({"data": {"source": doc_shards()}} if masked else {}))
        return train_layout(cfg, transport=transport, timeout_s=DEADLINE_S)
    losses, state, _ = run(partial(NcclSemantics, timeout_s=TIMEOUT_S))
    gloo_losses, gloo_state, _ = run()
    assert losses == gloo_losses and state.keys() == gloo_state.keys() and gloo_state
    assert all(torch.equal(state[k], gloo_state[k]) for k in gloo_state)


@pytest.mark.parametrize("parallel,model", [({"pp": 3, "vpp": 2, "schedule": "interleaved"}, {}),
                                            ({"pp": 2, "dp": 2, "zero": 3, "schedule": "zb"}, {}),
                                            ({"pp": 2, "vpp": 3, "dp": 2, "zero": 3, "schedule": "interleaved"},
                                             {"tie_embeddings": True}),
                                            ({"pp": 2, "dp": 2, "zero": 3, "zero_shard": 1, "schedule": "zb"}, {}),
                                            ({"pp": 2, "dp": 2, "zero": 1, "zero_shard": 1, "schedule": "zb"}, {})],
                         ids=["interleaved-pp3", "zb-dp2-zero3", "interleaved-dp2-zero3-tied", "zb-dp2-hybrid-zero3",
                              "zb-dp2-hybrid-zero1"])
def test_evaluation_under_nccl_ordering(parallel, model):
    """The forward-only schedule of an evaluation (its own sends and receives, and under ZeRO-3 the
    gathers it frees afterwards) between training steps: the same losses as on gloo, bit for bit;
    with tied embeddings, the embedding's own ZeRO-3 bucket gathered over both stages' steps; under
    hybrid ZeRO, the replicas' all-reduces started beside the pipeline's transfers."""
    def run(transport=None):
        cfg = tiny_config(model={"n_layers": 6, **model}, parallel=parallel, data={"val_fraction": 0.1},
                          train={"steps": 2, "eval_every": 1, "eval_steps": 2, "micro_batch": 1, "global_batch": 6})
        return train_layout(cfg, transport=transport, timeout_s=DEADLINE_S)[2]
    ordered, gloo = run(partial(NcclSemantics, timeout_s=TIMEOUT_S)), run()
    assert [r.get("val_loss") for r in ordered] == [r.get("val_loss") for r in gloo]
    assert all("val_loss" in r for r in gloo) and [r["loss"] for r in ordered] == [r["loss"] for r in gloo]



# Drawn by a random search over pipeline layouts under NCCL's ordering (65 draws, no hang and no
# difference beyond summation order), for the combinations the fixed cases above lack: dp with
# ZeRO-2 across stages, three chunks per rank over an uneven layer count, tp inside interleaving,
# cp with zero-bubble; each evaluates too.
DRAWN = [({"pp": 2, "dp": 2, "zero": 2}, 2, 8),
         ({"pp": 2, "vpp": 3, "schedule": "interleaved"}, 7, 2),
         ({"pp": 2, "vpp": 2, "schedule": "interleaved", "tp": 2}, 8, 4),
         ({"pp": 2, "cp": 2, "schedule": "zb"}, 4, 3)]


@pytest.mark.parametrize("parallel, layers, global_batch", DRAWN,
                         ids=lambda v: "-".join(f"{k}{x}" for k, x in v.items()) if isinstance(v, dict) else str(v))
def test_drawn_pipeline_layouts_match_single_process_under_nccl_ordering(parallel, layers, global_batch):
    train = {"micro_batch": 1, "global_batch": global_batch, "steps": 2, "eval_every": 1, "eval_steps": 1}
    config = lambda p: tiny_config(model={"n_layers": layers}, parallel=p, train=train, data={"val_fraction": 0.1})
    got = train_layout(config(parallel), transport=partial(NcclSemantics, timeout_s=TIMEOUT_S), timeout_s=DEADLINE_S)
    ref = train_layout(config({}))
    assert_parity(got, ref, atol=parity_atol({"tp": 1, "cp": 1, **parallel}))  # test_tp's and test_cp's bounds
    val, ref_val = [r["val_loss"] for r in got[2]], [r["val_loss"] for r in ref[2]]
    torch.testing.assert_close(torch.tensor(val), torch.tensor(ref_val), rtol=1e-5, atol=0)
