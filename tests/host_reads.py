"""A test double for what a GPU makes of the host reading a tensor's value: `.item()`,
`.tolist()`, `bool()`, `int()`, `float()`, `.numpy()`, a copy to the host (`.cpu()`,
`.to("cpu")`, numpy's `asarray`, printing), a Python list indexed with a tensor, and the ops
whose result's size or value the host must know (`nonzero`, a boolean mask's indexing,
`masked_select`, `unique`, `torch.equal`, `allclose`) each wait until every kernel queued before
them has run, so the host stops running ahead of the device (a "host sync"). On the CPU nothing
waits and a read costs nothing, so a sync per layer passes every CPU test unseen. `HostReads`
counts the reads of tensor values made while it is active, the backward's included; a path that
must not sync asserts it counted none. Host-side arrays (numpy) are not tensors and never count:
the host may read what it made itself.
"""

from __future__ import annotations

import torch
from torch.autograd.graph import _engine_run_backward
from torch.overrides import TorchFunctionMode

READS = frozenset({"item", "tolist", "__bool__", "__int__", "__float__", "__index__", "numpy", "cpu", "__array__",
                   "__repr__", "__format__", "nonzero", "masked_select", "unique", "unique_consecutive", "equal",
                   "allclose"})


class HostReads(TorchFunctionMode):
    """The value reads of tensors made while active, by method name, in order (`reads`)."""

    def __init__(self):
        super().__init__()
        self.reads: list[str] = []

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func in (torch.Tensor.backward, torch.autograd.backward):
            return self._backward(*args, **kwargs)
        name = getattr(func, "__name__", "")
        if name in READS or (name == "to" and _to_host(args[1:], kwargs)) or (name == "__getitem__" and _masks(args[1])):
            self.reads.append(name)
        return func(*args, **kwargs)

    def _backward(self, tensors, grad_tensors=None, retain_graph=None, create_graph=False, inputs=None,
                  gradient=None):
        """`torch.autograd.backward` with this mode on during it: torch runs a function a mode
        intercepts with the mode off, which would hide every read the backward makes. The engine
        call is torch's own, as torch.autograd.backward makes it."""
        tensors = (tensors,) if torch.is_tensor(tensors) else tuple(tensors)
        grads = gradient if grad_tensors is None else grad_tensors
        if grads is None:
            assert all(t.numel() == 1 for t in tensors), "a gradient is needed for a non-scalar"
            grads = tuple(torch.ones_like(t) for t in tensors)
        grads = (grads,) if torch.is_tensor(grads) else tuple(grads)
        inputs = () if inputs is None else ((inputs,) if torch.is_tensor(inputs) else tuple(inputs))
        with self:
            _engine_run_backward(tensors, grads, create_graph if retain_graph is None else retain_graph,
                                 create_graph, inputs, allow_unreachable=True, accumulate_grad=True)


def _to_host(args: tuple, kwargs: dict) -> bool:
    """Whether a `Tensor.to` call names the host as its device."""
    return any(str(a) == "cpu" for a in (*args, kwargs.get("device")))


def _masks(index) -> bool:
    """Whether an index holds a boolean tensor (whose selection's size only its values tell)."""
    return any(torch.is_tensor(i) and i.dtype == torch.bool for i in (index if isinstance(index, tuple) else (index,)))
