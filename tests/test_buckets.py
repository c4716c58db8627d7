"""The bucket lifecycle (parallel/data/lifecycle.py) and ZeRO-3's prefetch (zero3.py), driven
directly by autograd, without the trainer."""

import contextlib

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

from conftest import run_ranks
from tetrad.dist.codecs import make_codec
from tetrad.dist.layout import GRAD, Layout
from tetrad.dist.topology import Topology
from tetrad.model.execution import GRAD_SINK, Execution
from tetrad.model.mappings import linear
from tetrad.parallel.data.buffers import flatten, lay_out
from tetrad.parallel.data.lifecycle import GradSync
from tetrad.parallel.data.optimizer import MasterWeights
from tetrad.parallel.data.zero3 import ParamGather


def _setup(zero: int, topo, n_params: int = 4, bucket_bytes: float = 2 * 4 * 6):
    """Parameters of 6 elements, two to a bucket (bucket_bytes of fp32 gradient each)."""
    params = [nn.Parameter(torch.zeros(6)) for _ in range(n_params)]
    layout = lay_out(params, None, zero, topo.size("dp_cp"), topo.local_rank("dp_cp"), 1, bucket_bytes)
    sync = GradSync(layout.buckets, topo, Execution(), zero, {GRAD: make_codec("none", 1)}, False)
    return params, layout.buckets, sync


def _backward(params, scale: float) -> None:
    sum(((i + 1) * scale * p).sum() for i, p in enumerate(params)).backward()


def test_zero0_fills_until_the_last_microbatch_then_reduces():
    params, buckets, sync = _setup(0, Topology.single())
    assert [b.state for b in buckets] == ["empty", "empty"] and [len(b.params) for b in buckets] == [2, 2]
    _backward(params, 1.0)
    assert [b.state for b in buckets] == ["filling", "filling"]  # no sync: gradients only accumulate
    # fp32: each p.grad is its view of the bucket, where autograd adds (in place, no copy)
    assert sync.in_place and all(p.grad is b.views[i] for b in buckets for i, p in enumerate(b.params))
    with sync.last_microbatch():
        _backward(params, 2.0)
    assert [b.state for b in buckets] == ["reducing", "reducing"]  # started as each completed
    sync.finish_all()
    assert [b.state for b in buckets] == ["reduced", "reduced"]
    # buckets are in backward order: the last parameters first
    assert buckets[0].view(buckets[0].grad, 0).tolist() == [12.0] * 6  # param 3: (1 + 2) * 4
    with pytest.raises(RuntimeError, match="reduced sum"):
        _backward(params, 1.0)  # not cleared: it would add to the reduced sum
    sync.clear()
    _backward(params, 1.0)  # the next step starts from zero, not from the reduced sum
    assert buckets[0].state == "filling" and buckets[0].view(buckets[0].grad, 0).tolist() == [4.0] * 6
    for p in params:  # an optimizer's set_to_none: autograd's new gradient replaces the view's
        p.grad = None
    _backward(params, 1.0)
    assert buckets[0].view(buckets[0].grad, 0).tolist() == [4.0] * 6 and params[3].grad is buckets[0].views[0]


def test_zero0_a_parameter_without_gradient_after_clear_reduces_zero():
    params, buckets, sync = _setup(0, Topology.single())
    _backward(params, 1.0)
    sync.finish_all()
    sync.clear()  # the buckets keep last step's values; p.grad is None
    assert all(p.grad is None for p in params)
    _backward(params[1:], 1.0)  # param 0 (bucket 1's second) gets no gradient this step
    sync.finish_all()
    assert params[0].grad is buckets[1].views[1] and params[0].grad.tolist() == [0.0] * 6
    assert params[1].grad.tolist() == [1.0] * 6  # overwritten, not added to last step's


def test_zero0_linear_weight_gradients_are_written_into_the_bucket_by_their_gemm():
    torch.manual_seed(0)
    weights = [nn.Parameter(torch.randn(3, 4)) for _ in range(2)]
    reference = [nn.Parameter(w.detach().clone()) for w in weights]
    layout = lay_out(weights, None, 0, 1, 0, 1, 1e6)
    sync = GradSync(layout.buckets, Topology.single(), Execution(), 0, {GRAD: make_codec("none", 1)}, False,
                    linear_weights=frozenset(id(w) for w in weights))
    bucket, ex = layout.buckets[0], Execution()
    assert all(hasattr(w, GRAD_SINK) for w in weights)
    xs = [torch.randn(2, 5, 4) for _ in range(2)]
    for step in range(2):  # the second step starts over the first's reduced sum
        for k, x in enumerate(xs):
            with sync.last_microbatch() if k == 1 else contextlib.nullcontext():
                linear(linear(x, weights[0], ex).tanh(), weights[1].t(), ex).sum().backward()
            F.linear(F.linear(x, reference[0]).tanh(), reference[1].t()).sum().backward()
        assert bucket.state == "reducing"  # both weights arrived, counted once each
        sync.finish_all()
        refs = {id(w): ref for w, ref in zip(weights, reference)}
        for w, view in zip(bucket.params, bucket.views):
            assert w.grad is view
            torch.testing.assert_close(w.grad, refs[id(w)].grad, rtol=1e-6, atol=1e-6)
            refs[id(w)].grad = None
        sync.clear()


