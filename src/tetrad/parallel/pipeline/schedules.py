"""Pipeline schedules as data: for each pipeline rank, the ordered list of compute actions it runs.

One representation, three readers (docs/design.md, "Pipeline: schedules are data"): the executor runs
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
    forward_only: bool = False  # an evaluation's: forwards, no backward

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
    (1) not wait on a send before computing its next action (complete sends lazily) and (2) post
    each link's transfers in `link_order` at both ends (NCCL matches them in that order; gloo by
    `P2POp.tag`, which the executor also sets).
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


def link_order(s: Schedule) -> dict[tuple[int, int], list[Value]]:
    """For each pair of pipeline ranks that exchange values, every value crossing between them
    (both directions) in one order, the order both ends post their transfers in.

    NCCL matches point-to-point transfers between two ranks by posting order, not by tag, and
    runs them in that order: the two ends must agree on it, or they wait on each other. The order
    is the one the values are made in when the schedule is replayed with unit costs (ties by
    value). It can always be followed: a rank that needs the k-th value of a link for its next
    action has already made each of its own sends that come before it, since those were made
    earlier in the replay, hence by earlier actions of its list.
    """
    stages = s.stages
    _, ends, _ = replay(s, {"F": [1] * stages, "B": [2] * stages, "BI": [1] * stages, "BW": [1] * stages})
    made = []
    for rank in range(s.pp):
        for (_, ops), end in zip(p2p_ops(s, rank), ends[rank]):
            made += [(end, op.value, min(rank, op.peer), max(rank, op.peer)) for op in ops if op.op == "send"]
    links: dict[tuple[int, int], list[Value]] = {}
    for _, value, a, b in sorted(made):
        links.setdefault((a, b), []).append(value)
    return links


# ----------------------------------------------------------------------------- replay and validation


def replay(s: Schedule, cost: dict[str, list] | None = None, p2p: float = 0) -> tuple[list, list, list]:
    """Run `s` as the ranks would: each in list order, an action once its inputs exist.

    `cost[kind][stage]` gives durations (all 0 when None); an input from another rank arrives
    `p2p` after it is made. Returns (starts, ends, busy): per rank, the start and end of each of
    its actions in list order, and its total compute time. The validator and the simulator share
    this loop, so it is written for speed: a value is a slot in a flat list (stage * m + mb)
    holding when it exists, and results are plain numbers, which the garbage collector skips.
    Any failure (a stall, a value made twice or never) raises ScheduleError naming the action.
    """
    pp, m, vpp, stages = s.pp, s.microbatches, s.vpp, s.stages
    if len(s.actions) != pp or min(pp, m, vpp) < 1:
        _check_structure(s)
    n = stages * m
    act: list = [None] * n  # when F's output at (stage, mb) exists
    grad: list = [None] * n  # when the gradient w.r.t. (stage, mb)'s input exists
    weight = bytearray(n)  # whether (stage, mb)'s weight gradient is done (by B or BW)
    zero = [0] * stages
    c_f, c_b, c_bi, c_bw = (cost["F"], cost["B"], cost["BI"], cost["BW"]) if cost else (zero,) * 4
    lat = p2p if pp > 1 else 0  # neighbouring stages sit on different ranks whenever pp > 1
    busy, pos = [0] * pp, [0] * pp
    starts: list[list] = [[] for _ in range(pp)]
    ends: list[list] = [[] for _ in range(pp)]
    waiting: dict[int, list[int]] = {}  # slot (j for act, n + j for grad) -> ranks blocked on it
    runnable, broken = list(range(pp)), False
    while runnable and not broken:
        rank = runnable.pop()
        actions, i, work = s.actions[rank], pos[rank], busy[rank]
        started, ended = starts[rank], ends[rank]
        t = ended[-1] if ended else 0
        while i < len(actions):
            a = actions[i]
            kind, mb, chunk = a.kind, a.mb, a.chunk
            if not (0 <= mb < m and 0 <= chunk < vpp):
                broken = True
                break
            g = chunk * pp + rank
            j = g * m + mb
            start = t
            # A value made on this rank (B's own activation, BW's gradient) was made before t, so
            # only its existence is checked; a neighbour's value also sets the start.
            if kind == "F":
                if act[j] is not None:
                    broken = True
                    break
                if g:
                    ready = act[j - m]
                    if ready is None:
                        waiting.setdefault(j - m, []).append(rank)
                        break
                    if ready + lat > start:
                        start = ready + lat
                t = act[j] = start + c_f[g]
                made = j
            elif kind == "B" or kind == "BI":
                if grad[j] is not None or (kind == "B" and weight[j]):
                    broken = True
                    break
                if act[j] is None:
                    waiting.setdefault(j, []).append(rank)
                    break
                if g < stages - 1:
                    ready = grad[j + m]
                    if ready is None:
                        waiting.setdefault(n + j + m, []).append(rank)
                        break
                    if ready + lat > start:
                        start = ready + lat
                if kind == "B":
                    t = grad[j] = start + c_b[g]
                    weight[j] = 1
                else:
                    t = grad[j] = start + c_bi[g]
                made = n + j
            elif kind == "BW":
                if weight[j]:
                    broken = True
                    break
                if grad[j] is None:
                    waiting.setdefault(n + j, []).append(rank)
                    break
                t = start + c_bw[g]
                weight[j] = 1
                made = -1  # no slot: nothing waits on a weight gradient
            else:
                broken = True
                break
            if made in waiting:
                runnable += waiting.pop(made)
            started.append(start)
            ended.append(t)
            work += t - start
            i += 1
        pos[rank], busy[rank] = i, work
    backward_missing = not s.forward_only and (None in grad or 0 in weight)
    if broken or any(pos[r] < len(s.actions[r]) for r in range(pp)) or None in act or backward_missing:
        _check_structure(s)  # names a missing, duplicated or malformed action if there is one
        raise ScheduleError(_describe_stall(s, pos, act, grad))
    return starts, ends, busy


def _check_structure(s: Schedule) -> None:
    """Every rank runs F once per (mb, chunk), and either B or BI+BW once (neither in a forward-only
    schedule); nothing else.

    Only called once replay has failed, to name the action at fault; not written for speed.
    """
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
                if s.forward_only:
                    continue
                if not has & {"B", "BI", "BW"}:
                    raise ScheduleError(f"rank {rank} is missing {Action('B', mb, chunk)} (or BI and BW)")
                lacking = sorted({"BI", "BW"} - has) if "B" not in has else []
                if lacking:
                    raise ScheduleError(f"rank {rank} is missing {Action(lacking[0], mb, chunk)}")


def _describe_stall(s: Schedule, pos: list[int], act: list, grad: list) -> str:
    """Follow who waits on whom from the first blocked rank until the chain closes, and say so."""
    def exists(v: Value) -> bool:
        return (act if v.what == "act" else grad)[v.stage * s.microbatches + v.mb] is not None

    rank = next(r for r in range(s.pp) if pos[r] < len(s.actions[r]))
    chain: list[str] = []
    visited = set()
    while rank not in visited:
        visited.add(rank)
        a = s.actions[rank][pos[rank]]
        missing = next(v for v in needs(s, rank, a) if not exists(v))
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


def forward_only(s: Schedule) -> Schedule:
    """`s` without its backward actions: the forwards of an evaluation (no gradients), in the order
    `s` runs them. A forward never waits on a backward, so they cannot stall where `s` does not."""
    s = Schedule(s.name, s.pp, s.microbatches, s.vpp, [[a for a in r if a.kind == "F"] for r in s.actions],
                 forward_only=True)
    validate_schedule(s)
    return s


def validate_schedule(s: Schedule) -> None:
    """Raise ScheduleError naming the offending rank and action if `s` cannot run to completion."""
    replay(s)
