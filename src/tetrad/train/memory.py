"""Measured activation memory: the bytes autograd keeps for backward, tracked as they come and go.

Every tensor autograd saves passes through a saved-tensors pack hook; the meter counts its
storage once (views of one storage share it) for as long as any saved reference to it lives,
and records the peak. Parameters (and views of them) are model states, not activations, and are
left out. A recompute checkpoint saves only its inputs through autograd (torch.utils.checkpoint
keeps what it recomputes out of this count), so the meter sees exactly what recomputation
saves (not the one layer it rebuilds during backward). Zero-bubble's deferred weight gradients
keep layer inputs and output gradients outside autograd until BW; they are counted through
`hold`. This is a count of tensors, not of an allocator: it is the same on CPU and GPU and free
of the noise of the process's resident set.
"""

from __future__ import annotations

import contextlib

import torch
import torch.nn as nn


class _Saved:
    """A saved tensor as autograd holds it; releases its storage's count when autograd drops it."""

    __slots__ = ("tensor", "key", "meter")

    def __init__(self, tensor: torch.Tensor, key: int, meter: "ActivationMeter"):
        self.tensor, self.key, self.meter = tensor, key, meter

    def __del__(self):
        self.meter._release(self.key)


class ActivationMeter:
    """Peak bytes of saved activations inside `measuring()` blocks."""

    def __init__(self):
        self.live = 0
        self.peak = 0
        self._held: dict[int, list[int]] = {}  # storage address -> [saved references, bytes]
        self._measuring = False

    @contextlib.contextmanager
    def measuring(self):
        """Count what autograd saves inside the block; `peak` restarts from what is live now."""
        self.peak = self.live
        self._measuring = True
        try:
            with torch.autograd.graph.saved_tensors_hooks(self._pack, self._unpack):
                yield
        finally:
            self._measuring = False

    def _pack(self, t: torch.Tensor):
        if isinstance(t, nn.Parameter) or isinstance(t._base, nn.Parameter):
            return t
        storage = t.untyped_storage()
        key = storage.data_ptr()
        if key == 0:
            return t
        held = self._held.setdefault(key, [0, storage.nbytes()])
        if held[0] == 0:
            self.live += held[1]
            self.peak = max(self.peak, self.live)
        held[0] += 1
        return _Saved(t, key, self)

    def hold(self, t: torch.Tensor):
        """Count `t` while the returned handle lives: for tensors kept for backward outside
        autograd (zero-bubble's deferred weight gradients). Only inside `measuring()`, as autograd's
        own: outside, counting 3 tensors a linear cost BI ~0.5 ms a micro-batch in bench_pp's zb row."""
        return self._pack(t) if self._measuring else None

    @staticmethod
    def _unpack(saved) -> torch.Tensor:
        return saved.tensor if isinstance(saved, _Saved) else saved

    def _release(self, key: int) -> None:
        held = self._held[key]
        held[0] -= 1
        if held[0] == 0:
            self.live -= held[1]
            del self._held[key]
