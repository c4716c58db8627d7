"""A bucket's gradient through one step: a small state machine (Megatron-Core's bucket seam).

    empty --first gradient--> filling --last gradient (and sync)--> reducing --wait--> reduced
      ^                                                                                   |
      +---------------------------- the next step's first gradient -----------------------+

Gradients arrive from a post-accumulate-grad hook and are added, in fp32, to the bucket's flat
gradient. When its last parameter's gradient is in, the bucket's collective starts, non-blocking:
on the accumulation's last micro-batch only (`last_microbatch`) under ZeRO 0/1, which
all-reduce (through a codec, or hierarchically); on every micro-batch under ZeRO >= 2, which
reduce-scatter into this rank's shard and sum the shards over micro-batches, freeing the full
gradient once reduced (its bucket goes back to empty): one bucket reduces while the next fills,
so at most two full buckets exist at a time (DeepSpeed's and FSDP's way).

Zero-bubble's split backward: BI makes the gradients that are not deferred (the norms', the
embedding's), BW the linears'. Under ZeRO 0/1 a deferred weight's hook in BI (autograd runs it
with nothing added) is not an arrival; its gradient arrives in BW. Under ZeRO >= 2 BI's are
parked apart (fp32) until BW starts the bucket, and the bucket is complete when BW has
delivered all of its linears' (a later micro-batch's BI may come first: it joins this
reduction), so no bucket is held full from BI to BW; a bucket of no linear (the embedding's and
learned positions') completes when BI has delivered all of its gradients, once a micro-batch.

Hybrid ZeRO (`replicas`: each shard group's replica group): the reduce-scatter runs over the
bucket's shard group, and its reduced shard is then summed over that group's replicas once a step, started as
the step's last reduce-scatter of the bucket ends (`_sum_over_replicas`), so that it overlaps
the rest of the last backward: ZeRO-1 sums its one reduction's shard (the last micro-batch's),
written back into its full bucket at the end of backward; ZeRO 2/3 the step's accumulated shard,
not each micro-batch's: the replica group spans nodes, and m micro-batches would send m times
the bytes. Either way a reduce-scatter ends when the next bucket's starts (double buffering,
`in_flight`) or at the end of backward; every rank issues both groups' collectives in the
buckets' order.
"""

from __future__ import annotations

import contextlib
import functools

import torch
import torch.nn as nn

from tetrad.dist import hierarchical
from tetrad.dist.layout import GRAD
from tetrad.model.execution import GRAD_LANDING, GRAD_SINK
from tetrad.parallel.data import collectives
from tetrad.parallel.data.buffers import Bucket


