"""Gradient codecs: compressed all-reduce of one flat fp32 bucket (SUM over the group); bf16 also
ZeRO >= 2's reduce-scatter (`SCATTER_DTYPE`).

Each codec returns a Pending whose wait() leaves the summed (decompressed) gradient in the
bucket. int8 and powersgd keep an error-feedback residual per bucket: what compression dropped
this step is added back before compressing the next, so the error does not accumulate.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from tetrad.dist.codec_shapes import INT8_BLOCK, POWERSGD_RANK, powersgd_shape


class Then:
    """A Pending followed by a local finishing step (decompression) once it completes."""

    def __init__(self, pending, finish):
        self._pending, self._finish = pending, finish

    def wait(self) -> None:
        self._pending.wait()
        self._finish()


class Plain:
    """Every codec's `all_reduce(flat, comm, group, key)` starts the reduction of one bucket and
    returns something to wait on; `key` names the bucket, so state kept between steps (error
    feedback, PowerSGD's Q) follows it. That state is this rank's own: `state_dict` gives it to
    the checkpoint as {"KIND.BUCKET": tensor} (KIND one of STATE)."""

    STATE: tuple[str, ...] = ()
    # The dtype ZeRO >= 2's reduce-scatter sums in under this codec (None: the gradients', fp32).
    # Only an elementwise cast can: int8's shared block scales and PowerSGD's factors need the
    # whole bucket on every rank (config.validate refuses them with ZeRO >= 2).
    SCATTER_DTYPE: torch.dtype | None = None

    def all_reduce(self, flat: torch.Tensor, comm, group: str, key: int):
        return comm.all_reduce(flat, group, async_op=True)

    def state_dict(self) -> dict[str, torch.Tensor]:
        return {f"{kind}.{key}": t for kind in self.STATE for key, t in getattr(self, kind).items()}

    def load_state_dict(self, state: dict[str, torch.Tensor]) -> None:
        for kind in self.STATE:
            setattr(self, kind, {})
        for name, t in state.items():
            kind, key = name.split(".")
            getattr(self, kind)[int(key)] = t


class BF16(Plain):
    """Halves the bytes; the sum itself is rounded to bf16 (no residual: the error is unbiased).
    Under ZeRO >= 2 the reduce-scatter sums in bf16 (FSDP2's and Megatron-LM's bf16 reduction)."""

    SCATTER_DTYPE = torch.bfloat16

    def all_reduce(self, flat, comm, group, key):
        low = flat.to(torch.bfloat16)
        return Then(comm.all_reduce(low, group, async_op=True), lambda: flat.copy_(low))


class Int8(Plain):
    """Blockwise int8 with one shared scale per block (a small MAX all-reduce first), so the int8
    payload itself can be summed by the all-reduce: each rank uses 127 // N levels, which keeps
    the N-rank sum inside int8. About 4x fewer bytes than fp32 (1 byte + 4/INT8_BLOCK per value)."""

    STATE = ("residual",)

    def __init__(self, group_size: int):
        self.levels = 127 // group_size
        self.residual: dict[int, torch.Tensor] = {}

    def all_reduce(self, flat, comm, group, key):
        if flat.numel() % INT8_BLOCK:
            raise ValueError(f"int8 codec needs buckets padded to a multiple of {INT8_BLOCK}")
        err = self.residual.setdefault(key, torch.zeros_like(flat))
        target = (flat + err).view(-1, INT8_BLOCK)
        scale = target.abs().amax(dim=1, keepdim=True)
        comm.all_reduce(scale, group, op=dist.ReduceOp.MAX)
        scale = (scale / self.levels).clamp(min=1e-30)
        q = (target / scale).round().clamp(-self.levels, self.levels)
        err.copy_((target - q * scale).view(-1))
        q = q.to(torch.int8)

        def finish():
            flat.copy_((q.float() * scale).view(-1))
        return Then(comm.all_reduce(q, group, async_op=True), finish)


class PowerSGD(Plain):
    """Rank-r PowerSGD (Vogels et al. 2019) over the whole bucket seen as a [rows, cols] matrix
    (`powersgd_shape`): P = M Q, all-reduce, orthonormalise, Q = M^T P, all-reduce, M ~ P Q^T.
    Q is warm-started from the previous step; the residual M/N - (P Q^T)/N stays on this rank
    (error feedback)."""

    STATE = ("residual", "q")

    def __init__(self, group_size: int, rank: int = POWERSGD_RANK):
        self.n, self.rank = group_size, rank
        self.residual: dict[int, torch.Tensor] = {}
        self.q: dict[int, torch.Tensor] = {}

    def all_reduce(self, flat, comm, group, key):
        n = flat.numel()
        rows, cols = powersgd_shape(n)
        err = self.residual.setdefault(key, torch.zeros_like(flat))
        m = flat.new_zeros(rows * cols)
        torch.add(flat, err, out=m[:n])
        m = m.view(rows, cols)
        if key not in self.q:  # the same seed on every rank: Q must agree
            gen = torch.Generator().manual_seed(flat.numel())
            self.q[key] = torch.randn(cols, self.rank, generator=gen).to(flat.device)
        q = self.q[key]
        p = m @ q
        comm.all_reduce(p, group)
        p = torch.linalg.qr(p).Q
        q.copy_(m.t() @ p)

        def finish():
            approx = (p @ q.t()).view(-1)[:n]
            err.copy_(m.view(-1)[:n] - approx / self.n)
            flat.copy_(approx)
        return Then(comm.all_reduce(q, group, async_op=True), finish)


def make_codec(name: str, group_size: int):
    """The codec object for parallel.grad_codec (none for a group of one: nothing to send)."""
    if name == "none" or group_size == 1:
        return Plain()
    if name == "bf16":
        return BF16()
    if name == "int8":
        return Int8(group_size)
    if name == "powersgd":
        return PowerSGD(group_size)
    raise ValueError(f"unknown gradient codec {name!r}")
