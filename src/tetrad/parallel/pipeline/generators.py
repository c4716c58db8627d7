"""The schedules' generators: for one pipeline rank, the (kind, micro-batch, chunk) it runs, in order.

Each is registered once in registry.py, which turns the lists into a validated Schedule. They
place global stage g = chunk * pp + rank (schedules.stage_of).
"""

from __future__ import annotations

Step = tuple[str, int, int]  # (kind, mb, chunk): what a generator lists, before it becomes an Action


def gpipe(rank: int, pp: int, m: int, vpp: int) -> list[Step]:
    """All forwards, then all backwards: m activations alive at the peak."""
    return [("F", i, 0) for i in range(m)] + [("B", i, 0) for i in range(m)]


def one_f_one_b(rank: int, pp: int, m: int, vpp: int) -> list[Step]:
    """PipeDream-flush: pp-1-rank warm-up forwards, then alternate, so at most pp-rank stay alive."""
    warmup = min(pp - 1 - rank, m)
    ops = [("F", i, 0) for i in range(warmup)]
    for i in range(m):
        if warmup + i < m:
            ops.append(("F", warmup + i, 0))
        ops.append(("B", i, 0))
    return ops


def zb_h1(rank: int, pp: int, m: int, vpp: int) -> list[Step]:
    """ZB-H1 (Qi et al. 2024): 1F1B with B split; rank r holds back its first r weight-grad passes.

    Only BI is on the critical path back to rank 0, so gradients reach the early ranks sooner;
    the deferred BW then fill the cool-down bubble. Peak in-flight stays at most pp, as in 1F1B.
    """
    ops = []
    for kind, mb, chunk in one_f_one_b(rank, pp, m, vpp):
        if kind == "F":
            ops.append((kind, mb, chunk))
            continue
        ops.append(("BI", mb, chunk))
        if mb >= rank:
            ops.append(("BW", mb - rank, chunk))
    return ops + [("BW", i, 0) for i in range(max(m - rank, 0), m)]


def interleaved(rank: int, pp: int, m: int, vpp: int) -> list[Step]:
    """Megatron's interleaved 1F1B, generalised to any m >= pp.

    Micro-batches run in groups of pp, each group through every chunk before the next starts; the
    last group also takes the m % pp left over. Warm-up is Megatron's 2(pp-1-rank) + (vpp-1)pp
    chunk-forwards, plus (vpp-1)(m % pp) so that the larger last group's last-chunk forwards come
    before their backwards. Backwards visit chunks in reverse (the last chunk holds the loss).
    With uniform costs the bubble is (pp-1)/(vpp*m + pp-1) for every m >= pp.
    """
    rem = m % pp
    starts = list(range(0, m - rem, pp))
    groups = zip(starts, starts[1:] + [m])
    order = [(mb, chunk) for lo, hi in groups for chunk in range(vpp) for mb in range(lo, hi)]
    back = [(mb, vpp - 1 - chunk) for mb, chunk in order]
    total = len(order)
    warmup = min(2 * (pp - 1 - rank) + (vpp - 1) * (pp + rem), total)
    ops = [("F", *order[i]) for i in range(warmup)]
    for i in range(total):
        if warmup + i < total:
            ops.append(("F", *order[warmup + i]))
        ops.append(("B", *back[i]))
    return ops
