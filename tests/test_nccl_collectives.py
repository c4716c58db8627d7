"""Collectives under NCCL's timing of memory (tests/nccl_collectives.py): what the double catches
that gloo hides, and tetrad's layouts with non-blocking collectives under it against one process
(docs/design.md, "NCCL semantics on CPU")."""

from __future__ import annotations

import math
import time
from functools import partial

import pytest
import torch
import torch.distributed as dist

from conftest import assert_parity, run_ranks, tiny_config, train_layout
from layout_draws import parity_atol
from nccl_collectives import NcclCollectives, NcclTrainer, zero_collectives_as_on_nccl
from nccl_semantics import NcclSemantics
from tetrad.dist.comm import Comm
from tetrad.train.trainer import Trainer

pytestmark = pytest.mark.dist

DEADLINE_S = 120


class _World:
    """The Groups Comm needs: every name is the whole job."""

    def group(self, name: str):
        return dist.group.WORLD

    def reported(self, name: str) -> str:
        return name


def _comm(double: bool) -> Comm:
    comm = Comm(_World(), torch.device("cpu"))
    if double:
        comm.collectives = NcclCollectives()
    return comm


def _outcome(program) -> str:
    """What a program returns, or the error it raised."""
    try:
        return program()
    except RuntimeError as e:
        return f"error: {e}"


def _read_before_wait(comm: Comm):
    """The bug: the output read before the wait, after some compute, by when gloo's thread is done
    (it says so; the double never does: up to a second)."""
    t = torch.full((4,), float(dist.get_rank() + 1))
    pending = comm.all_reduce(t, "world", async_op=True)
    for _ in range(100):
        if pending.is_completed():
            break
        time.sleep(0.01)
    early = float(t.sum())
    pending.wait()
    return early, float(t.sum())


def _input_modified(comm: Comm):
    """The bug: the input changed while its all-gather runs (gloo copied it at the post)."""
    mine, out = torch.full((2,), float(dist.get_rank())), torch.zeros(4)
    pending = comm.all_gather(out, mine, "world", async_op=True)
    time.sleep(0.3)
    mine.add_(10)
    pending.wait()
    return out.tolist()


def _in_place_modified(comm: Comm):
    t = torch.ones(3)
    pending = comm.all_reduce(t, "world", async_op=True)
    t.mul_(2)
    pending.wait()
    return t.tolist()


def _output_freed(comm: Comm):
    """(Not on plain gloo: its thread would write into the freed memory.)"""
    out = torch.zeros(4)
    pending = comm.all_gather(out, torch.ones(2), "world", async_op=True)
    out.untyped_storage().resize_(0)  # ZeRO-3's free, too early
    pending.wait()
    return "no error"


def _completion(comm: Comm):
    """Whether a collective had completed (and its output) before its wait, after a later
    collective's wait on the group and after a blocking call there, and at its own wait; an
    in-place all-gather's own chunk and a broadcast root's buffer while in flight."""
    rank, seen = dist.get_rank(), {}
    a, b = torch.ones(2), torch.ones(2)
    first, second = comm.all_reduce(a, "world", async_op=True), comm.all_reduce(b, "world", async_op=True)
    time.sleep(0.3)
    seen["before any wait"] = (first.is_completed() or second.is_completed())
    second.wait()
    comm.all_reduce(torch.ones(1), "world")
    seen["after later waits"] = (first.is_completed(), a.tolist())
    first.wait()
    seen["at its wait"] = (first.is_completed(), a.tolist())
    flat = torch.full((4,), float(rank))
    gathering = comm.all_gather(flat, flat[2 * rank:2 * rank + 2], "world", async_op=True)
    root = torch.full((2,), 5.0)
    broadcasting = comm.broadcast(root, 0, "world", async_op=True)
    seen["in flight"] = (flat.tolist(), root.tolist())
    gathering.wait()
    broadcasting.wait()
    seen["done"] = (flat.tolist(), root.tolist())
    return seen


PROGRAMS = {"read before wait": _read_before_wait, "input modified": _input_modified,
            "in-place input modified": _in_place_modified, "output freed": _output_freed, "completion": _completion}
