"""Pipeline schedules as data: for each pipeline rank, the ordered list of compute actions it runs.

One representation, three readers (DESIGN.md, "Pipeline: schedules are data"): the executor runs
it, the simulator times it, the renderer draws it. Placement is Megatron's interleaved one: global
stage g = chunk * pp + rank, so local chunk c of every rank makes one pass over ranks 0..pp-1.

Data flow between actions is described by values: ("act", g, mb) is the output of F at stage g,
("grad", g, mb) the gradient w.r.t. stage g's input, made by B or BI at g. F at g needs act(g-1);
B/BI at g need act(g) (their own stash) and grad(g+1); BW at g needs grad(g), i.e. its BI.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import NamedTuple

KINDS = ("F", "B", "BI", "BW")
SCHEDULES = ("gpipe", "1f1b", "interleaved", "zb")


class ScheduleError(ValueError):
    """A schedule that cannot run, or cannot be built for the requested shape."""


@dataclass(frozen=True)
class Action:
    kind: str  # "F" forward, "B" full backward, "BI" input-grad half, "BW" weight-grad half
    mb: int  # micro-batch index 0..m-1
    chunk: int = 0  # local model-chunk index on this rank, 0..vpp-1

    def __str__(self) -> str:
        return f"{self.kind}(mb={self.mb}, chunk={self.chunk})"


@dataclass
class Schedule:
    name: str
    pp: int
    microbatches: int
    vpp: int
    actions: list[list[Action]]  # one ordered list per pipeline rank

    @property
    def stages(self) -> int:
        return self.pp * self.vpp


class Value(NamedTuple):
    what: str  # "act" or "grad"
    stage: int
    mb: int


@dataclass(frozen=True)
class P2POp:
    """A point-to-point transfer an action implies: receive before computing, send after."""

    op: str  # "send" or "recv"
    peer: int  # the other pipeline rank
    value: Value  # what travels; (what, stage, mb) is unique within a step

    def tag(self, microbatches: int) -> int:
        """A tag unique within the step, so the two ends match however their posts interleave."""
        return (2 * self.value.stage + (self.value.what == "grad")) * microbatches + self.value.mb


def stage_of(rank: int, chunk: int, pp: int) -> int:
    return chunk * pp + rank


def place_of(stage: int, pp: int) -> tuple[int, int]:
    """(rank, chunk) holding global `stage`; inverse of stage_of."""
    return stage % pp, stage // pp


def needs(s: Schedule, rank: int, a: Action) -> list[Value]:
    """The values `a` on `rank` consumes."""
    g = stage_of(rank, a.chunk, s.pp)
    if a.kind == "F":
        return [Value("act", g - 1, a.mb)] if g > 0 else []
    if a.kind == "BW":
        return [Value("grad", g, a.mb)]
    own = [Value("act", g, a.mb)]
    return own + [Value("grad", g + 1, a.mb)] if g < s.stages - 1 else own


def makes(s: Schedule, rank: int, a: Action) -> Value | None:
    """The value `a` on `rank` produces (BW produces nothing another action waits for)."""
    if a.kind == "BW":
        return None
    return Value("act" if a.kind == "F" else "grad", stage_of(rank, a.chunk, s.pp), a.mb)


def _producer(s: Schedule, v: Value) -> str:
    rank, chunk = place_of(v.stage, s.pp)
    kind = "F" if v.what == "act" else "B/BI"
    return f"{kind}(mb={v.mb}, chunk={chunk}) on rank {rank}"


def p2p_ops(s: Schedule, rank: int) -> list[tuple[Action, list[P2POp]]]:
    """For each action of `rank`, in order, the receives it waits on and the sends it issues.

    Transfers between chunks on the same rank (pp=1) are local and listed nowhere. The validator
    replays data dependencies only; for a valid schedule to be unable to hang, the executor must
    (1) not wait on a send before computing its next action (complete sends lazily) and (2) match
    transfers by `P2POp.tag`, not by posting order, since the two ends of a link may post them in
    different orders (interleaved at pp=2: each direction carries activations and gradients).
    """
    out = []
    for a in s.actions[rank]:
        ops = []
        for v in needs(s, rank, a):
            src = place_of(v.stage, s.pp)[0]
            if src != rank:
                ops.append(P2POp("recv", src, v))
        made = makes(s, rank, a)
        if made is not None:
            dst_stage = made.stage + 1 if made.what == "act" else made.stage - 1
            dst = place_of(dst_stage, s.pp)[0]
            if 0 <= dst_stage < s.stages and dst != rank:
                ops.append(P2POp("send", dst, made))
        out.append((a, ops))
    return out


# ----------------------------------------------------------------------------- validation


def _check_structure(s: Schedule) -> None:
    """Every rank runs F once per (mb, chunk), and either B or BI+BW once; nothing else."""
    if s.pp < 1 or s.vpp < 1 or s.microbatches < 1:
        raise ScheduleError(f"need pp, vpp, microbatches >= 1; got {s.pp}, {s.vpp}, {s.microbatches}")
    if len(s.actions) != s.pp:
        raise ScheduleError(f"schedule has {len(s.actions)} action lists for pp={s.pp} ranks")
    for rank, actions in enumerate(s.actions):
        seen: dict[Action, int] = {}
        for i, a in enumerate(actions):
            if a.kind not in KINDS or not 0 <= a.mb < s.microbatches or not 0 <= a.chunk < s.vpp:
                raise ScheduleError(f"rank {rank} action #{i} {a}: kind must be one of {KINDS}, "
                                    f"mb in 0..{s.microbatches - 1}, chunk in 0..{s.vpp - 1}")
            if a in seen:
                raise ScheduleError(f"rank {rank} runs {a} twice (actions #{seen[a]} and #{i})")
            seen[a] = i
        for mb in range(s.microbatches):
            for chunk in range(s.vpp):
                has = {k for k in KINDS if Action(k, mb, chunk) in seen}
                if "F" not in has:
                    raise ScheduleError(f"rank {rank} is missing {Action('F', mb, chunk)}")
                if "B" in has and has & {"BI", "BW"}:
                    raise ScheduleError(f"rank {rank} runs both {Action('B', mb, chunk)} and its halves "
                                        f"BI/BW; use B, or BI and BW")
                if not has & {"B", "BI", "BW"}:
                    raise ScheduleError(f"rank {rank} is missing {Action('B', mb, chunk)} (or BI and BW)")
                lacking = sorted({"BI", "BW"} - has) if "B" not in has else []
                if lacking:
                    raise ScheduleError(f"rank {rank} is missing {Action(lacking[0], mb, chunk)}")


def execution_order(s: Schedule) -> list[tuple[int, Action]]:
    """All (rank, action) pairs in an order where each runs after what it consumes.

    Replays the schedule: each rank runs its list in order and waits until its next action's
    inputs exist. If ranks remain blocked, the schedule deadlocks (or uses a value before it
    exists); ScheduleError then names the blocked action and the chain of waits behind it.
    """
    _check_structure(s)
    done: set[Value] = set()
    pos = [0] * s.pp
    order = []
    runnable = list(range(s.pp))
    waiting: dict[Value, list[int]] = {}  # value -> ranks blocked on it
    while runnable:
        rank = runnable.pop()
        actions = s.actions[rank]
        while pos[rank] < len(actions):
            a = actions[pos[rank]]
            missing = next((v for v in needs(s, rank, a) if v not in done), None)
            if missing is not None:
                waiting.setdefault(missing, []).append(rank)
                break
            made = makes(s, rank, a)
            if made is not None:
                done.add(made)
                runnable += waiting.pop(made, [])
            order.append((rank, a))
            pos[rank] += 1
    blocked = [r for r in range(s.pp) if pos[r] < len(s.actions[r])]
    if blocked:
        raise ScheduleError(_describe_stall(s, pos, done, blocked[0]))
    return order


def _describe_stall(s: Schedule, pos: list[int], done: set[Value], rank: int) -> str:
    """Follow who waits on whom from `rank` until the chain closes, and say so."""
    chain: list[str] = []
    visited = set()
    while rank not in visited:
        visited.add(rank)
        a = s.actions[rank][pos[rank]]
        missing = next(v for v in needs(s, rank, a) if v not in done)
        src = place_of(missing.stage, s.pp)[0]
        if src == rank:
            later = next(i for i, b in enumerate(s.actions[rank]) if makes(s, rank, b) == missing)
            chain.append(f"rank {rank} action #{pos[rank]} {a} uses {missing.what}(stage {missing.stage}, "
                         f"mb {missing.mb}) before it exists: {_producer(s, missing)} only runs later, "
                         f"at #{later}")
            break
        chain.append(f"rank {rank} action #{pos[rank]} {a} waits for {_producer(s, missing)}")
        rank = src
    else:
        chain.append(f"which waits on rank {rank} again")
    return "schedule deadlocks: " + "; ".join(chain)


def validate_schedule(s: Schedule) -> None:
    """Raise ScheduleError naming the offending rank and action if `s` cannot run to completion."""
    execution_order(s)


# ----------------------------------------------------------------------------- generators


def min_microbatches(name: str, pp: int, vpp: int = 1) -> int:
    """The fewest micro-batches `name` supports (ScheduleError for an unknown name or a wrong vpp).

    Interleaved needs a full group of pp micro-batches to pass through each chunk; with fewer,
    rank 0 waits for its own micro-batches to come round from rank pp-1 on every chunk.
    """
    _check_name(name, vpp)
    return pp if name == "interleaved" else 1


def _check_name(name: str, vpp: int) -> None:
    if name not in SCHEDULES:
        raise ScheduleError(f"unknown schedule {name!r}; use one of {SCHEDULES}")
    if name == "interleaved" and vpp < 2:
        raise ScheduleError("schedule 'interleaved' needs vpp >= 2 model chunks per rank")
    if name != "interleaved" and vpp != 1:
        raise ScheduleError(f"schedule {name!r} runs one model chunk per rank; vpp={vpp} needs 'interleaved'")


def build_schedule(name: str, pp: int, microbatches: int, vpp: int = 1) -> Schedule:
    """Generate schedule `name` for pp ranks, `microbatches` micro-batches and vpp chunks per rank."""
    if pp < 1 or microbatches < 1:
        raise ScheduleError(f"need pp >= 1 and microbatches >= 1; got pp={pp}, microbatches={microbatches}")
    need = min_microbatches(name, pp, vpp)
    if microbatches < need:
        raise ScheduleError(f"schedule {name!r} with pp={pp} needs at least {need} micro-batches (one "
                            f"group of pp per chunk), got {microbatches}; use more micro-batches or a smaller pp")
    make = {"gpipe": _gpipe, "1f1b": _one_f_one_b, "zb": _zb_h1, "interleaved": _interleaved}[name]
    s = Schedule(name, pp, microbatches, vpp, [make(r, pp, microbatches, vpp) for r in range(pp)])
    validate_schedule(s)
    return s


def _gpipe(rank: int, pp: int, m: int, vpp: int) -> list[Action]:
    """All forwards, then all backwards: m activations alive at the peak."""
    return [Action("F", i) for i in range(m)] + [Action("B", i) for i in range(m)]


def _one_f_one_b(rank: int, pp: int, m: int, vpp: int) -> list[Action]:
    """PipeDream-flush: pp-1-rank warm-up forwards, then alternate, so at most pp-rank stay alive."""
    warmup = min(pp - 1 - rank, m)
    ops = [Action("F", i) for i in range(warmup)]
    for i in range(m):
        if warmup + i < m:
            ops.append(Action("F", warmup + i))
        ops.append(Action("B", i))
    return ops


def _zb_h1(rank: int, pp: int, m: int, vpp: int) -> list[Action]:
    """ZB-H1 (Qi et al. 2024): 1F1B with B split; rank r holds back its first r weight-grad passes.

    Only BI is on the critical path back to rank 0, so gradients reach the early ranks sooner;
    the deferred BW then fill the cool-down bubble. Peak in-flight stays at most pp, as in 1F1B.
    """
    warmup = min(pp - 1 - rank, m)
    ops = [Action("F", i) for i in range(warmup)]
    for i in range(m):
        if warmup + i < m:
            ops.append(Action("F", warmup + i))
        ops.append(Action("BI", i))
        if i >= rank:
            ops.append(Action("BW", i - rank))
    return ops + [Action("BW", i) for i in range(max(m - rank, 0), m)]


def _interleaved(rank: int, pp: int, m: int, vpp: int) -> list[Action]:
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
    ops = [Action("F", *order[i]) for i in range(warmup)]
    for i in range(total):
        if warmup + i < total:
            ops.append(Action("F", *order[warmup + i]))
        ops.append(Action("B", *back[i]))
    return ops