def test_a_bucket_cannot_start_twice_or_finish_unstarted():
    params, buckets, sync = _setup(0, Topology.single())
    with pytest.raises(RuntimeError, match="starts reducing from empty"):
        sync.start(buckets[0])
    with pytest.raises(RuntimeError, match="finishes from empty"):
        sync.finish(buckets[0])


def test_zero2_reduces_every_microbatch_double_buffered():
    params, buckets, sync = _setup(2, Topology.single(), n_params=6)
    _backward(params, 1.0)
    # each completed bucket started at once; starting the next finished the one before
    assert [b.state for b in buckets] == ["empty", "empty", "reducing"] and sync.in_flight == [buckets[2]]
    assert buckets[0].grad is None and buckets[0].grad_shard is not None  # the full gradient is freed
    _backward(params, 2.0)  # the bucket still reducing finishes before its next gradient lands
    sync.finish_all()
    assert [b.state for b in buckets] == ["empty"] * 3 and not sync.in_flight
    assert buckets[2].grad_shard[6:].tolist() == [3.0] * 6  # param 0, summed over both micro-batches


def _two_ranks_zero2():
    topo = Topology(Layout(dp=2), torch.device("cpu"))
    params, buckets, sync = _setup(2, topo)
    _backward(params, 1.0 + topo.rank)  # rank r's gradients are (r + 1) times rank 0's
    sync.finish_all()
    return [(b.lo, b.grad_shard.tolist()) for b in buckets]


@pytest.mark.dist
def test_zero2_shards_hold_the_sum_over_the_gradient_group():
    for rank, shards in enumerate(run_ranks(_two_ranks_zero2, 2)):
        for k, (lo, shard) in enumerate(shards):
            full = [3.0 * (4 - 2 * k)] * 6 + [3.0 * (3 - 2 * k)] * 6  # (1 + 2) x the parameter's factor
            assert lo == 6 * rank and shard == full[lo:lo + 6]


class _Blocks(nn.Module):
    def __init__(self, n: int):
        super().__init__()
        self.layers = nn.ModuleDict({str(i): nn.Linear(4, 4) for i in range(n)})

    def forward(self, x):
        for block in self.layers.values():
            x = block(x)
        return x


@pytest.mark.parametrize("prefetch", [0, 1, 2])
def test_zero3_gathers_each_block_and_prefetches_the_next(prefetch):
    topo, model = Topology.single(), _Blocks(4)
    params = list(model.parameters())
    layout = lay_out(params, model, 3, 1, 0, 1, 0)
    weights = MasterWeights(layout.buckets, topo, 3, torch.float32, separate=False, offload=False)
    for flat, owned in flatten(layout.buckets, torch.float32, topo.device, weights.owned_range):
        weights.add(flat, owned)
    gather = ParamGather(layout.buckets, weights.flat, weights.shards, topo, Execution(), layout.block_buckets,
                         layout.roots, prefetch)
    gather.install(model, layout.blocks)
    held = []
    for block in layout.blocks:
        block.register_forward_pre_hook(lambda m, a: held.append(
            [k for k, f in enumerate(weights.flat) if f.untyped_storage().nbytes()]), prepend=False)
    model(torch.ones(2, 4))
    assert held == [list(range(k, min(k + 1 + prefetch, 4))) for k in range(4)]
    assert all(f.untyped_storage().nbytes() == 0 for f in weights.flat)  # freed after each block


def test_a_bucket_group_without_its_codec_is_refused_at_construction():
    """Not a KeyError at the first reduction, mid-backward: GradSync names the groups it lacks."""
    params = [nn.Parameter(torch.zeros(6)) for _ in range(2)]
    buckets = lay_out(params, None, 0, 1, 0, 1, 48).buckets
    with pytest.raises(ValueError, match=r"codec .* for every bucket group \['dp_cp'\]; got codecs for \[\]"):
        GradSync(buckets, Topology.single(), Execution(), 0, {}, False)
    with pytest.raises(ValueError, match=r"replicas for \['other'\]"):
        GradSync(buckets, Topology.single(), Execution(), 1, {GRAD: make_codec("none", 1)}, False,
                 replicas={"other": "other_replica"})
