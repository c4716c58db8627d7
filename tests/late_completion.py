"""An accelerator's view of point-to-point, on CPU: `wait()` returns before the transfer ends.

On a GPU, `work.wait()` makes the compute stream wait for the transfer and returns at once on
the host; the time shows only on the device's clock. `LateCompletion` models that with a
virtual device clock: at `wait()` the host takes the received values (the real gloo transfer is
over, so the numbers stay right) and goes on at once, while the device stream waits another
`latency_s` for the transfer to end. The device then runs behind the host by the waits so far
(`lag`), and `mark()`, the clock's event, reads host time plus that lag: when the stream reaches
the mark. It stands where the device's clock and torch.distributed's point-to-point calls stand
for tetrad's comm layer (`Comm.clock`, `Comm.transport`), as a backend would.
"""

from __future__ import annotations

import time

import torch.distributed as dist


class LateCompletion:
    def __init__(self, latency_s: float):
        self.latency_s = latency_s
        self.lag = 0.0  # device time minus host time
        self.stalled = {"recv": 0.0, "send": 0.0}  # the device's waits so far, for receives and for sends

    # -------------------------------------------------------------- the device's clock
    def mark(self) -> float:
        return time.perf_counter() + self.lag

    def seconds(self, start: float, end: float) -> float:
        return end - start

    # -------------------------------------------------------------- the transport
    def batch_isend_irecv(self, p2p_ops) -> list["_LateWork"]:
        kind = "recv" if any(op.op is dist.irecv for op in p2p_ops) else "send"
        return [_LateWork(work, self, kind) for work in dist.batch_isend_irecv(p2p_ops)]


class _LateWork:
    def __init__(self, work, link: LateCompletion, kind: str):
        self.work, self.link, self.kind = work, link, kind

    def wait(self) -> bool:
        self.work.wait()
        self.link.lag += self.link.latency_s  # the stream waits; the host does not
        self.link.stalled[self.kind] += self.link.latency_s
        return True

    def is_completed(self) -> bool:
        return self.work.is_completed()
