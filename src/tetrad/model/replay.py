"""What a per-op recompute (`selective-op`) keeps of ring attention and hands back to its replay."""

from __future__ import annotations

import contextlib


class RingReplay:
    """The ring's merged output and log-sum-exp, kept by a block's forward and handed back to its
    recompute under the per-op policy (`selective-op`, model/llama.py). The ring's backward reads
    only q, k, v and those two; left to the policy, the ring's block kernels would each keep their
    own (cp of them, over the whole sequence on the last cp rank: model/masks.py `ring_blocks`)
    and the recompute would run the ring again, K/V sends included. One per attention layer: the
    block's checkpoint opens `recording(kept)` around its forward, where each ring call appends
    its result to `kept` (and `running` tells the policy to keep nothing from inside it), and
    `replaying(kept)` around its recompute, where each ring call takes its result back without
    sending or computing."""

    def __init__(self):
        self.running = False  # inside a ring call's forward
        self._kept: list | None = None  # the open checkpoint's results, oldest first
        self._hold = None  # an activation meter's: the kept results live outside autograd
        self._replaying = False

    @contextlib.contextmanager
    def recording(self, kept: list, hold=None):
        self._kept, self._hold = kept, hold
        try:
            yield
        finally:
            self._kept, self._hold = None, None

    @contextlib.contextmanager
    def replaying(self, kept: list):
        self._kept, self._replaying = kept, True
        try:
            yield
        finally:
            self._kept, self._replaying = None, False

    def run(self, ring, *args):
        """ring(*args)'s (output, log-sum-exp): taken back while replaying, else computed (and
        kept while recording)."""
        if self._replaying:
            return self._kept.pop(0)[:2]
        self.running = True
        try:
            out, lse = ring(*args)
        finally:
            self.running = False
        if self._kept is not None:  # detached: the replay's node must not take over this output
            held = [self._hold(t) for t in (out, lse)] if self._hold else []
            self._kept.append((out.detach(), lse.detach(), held))
        return out, lse