OUTCOMES: dict = {}


def _run_programs(double: bool):
    return {name: _outcome(partial(program, _comm(double))) for name, program in PROGRAMS.items()
            if double or name != "output freed"}


def outcomes(double: bool) -> dict:
    """Rank 0's outcome of every program (both ranks run them all, in the same order)."""
    if double not in OUTCOMES:
        OUTCOMES[double] = run_ranks(_run_programs, 2, double, timeout_s=DEADLINE_S)[0]
    return OUTCOMES[double]


def test_reading_an_all_reduce_before_its_wait_reads_poison_under_the_double_and_passes_on_gloo():
    early, after = outcomes(double=False)["read before wait"]
    assert early == after == 12.0  # gloo: the bug passes
    early, after = outcomes(double=True)["read before wait"]
    assert math.isnan(early) and after == 12.0


@pytest.mark.parametrize("program,op", [("input modified", "all_gather"), ("in-place input modified", "all_reduce")])
def test_an_input_modified_in_flight_is_an_error_under_the_double_and_passes_on_gloo(program, op):
    assert not str(outcomes(double=False)[program]).startswith("error")
    message = outcomes(double=True)[program]
    assert f"{op} on group 'world': input modified while in flight" in message, message


def test_an_output_freed_in_flight_is_an_error_under_the_double():
    assert "all_gather on group 'world': output freed while in flight" in outcomes(double=True)["output freed"]


def test_a_collective_completes_at_its_own_wait():
    """Never before (gloo's is long done after the pause), nor at a later collective's wait or a
    blocking call on the group (which would cover it on NCCL: the double is stricter); an
    in-place all-gather's own chunk and a broadcast root's buffer hold their values in flight
    (NCCL only reads them)."""
    seen = outcomes(double=True)["completion"]
    assert seen["before any wait"] is False
    completed, values = seen["after later waits"]
    assert completed is False and all(math.isnan(v) for v in values)
    assert seen["at its wait"] == (True, [2.0, 2.0])
    flat, root = seen["in flight"]  # rank 0's
    assert flat[:2] == [0.0, 0.0] and all(math.isnan(v) for v in flat[2:]) and root == [5.0, 5.0]
    assert seen["done"] == outcomes(double=False)["completion"]["done"] == ([0.0, 0.0, 1.0, 1.0], [5.0, 5.0])


# --------------------------------------------------------------------------- layouts

class _AsOnNccl(Trainer):
    """ZeRO's collectives as NCCL runs them, on gloo without the double."""

    def __init__(self, cfg, device):
        super().__init__(cfg, device)
        zero_collectives_as_on_nccl(self)