class GradSync:
    """The gradient lifecycle of `buckets` over the gradient group. `on_complete(bucket)` runs
    when a bucket's gradients of a backward are all in, before its reduction starts (ZeRO-3 frees
    the block's weights there). `codecs`: each bucket group's gradient codec, by the group's name.
    `shard`: the dense buckets' group (its backend picks the flat collectives, collectives.py);
    `replicas` (hybrid ZeRO): each bucket group's replica group, by the group's name.
    Without `trains` (a forward-only build: `tetrad eval`) no gradient buffer is kept."""

    def __init__(self, buckets: list[Bucket], topo, execution, zero: int, codecs: dict, hierarchical_: bool,
                 on_complete=None, linear_weights: frozenset[int] = frozenset(),
                 deferred_weights: frozenset[int] = frozenset(), shard: str = GRAD, replicas: dict | None = None,
                 trains: bool = True):
        self.buckets, self.topo, self.execution = buckets, topo, execution
        self.replicas = replicas or {}
        self.zero, self.codecs, self.hierarchical = zero, codecs, hierarchical_
        groups = {b.group for b in buckets}
        if groups - codecs.keys() or (self.replicas and groups - self.replicas.keys()):  # else a KeyError at its first reduction
            raise ValueError(f"GradSync needs a codec (and under hybrid ZeRO a replica group) for every bucket group "
                             f"{sorted(groups)}; got codecs for {sorted(codecs)}, replicas for {sorted(self.replicas)}")
        self.on_complete = on_complete or (lambda bucket: None)
        self.sync = False  # inside `last_microbatch`
        self.in_flight: list[Bucket] = []  # ZeRO >= 2 and hybrid ZeRO: reduce-scatters started, oldest first
        self.replica_sums: dict[int, object] = {}  # hybrid ZeRO: this step's all-reduces over the replicas
        self.scratch_free = collectives.scratch_free(topo, shard)  # gloo: all-reduce in place instead (collectives.py)
        # fp32 ZeRO 0/1 without zero-bubble's split backward: each bucket's flat gradient persists
        # and each p.grad becomes its view. `clear` drops p.grad rather than zeroing the buckets,
        # so a step's first gradient is copied over its view (one pass over it, where zeroing and
        # then adding took three: 6 of 130 ms a step in bench_dp) and later micro-batches' are
        # added into the bucket by autograd itself (torch DDP's gradient_as_bucket_view); a
        # parameter that got none is zeroed at the end of backward (`_settle`). The linears'
        # weights in `linear_weights` (by id; GradReducer's pick: those large enough to pay for
        # it) go further: their weight-gradient GEMM writes into the view itself
        # (model/execution.py's GRAD_SINK), so no dW tensor is made and copied; under a split
        # backward that GEMM is BW's. `deferred_weights` (by id): the weights whose gradients a
        # split backward defers to BW (every linear's).
        self.in_place = trains and zero < 2 and all(p.dtype == torch.float32 for b in buckets for p in b.params)
        self.deferred = deferred_weights if execution.split_backward else frozenset()
        self.handles = []  # the parameters' hooks, removed by `close`
        for bucket in buckets:
            bucket.from_bw = sum(id(p) in self.deferred for p in bucket.params)
            if self.in_place:
                bucket.grad = torch.zeros(bucket.padded, dtype=torch.float32, device=topo.device)
                bucket.views = [bucket.view(bucket.grad, i) for i in range(len(bucket.params))]
            for i, p in enumerate(bucket.params):
                self.handles.append(p.register_post_accumulate_grad_hook(self._hook(bucket, i)))
                if self.in_place and id(p) in linear_weights:
                    setattr(p, GRAD_SINK, functools.partial(self._sink, bucket, i, p))
                if id(p) in self.deferred:  # BW's gradients come outside autograd, without the hook
                    setattr(p, GRAD_LANDING, functools.partial(self.arrive, bucket, i, p))
                elif execution.split_backward:  # never silently into p.grad, past the bucket
                    setattr(p, GRAD_LANDING, functools.partial(_not_deferred, p))
        self.clear()

    @contextlib.contextmanager
    def last_microbatch(self):
        """Backward inside this block is the accumulation's last: buckets reduce as they fill.
        Outside it gradients only accumulate (`finish_all` still reduces whatever did not start)."""
        self.sync = True
        try:
            yield
        finally:
            self.sync = False

    # ------------------------------------------------------------------ arrivals
    def _hook(self, bucket: Bucket, i: int):
        def hook(p: nn.Parameter) -> None:
            # Not an arrival: a deferred weight's hook in zero-bubble's BI (its gradient comes in
            # BW, through its GRAD_LANDING, not this hook), where p.grad is None or, in place,
            # still its view from an earlier micro-batch.
            if p.grad is None or (id(p) in self.deferred and self.execution.weight_grads.collecting_now):
                return
            self.arrive(bucket, i, p, p.grad)
        return hook

    def arrive(self, bucket: Bucket, i: int, p: nn.Parameter, grad: torch.Tensor | None) -> None:
        """Parameter i's gradient of one backward, `grad`, moves into its bucket: from the hook,
        `p.grad` (autograd's accumulation), or from zero-bubble's BW, its GRAD_LANDING, a gradient
        made outside autograd (None where the GRAD_SINK has written it into its view)."""
        if self.in_place:
            self._arrive_in_place(bucket, i, p, grad)
            return
        if bucket.state == "reducing" and self.zero >= 2:  # last micro-batch's, still in flight
            self.finish(bucket)
        in_bi = self.execution.weight_grads.collecting_now
        if self.zero >= 2 and bucket.from_bw:  # BW's arrivals complete it; BI's wait parked
            bucket.seen += not in_bi
            complete = bucket.seen == bucket.from_bw
        else:  # every gradient counts, BI's too (a bucket of no linear completes in BI)
            bucket.seen += 1
            complete = bucket.seen == len(bucket.params)
        if in_bi and self.zero >= 2 and bucket.grad is None:
            if i in bucket.parked:
                bucket.parked[i].add_(grad)
            else:
                bucket.parked[i] = grad.float()
        else:
            self._fill(bucket, grad.device)
            bucket.view(bucket.grad, i).add_(grad)  # fp32 accumulation, whatever the model dtype
        p.grad = None
        if complete:
            bucket.seen = 0
            self._fill(bucket, grad.device)
            self.on_complete(bucket)
            if self.sync or self.zero >= 2:
                self.start(bucket)

    def _arrive_in_place(self, bucket: Bucket, i: int, p: nn.Parameter, grad: torch.Tensor | None) -> None:
        """Autograd has added parameter i's gradient into its view of the bucket (`grad` is the
        view), or, where p.grad was dropped (an optimizer's set_to_none), made a new one, which
        replaces the view's; or the GRAD_SINK has written it there (`_sink`; `grad` None, p.grad
        the view); or BW's `grad`, made outside autograd, is added here."""
        view = bucket.views[i]
        if p.grad is not view:
            view.copy_(grad)
            p.grad = view
        elif bucket.state == "reduced":
            raise RuntimeError(f"bucket {bucket.index}: a gradient was added to last step's reduced sum; "
                               "clear the gradients (GradReducer.zero_grad) between steps")
        elif grad is not None and grad is not view:
            view.add_(grad)
        self._open(bucket)
        bucket.seen += 1
        if bucket.seen == len(bucket.params):
            bucket.seen = 0
            self.on_complete(bucket)
            if self.sync:
                self.start(bucket)

    def _sink(self, bucket: Bucket, i: int, p: nn.Parameter, a: torch.Tensor, b: torch.Tensor) -> None:
        """Parameter i's GRAD_SINK (a linear's weight): its gradient a @ b added into its view by
        the GEMM, or, where p.grad was dropped, written over it (a new gradient: the bucket fills
        again, as for a copied one). Autograd then gets None for it, and still runs the
        post-accumulate hook, which counts the arrival (`_arrive_in_place`); in zero-bubble's BW,
        outside autograd, the weight's GRAD_LANDING counts it."""
        view = bucket.views[i]
        if p.grad is view:
            view.addmm_(a, b)
        else:
            torch.mm(a, b, out=view)
            p.grad = view
            self._open(bucket)

    @staticmethod
    def _open(bucket: Bucket) -> None:
        """In place: the bucket has a gradient of this step in it."""
        if bucket.state == "empty" or bucket.state == "reduced":
            bucket.state = "filling"

    def _fill(self, bucket: Bucket, device: torch.device) -> None:
        """Make the bucket's full gradient if it has none (empty, or last step's reduced) and add
        the parked gradients into it: the bucket is filling."""
        if bucket.state in ("empty", "reduced"):
            bucket.grad = torch.zeros(bucket.padded, dtype=torch.float32, device=device)
            bucket.state = "filling"
        for j, grad in bucket.parked.items():
            bucket.view(bucket.grad, j).add_(grad)
        bucket.parked.clear()

    # ------------------------------------------------------------------ reduction
    def start(self, bucket: Bucket) -> None:
        """filling -> reducing: start the bucket's collective, non-blocking."""
        if bucket.state != "filling":
            raise RuntimeError(f"bucket {bucket.index} starts reducing from {bucket.state}")
        bucket.state = "reducing"
        comm = self.topo.comm
        if self.zero >= 2 or self.replicas:
            wire = self.codecs[bucket.group].SCATTER_DTYPE
            full = bucket.grad if wire is None else bucket.grad.to(wire)
            bucket.pending, bucket.incoming = collectives.start_reduce(self.topo, full, bucket.shard_size,
                                                                       self.scratch_free, bucket.group)
            bucket.closing = self.sync  # then summed over the replicas as it ends (finish)
            self.in_flight.append(bucket)
            while len(self.in_flight) > 1:  # double buffering: one reducing while the next fills
                self.finish(self.in_flight[0])
        elif self.hierarchical and bucket.group == GRAD:  # the experts' smaller group reduces flat
            bucket.pending = hierarchical.all_reduce(bucket.grad, self.topo)
        else:
            bucket.pending = self.codecs[bucket.group].all_reduce(bucket.grad, comm, bucket.group, bucket.index)

    def finish(self, bucket: Bucket) -> None:
        """reducing -> reduced (ZeRO 0/1: the bucket's gradient is the sum) or, under ZeRO >= 2,
        -> empty with this micro-batch's shard added to `grad_shard` and the full gradient freed."""
        if bucket.state != "reducing":
            raise RuntimeError(f"bucket {bucket.index} finishes from {bucket.state}")
        bucket.pending.wait()
        bucket.pending = None
        if self.zero < 2:
            bucket.state = "reduced"
            if bucket.incoming is not None:  # hybrid ZeRO-1: `incoming` waits for its replicas' sum (finish_all)
                self.in_flight.remove(bucket)
                if bucket.closing:
                    self._sum_over_replicas(bucket)
            return
        incoming = bucket.incoming.float()  # a bf16 codec's sum back in fp32 (itself when fp32)
        if bucket.grad_shard is None:  # a copy when `incoming` is a view of the full gradient
            bucket.grad_shard = incoming.clone() if self.scratch_free and incoming is bucket.incoming else incoming
        else:
            bucket.grad_shard.add_(incoming)
        bucket.incoming = bucket.grad = None
        bucket.state = "empty"
        self.in_flight.remove(bucket)
        if bucket.closing:
            self._sum_over_replicas(bucket)

    def _sum_over_replicas(self, bucket: Bucket) -> None:
        """Hybrid ZeRO: start summing the bucket's reduced shard over its replicas, once a step
        (nothing without replicas)."""
        bucket.closing = False
        if self.replicas and bucket.index not in self.replica_sums:
            self.replica_sums[bucket.index] = self.topo.comm.all_reduce(self._reduced_shard(bucket),
                                                                        self.replicas[bucket.group], async_op=True)

    def _reduced_shard(self, bucket: Bucket) -> torch.Tensor | None:
        """This step's reduced shard of the bucket, if any: ZeRO-1's (hybrid) last reduction's,
        ZeRO 2/3's sum over micro-batches."""
        return bucket.grad_shard if self.zero >= 2 else bucket.incoming

    def finish_all(self) -> None:
        """Start every bucket that holds gradients and has not started, and finish every
        reduction: afterwards each bucket's sum is in `grad` (ZeRO 0/1) or `grad_shard`."""
        for bucket in self.buckets:
            if bucket.parked:
                self._fill(bucket, self.topo.device)
            if self.in_place:
                self._settle(bucket)
            if bucket.state == "filling":
                self.start(bucket)
        while self.in_flight:
            self.finish(self.in_flight[0])
        for bucket in self.buckets:
            if bucket.state == "reducing":
                self.finish(bucket)
            bucket.seen = 0
            if self._reduced_shard(bucket) is not None:  # a last reduction started outside `last_microbatch` too
                self._sum_over_replicas(bucket)
        for work in self.replica_sums.values():
            work.wait()
        self.replica_sums.clear()
        for bucket in self.buckets:
            if bucket.incoming is not None:  # hybrid ZeRO-1: the shard's sum into its place in the bucket
                shard = bucket.grad[bucket.lo:bucket.hi]
                if bucket.incoming.data_ptr() != shard.data_ptr():
                    shard.copy_(bucket.incoming)
                bucket.incoming = None

    def _settle(self, bucket: Bucket) -> None:
        """In place, at the end of backward: a parameter that got no gradient since `clear` has
        last step's value in its view; it is zero, as its p.grad (the view) says."""
        for i, p in enumerate(bucket.params):
            if p.grad is not bucket.views[i]:
                bucket.views[i].zero_()
                p.grad = bucket.views[i]

    def close(self) -> None:
        """Take the hooks and sinks off the parameters. Autograd holds a parameter's hooks from C++,
        where Python's garbage collector cannot see them, and they reach the parameter again through
        this object: without this the buckets and parameters outlive the run in its process (on a
        GPU, device memory the next run there, `tetrad check`'s reference under torchrun, lacks)."""
        for handle in self.handles:
            handle.remove()
        self.handles.clear()
        for bucket in self.buckets:
            for p in bucket.params:
                for name in (GRAD_SINK, GRAD_LANDING):
                    if hasattr(p, name):
                        delattr(p, name)

    def clear(self) -> None:
        """Drop every gradient (after the optimizer step): all buckets empty and every p.grad None
        (in place, the buckets keep their memory and last step's values: see `_arrive_in_place`)."""
        for bucket in self.buckets:
            bucket.grad_shard = None
            if not self.in_place:
                bucket.grad = None
            bucket.parked.clear()
            bucket.state = "empty"
            for p in bucket.params:
                p.grad = None


def _not_deferred(p: nn.Parameter, grad: torch.Tensor | None) -> None:
    """The GRAD_LANDING of a parameter whose gradient the reducer expects from autograd: a layer
    that queues it for BW anyway would put it in p.grad, past its bucket: never reduced over the
    data-parallel ranks, never seen by the optimizer."""
    raise RuntimeError(f"a weight of shape {tuple(p.shape)} had its gradient deferred to zero-bubble's BW, "
                       "but the reducer expects it inside autograd: add its layer to GradReducer's "
                       "deferred_weights (parallel/data/__init__.py)")