TRAIN = {"steps": 3, "micro_batch": 1, "global_batch": 4}
EVAL = {"train": {**TRAIN, "eval_every": 2, "eval_steps": 1}, "data": {"val_fraction": 0.1}}
AR, AG, RS = "all_reduce", "all_gather", "reduce_scatter"
BUCKETS = {"grad_bucket_mb": 0.05}  # several buckets: one reduces while the next fills
# name: (parallel, other sections, the non-blocking collectives rank 0 posts)
LAYOUTS = {
    "dp2-zero0": ({"dp": 2, **BUCKETS}, {}, {AR}),
    "dp2-zero1": ({"dp": 2, "zero": 1, **BUCKETS}, {}, {AR, AG}),
    "dp2-zero2": ({"dp": 2, "zero": 2, **BUCKETS}, {}, {RS, AG}),
    "dp2-zero3-eval": ({"dp": 2, "zero": 3}, EVAL, {RS, AG}),
    "dp4-hybrid-zero1": ({"dp": 4, "zero": 1, "zero_shard": 2, **BUCKETS}, {}, {RS, AR, AG}),
    "dp4-hybrid-zero3": ({"dp": 4, "zero": 3, "zero_shard": 2}, {}, {RS, AR, AG}),
    "dp4-hierarchical": ({"dp": 4, "hierarchical": True, "ranks_per_node": 2, **BUCKETS}, {}, {RS}),
    "tp2-sp-regather": ({"tp": 2, "sequence_parallel": True, "sp_regather": True}, {}, {AG, RS}),
    "tp2-dp2-zero3-tied": ({"tp": 2, "dp": 2, "zero": 3}, {"model": {"tie_embeddings": True}}, {AR, RS, AG}),
    "cp2-alltoall": ({"cp": 2, "cp_algo": "alltoall"}, {}, {AR}),
    "cp2-ring": ({"cp": 2}, {}, {AR}),
    "pp2-dp2-1f1b-zero1": ({"pp": 2, "dp": 2, "zero": 1}, {}, {AR, AG}),
    "pp2-dp2-zb-zero3-eval": ({"pp": 2, "dp": 2, "zero": 3, "schedule": "zb"}, EVAL, {RS, AG}),
    "tp2-sp-recompute-full": ({"tp": 2, "sequence_parallel": True}, {"train": {**TRAIN, "recompute": "full"}},
                              {RS}),
    "pp2-vpp2-dp2-zero2": ({"pp": 2, "vpp": 2, "schedule": "interleaved", "dp": 2, "zero": 2},
                           {"model": {"n_layers": 4}}, {RS, AG}),
    "dp2-zero1-offload": ({"dp": 2, "zero": 1}, {"train": {**TRAIN, "offload_optimizer": True}}, {AR, AG}),
    "dp2-zero2-bf16": ({"dp": 2, "zero": 2, **BUCKETS}, {"train": {**TRAIN, "dtype": "bf16"}}, {RS, AG}),
    "dp2-zero2-bf16-codec": ({"dp": 2, "zero": 2, "grad_codec": "bf16", **BUCKETS}, {}, {RS, AG}),
    "dp2-int8-codec": ({"dp": 2, "grad_codec": "int8", **BUCKETS}, {}, {AR}),
    "dp2-powersgd-codec": ({"dp": 2, "grad_codec": "powersgd"}, {}, {AR}),
}
# Not one process's numbers (compressed gradients, a bf16 model): compared with the same
# collectives on gloo without the double instead, bit for bit.
ON_GLOO = ("dp2-zero2-bf16", "dp2-zero2-bf16-codec", "dp2-int8-codec", "dp2-powersgd-codec")
REFERENCES: dict = {}


def _config(parallel: dict, sections: dict):
    return tiny_config(parallel=parallel, **{"train": TRAIN, **sections})


@pytest.mark.parametrize("name", list(LAYOUTS))
def test_layout_under_nccl_collectives_matches(name):
    """Bucketed reduction overlapped with backward (ZeRO 0-3, hybrid, hierarchical, codecs),
    ZeRO-3's prefetched gathers (and an evaluation's), tp's overlapped backward collectives, cp's
    and a pipeline's gradient reduction; cp's ring and the pipeline's transfers under NCCL's
    point-to-point too (tests/nccl_semantics.py)."""
    parallel, sections, posted = LAYOUTS[name]
    ring = parallel.get("cp", 1) > 1 and parallel.get("cp_algo", "ring") == "ring"
    transport = partial(NcclSemantics, timeout_s=20) if parallel.get("pp", 1) > 1 or ring else None
    got = train_layout(_config(parallel, sections), transport=transport, trainer_class=NcclTrainer,
                       timeout_s=DEADLINE_S)
    assert got[2][-1].pop("posted") == posted
    if name in ON_GLOO:
        ref = train_layout(_config(parallel, sections), trainer_class=_AsOnNccl)
        assert got[0] == ref[0] and all(torch.equal(got[1][k], ref[1][k]) for k in ref[1]) and ref[1]
        return
    key = repr(sections)
    if key not in REFERENCES:
        REFERENCES[key] = train_layout(_config({}, sections))
    assert_parity(got, REFERENCES[key], atol=parity_atol({"tp": 1, "cp": 1, **parallel}))
    val, ref_val = [r.get("val_loss") for r in got[2]], [r.get("val_loss") for r in REFERENCES[key][2]]
    assert (None not in val[1:]) == (sections is EVAL)
    if sections is EVAL:
        torch.testing.assert_close(torch.tensor(val[1:]), torch.tensor(ref_val[1:]), rtol=1e-5, atol=0)
