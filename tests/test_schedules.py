"""Pipeline schedules, validator, simulator and timeline renderer: pure Python, no processes."""

from __future__ import annotations

from collections import Counter
from fractions import Fraction

import pytest

from tetrad.parallel.pipeline.registry import SCHEDULES, build_schedule, min_microbatches
from tetrad.parallel.pipeline.schedules import (Action, Schedule, ScheduleError, Value, link_order, needs, p2p_ops,
                                                stage_of, validate_schedule)
from tetrad.parallel.pipeline.simulate import StageCosts, simulate
from tetrad.viz.timeline import render_timeline, schedule_command

def F(mb, chunk=0):
    return Action("F", mb, chunk)


def B(mb, chunk=0):
    return Action("B", mb, chunk)


def BI(mb, chunk=0):
    return Action("BI", mb, chunk)


def BW(mb, chunk=0):
    return Action("BW", mb, chunk)


def exact(f, bi, bw, p2p=0):
    """Fraction costs, so the simulator's arithmetic is exact."""
    return StageCosts(Fraction(f), Fraction(bi), Fraction(bw), Fraction(p2p))


def shapes():
    """Every (name, pp, m, vpp) the generators must handle: p in 1..8, m from the minimum up."""
    for name in SCHEDULES:
        for pp in range(1, 9):
            for vpp in ((2, 3) if name == "interleaved" else (1,)):
                lo = min_microbatches(name, pp, vpp)
                for m in sorted({lo, lo + 1, pp, pp + 1, 2 * pp, 2 * pp + 3} - {0}):
                    if m >= lo:
                        yield name, pp, m, vpp


# ----------------------------------------------------------------------------- closed forms


@pytest.mark.parametrize("name", ["gpipe", "1f1b"])
@pytest.mark.parametrize("pp,m", [(1, 1), (1, 4), (2, 1), (2, 2), (2, 5), (4, 3), (4, 8), (5, 7), (8, 16)])
@pytest.mark.parametrize("f,b", [(1, 1), (1, 2), (3, 5)])
def test_gpipe_and_1f1b_bubble_closed_form(name, pp, m, f, b):
    r = simulate(build_schedule(name, pp, m), exact(f, b - Fraction(b, 3), Fraction(b, 3)))
    assert r.bubble_fraction == Fraction(pp - 1, m + pp - 1)
    assert r.step_time == (m + pp - 1) * (f + b)


@pytest.mark.parametrize("pp,m,vpp", [(1, 1, 2), (2, 2, 2), (2, 4, 3), (4, 4, 2), (4, 8, 2), (4, 8, 4),
                                      (3, 9, 3), (8, 16, 2), (4, 6, 2), (4, 7, 3), (3, 5, 2), (8, 13, 2)])
@pytest.mark.parametrize("f,b", [(1, 1), (1, 2), (2, 3)])
def test_interleaved_bubble_closed_form(pp, m, vpp, f, b):
    """(p-1)/(v*m+p-1) exactly, including m not a multiple of p (the last group takes the rest)."""
    r = simulate(build_schedule("interleaved", pp, m, vpp), exact(f, b, 0))
    assert r.bubble_fraction == Fraction(pp - 1, vpp * m + pp - 1)


def test_float_costs_match_closed_form_within_tolerance():
    r = simulate(build_schedule("interleaved", 4, 12, 3), StageCosts(0.1, 0.13, 0.07))
    assert abs(r.bubble_fraction - 3 / (3 * 12 + 3)) < 1e-12


@pytest.mark.parametrize("pp,m", [(2, 2), (4, 4), (4, 8), (6, 9), (8, 16)])
@pytest.mark.parametrize("f,bi,bw", [(1, 1, 1), (2, 1, 1), (1, 2, 1), (3, 2, 1)])
def test_zb_h1_step_time_is_the_papers(pp, m, f, bi, bw):
    """Qi et al.: ZB-H1's bubble is (p-1)(F+BI-BW) where 1F1B's is (p-1)(F+BI+BW)."""
    r = simulate(build_schedule("zb", pp, m), exact(f, bi, bw))
    assert r.step_time == m * (f + bi + bw) + (pp - 1) * (f + bi - bw)


@pytest.mark.parametrize("pp", [2, 3, 4, 8])
@pytest.mark.parametrize("m", [1, 2, 5, 16])
@pytest.mark.parametrize("f,bi,bw,p2p", [(1, 1, 1, 0), (1, 1, 2, 0), (2, 1, 0.5, 0), (1, 1, 1, 0.3)])
def test_zb_bubble_strictly_below_1f1b(pp, m, f, bi, bw, p2p):
    costs = StageCosts(f, bi, bw, p2p)
    zb, one = simulate(build_schedule("zb", pp, m), costs), simulate(build_schedule("1f1b", pp, m), costs)
    assert zb.bubble_fraction < one.bubble_fraction
    assert zb.step_time < one.step_time


def test_p2p_latency_adds_two_hops_per_stage_boundary_to_gpipe():
    for pp, m in [(2, 3), (4, 8)]:
        r = simulate(build_schedule("gpipe", pp, m), exact(2, 1, 1, p2p=Fraction(1, 4)))
        assert r.step_time == (m + pp - 1) * 4 + 2 * (pp - 1) * Fraction(1, 4)


def test_p1_has_no_bubble():
    for name, vpp in [("gpipe", 1), ("1f1b", 1), ("zb", 1), ("interleaved", 2), ("interleaved", 3)]:
        s = build_schedule(name, 1, 3, vpp)
        r = simulate(s, exact(1, 2, 1))
        assert r.bubble_fraction == 0 and r.step_time == 3 * 4 * vpp
        assert all(ops == [] for _, ops in p2p_ops(s, 0))  # chunk-to-chunk hand-offs stay local


# ----------------------------------------------------------------------------- memory


@pytest.mark.parametrize("pp,m", [(1, 3), (4, 2), (4, 8), (8, 5), (8, 16)])
def test_peak_inflight(pp, m):
    costs = StageCosts(1, 1, 1)
    assert simulate(build_schedule("1f1b", pp, m), costs).peak_inflight == [min(pp - r, m) for r in range(pp)]
    assert simulate(build_schedule("gpipe", pp, m), costs).peak_inflight == [m] * pp
    # ZB-H1 matches 1F1B's worst rank on every rank: activations live until BW, and rank r
    # defers its first r BW while running r more forwards than 1F1B would have alive.
    assert simulate(build_schedule("zb", pp, m), costs).peak_inflight == [min(pp, m)] * pp


@pytest.mark.parametrize("pp,m,vpp", [(4, 4, 2), (4, 8, 2), (4, 9, 3), (8, 16, 2)])
def test_interleaved_peak_inflight_is_its_warmup_plus_one(pp, m, vpp):
    peaks = simulate(build_schedule("interleaved", pp, m, vpp), StageCosts(1, 1, 1)).peak_inflight
    warmup = [2 * (pp - 1 - r) + (vpp - 1) * (pp + m % pp) for r in range(pp)]
    assert peaks == [min(w + 1, vpp * m) for w in warmup]


# ----------------------------------------------------------------------------- generators


@pytest.mark.parametrize("name,pp,m,vpp", list(shapes()))
def test_every_generated_schedule_validates_and_is_complete(name, pp, m, vpp):
    s = build_schedule(name, pp, m, vpp)
    validate_schedule(s)
    halves = ("BI", "BW") if name == "zb" else ("B",)
    for actions in s.actions:
        assert sorted(actions, key=str) == sorted([Action(k, mb, c) for k in ("F",) + halves
                                                   for mb in range(m) for c in range(vpp)], key=str)
    sends = Counter((r, op.peer, op.value) for r in range(pp) for _, ops in p2p_ops(s, r) for op in ops
                    if op.op == "send")
    recvs = Counter((op.peer, r, op.value) for r in range(pp) for _, ops in p2p_ops(s, r) for op in ops
                    if op.op == "recv")
    assert sends == recvs  # every receive has exactly one matching send
    assert len({op.tag(m) for r in range(pp) for _, ops in p2p_ops(s, r) for op in ops
                if op.op == "send"}) == sum(sends.values())


def run_in_posting_order(s: Schedule) -> None:
    """Run `s` as the executor posts its transfers (executor._Transfers), under NCCL's rules: on
    each link the k-th transfer posted at one end matches the k-th at the other, and transfers
    complete in posting order. A rank posts its links' transfers in `link_order` as far as its
    values exist, and waits for a received value before the action that uses it; sends never
    block it. Raises AssertionError if the ranks wait on each other forever or a match pairs
    two different values or two sends."""
    links = link_order(s)
    plans = [p2p_ops(s, r) for r in range(s.pp)]
    posted = {(r, link): 0 for link in links for r in link}  # how many of the link's transfers r posted
    made = [set() for _ in range(s.pp)]
    pos = [0] * s.pp

    def pump(r):
        for link, values in links.items():
            if r in link:
                while posted[(r, link)] < len(values):
                    v = values[posted[(r, link)]]
                    if v.stage % s.pp == r and v not in made[r]:  # r makes v (F or B at v.stage): a send
                        break
                    posted[(r, link)] += 1

    for r in range(s.pp):
        pump(r)
    progress = True
    while progress:
        progress = False
        for r in range(s.pp):
            while pos[r] < len(plans[r]):
                _, ops = plans[r][pos[r]]
                ready = True
                for op in ops:
                    if op.op == "recv":
                        link = (min(r, op.peer), max(r, op.peer))
                        k = links[link].index(op.value)
                        # Complete once both ends have posted it (and so everything before it).
                        ready &= posted[(r, link)] > k and posted[(op.peer, link)] > k
                if not ready:
                    break
                made[r].update(op.value for op in ops if op.op == "send")
                pos[r] += 1
                pump(r)
                progress = True
    assert pos == [len(p) for p in plans], f"ranks stuck at actions {pos} of {[len(p) for p in plans]}"


@pytest.mark.parametrize("name,pp,m,vpp", list(shapes()))
def test_link_order_cannot_hang_under_in_order_matching(name, pp, m, vpp):
    s = build_schedule(name, pp, m, vpp)
    links = link_order(s)
    crossing = Counter((min(r, op.peer), max(r, op.peer), op.value) for r in range(pp) for _, ops in p2p_ops(s, r)
                       for op in ops if op.op == "send")
    assert Counter((a, b, v) for (a, b), values in links.items() for v in values) == crossing
    run_in_posting_order(s)


def test_build_rejects_bad_shapes():
    with pytest.raises(ScheduleError, match="unknown schedule"):
        build_schedule("pipedream", 2, 4)
    with pytest.raises(ScheduleError, match="needs vpp >= 2"):
        build_schedule("interleaved", 2, 4, 1)
    with pytest.raises(ScheduleError, match="vpp=2 needs 'interleaved'"):
        build_schedule("1f1b", 2, 4, 2)
    with pytest.raises(ScheduleError, match="needs at least 4 micro-batches"):
        build_schedule("interleaved", 4, 3, 2)
    with pytest.raises(ScheduleError, match="microbatches >= 1"):
        build_schedule("gpipe", 2, 0)
    assert [min_microbatches(n, 4, 2 if n == "interleaved" else 1) for n in SCHEDULES] == [1, 1, 4, 1]


def test_stage_placement_is_megatron_interleaved():
    assert [stage_of(r, c, 4) for c in range(2) for r in range(4)] == list(range(8))
    s = build_schedule("interleaved", 2, 2, 2)
    # chunk 0 of rank 1 (stage 1) feeds chunk 1 of rank 0 (stage 2)
    assert needs(s, 0, F(0, 1)) == [Value("act", 1, 0)]


def test_p2p_ops_for_two_stage_1f1b():
    s = build_schedule("1f1b", 2, 1)
    assert [(a, [(o.op, o.peer, o.value.what) for o in ops]) for a, ops in p2p_ops(s, 0)] == [
        (F(0), [("send", 1, "act")]), (B(0), [("recv", 1, "grad")])]
    assert [(a, [(o.op, o.peer, o.value.what) for o in ops]) for a, ops in p2p_ops(s, 1)] == [
        (F(0), [("recv", 0, "act")]), (B(0), [("send", 0, "grad")])]


# ----------------------------------------------------------------------------- validator


def test_validator_names_a_cross_rank_deadlock():
    # rank 0 waits for rank 1's backward of mb 0; rank 1 first wants mb 1, which rank 0 sends after it.
    s = Schedule("bad", 2, 2, 1, [[F(0), B(0), F(1), B(1)], [F(1), B(1), F(0), B(0)]])
    with pytest.raises(ScheduleError) as e:
        validate_schedule(s)
    msg = str(e.value)
    assert "deadlocks" in msg
    assert "rank 0 action #1 B(mb=0, chunk=0) waits for B/BI(mb=0, chunk=0) on rank 1" in msg
    assert "rank 1 action #0 F(mb=1, chunk=0) waits for F(mb=1, chunk=0) on rank 0" in msg
    assert msg.endswith("which waits on rank 0 again")


def test_validator_names_use_before_produce():
    s = Schedule("bad", 2, 1, 1, [[F(0), B(0)], [B(0), F(0)]])
    with pytest.raises(ScheduleError, match=r"rank 1 action #0 B\(mb=0, chunk=0\) uses act\(stage 1, mb 0\) "
                                            r"before it exists: F\(mb=0, chunk=0\) on rank 1 only runs later, at #1"):
        validate_schedule(s)
    s = Schedule("bad", 1, 1, 1, [[F(0), BW(0), BI(0)]])
    with pytest.raises(ScheduleError, match=r"rank 0 action #1 BW\(mb=0, chunk=0\) uses grad"):
        validate_schedule(s)


@pytest.mark.parametrize("actions,match", [
    ([[F(0), F(1), B(0), B(1)], [F(0), F(1), B(0)]], r"rank 1 is missing B\(mb=1, chunk=0\) \(or BI and BW\)"),
    ([[F(0), F(1), B(0), B(1)], [F(0), B(0), B(1)]], r"rank 1 is missing F\(mb=1, chunk=0\)"),
    ([[F(0), F(1), B(0), B(1), B(1)], [F(0), F(1), B(0), B(1)]], r"rank 0 runs B\(mb=1, chunk=0\) twice"),
    ([[F(0), F(1), B(0), BI(1)], [F(0), F(1), B(0), B(1)]], r"rank 0 is missing BW\(mb=1, chunk=0\)"),
    ([[F(0), F(1), B(0), B(1), BW(1)], [F(0), F(1), B(0), B(1)]], r"rank 0 runs both B\(mb=1"),
    ([[F(0), F(1), F(2), B(0), B(1)], [F(0), F(1), B(0), B(1)]], r"rank 0 action #2 F\(mb=2, chunk=0\)"),
    ([[F(0), F(1), B(0), B(1)]], r"1 action lists for pp=2"),
])
def test_validator_rejects_malformed_schedules(actions, match):
    with pytest.raises(ScheduleError, match=match):
        validate_schedule(Schedule("bad", 2, 2, 1, actions))


def test_simulate_refuses_an_invalid_schedule():
    with pytest.raises(ScheduleError, match="deadlocks"):
        simulate(Schedule("bad", 2, 1, 1, [[B(0), F(0)], [F(0), B(0)]]), StageCosts(1, 1, 1))


# ----------------------------------------------------------------------------- simulator


def test_timeline_respects_order_dependencies_and_per_stage_costs():
    forward, bi, bw = [1, 2, 3, 4, 5, 6], [2, 2, 1, 1, 3, 3], [1, 0, 1, 0, 1, 0]
    s = build_schedule("interleaved", 3, 4, 2)
    r = simulate(s, StageCosts(forward, bi, bw, p2p=0.5))
    ends = {}
    for rank in range(3):
        rows = [row for row in r.timeline if row[0] == rank]
        assert [a for _, a, _, _ in rows] == s.actions[rank]
        assert all(prev[3] <= nxt[2] for prev, nxt in zip(rows, rows[1:]))  # one action at a time
        for _, a, start, end in rows:
            g = stage_of(rank, a.chunk, 3)
            assert end - start == (forward[g] if a.kind == "F" else bi[g] + bw[g])
            ends[(a.kind, g, a.mb)] = end
    for rank, a, start, _ in r.timeline:
        g = stage_of(rank, a.chunk, 3)
        if a.kind == "F" and g > 0:
            assert start >= ends[("F", g - 1, a.mb)] + 0.5
        if a.kind == "B" and g < 5:
            assert start >= ends[("B", g + 1, a.mb)] + 0.5
    assert r.step_time == max(end for *_, end in r.timeline)
    assert r.busy == [sum(e - s_ for rk, _, s_, e in r.timeline if rk == rank) for rank in range(3)]


def test_single_microbatch_gpipe_is_the_sum_of_stage_costs():
    r = simulate(build_schedule("gpipe", 3, 1), StageCosts([1, 2, 3], [4, 5, 6], [1, 1, 1], p2p=10))
    assert r.step_time == (1 + 2 + 3) + (5 + 6 + 7) + 4 * 10


def test_step_time_is_when_the_last_rank_finishes():
    # ZB-H1 at pp=2, m=1: rank 1 defers its BW to the end, and here it is the costly one.
    r = simulate(build_schedule("zb", 2, 1), StageCosts([1, 1], [1, 1], [0, 10]))
    assert r.step_time == 13 and r.busy == [2, 12]


def test_planner_scale_without_timeline():
    """pp=64, m=512: integer costs keep the closed form exact; timeline=False skips the rows."""
    s = build_schedule("1f1b", 64, 512)
    full, bare = simulate(s, StageCosts(1, 1, 1)), simulate(s, StageCosts(1, 1, 1), timeline=False)
    assert full.step_time == bare.step_time == (512 + 63) * 3
    assert len(full.timeline) == 64 * 1024 and bare.timeline == []
    assert bare.peak_inflight == full.peak_inflight and bare.busy == full.busy == [1536] * 64


def test_cost_list_of_wrong_length_is_rejected():
    with pytest.raises(ScheduleError, match="3 F costs given for 4 pipeline stages"):
        simulate(build_schedule("interleaved", 2, 2, 2), StageCosts([1, 1, 1], 1, 1))


# ----------------------------------------------------------------------------- renderer and command


def test_render_png_and_svg(tmp_path):
    r = simulate(build_schedule("interleaved", 4, 8, 2), StageCosts(1, 1, 1))
    render_timeline(r, tmp_path / "t.png", title="interleaved")
    assert (tmp_path / "t.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    # a measured timeline is the same tuples, possibly not starting at zero and with idle ranks
    measured = [(rank, a, start + 100.0, end + 100.0) for rank, a, start, end in r.timeline if rank < 2]
    render_timeline(measured, tmp_path / "m.svg", pp=4)
    assert b"<svg" in (tmp_path / "m.svg").read_bytes()[:500]
    with pytest.raises(ValueError, match="png or .svg"):
        render_timeline(r, tmp_path / "t.jpg")


def test_schedule_command(tmp_path, capsys):
    out = tmp_path / "x.png"
    assert schedule_command(["--pp", "4", "--microbatches", "8", "--schedule", "interleaved", "--vpp", "2",
                             "--out", str(out)]) == 0
    text = capsys.readouterr().out
    assert "bubble 15.79%" in text and "[11, 9, 7, 5]" in text and out.stat().st_size > 0
    assert "step time 28.5 s" in text  # --costs are per rank, split over its 2 chunks
    assert schedule_command(["--pp", "4", "--microbatches", "8", "--schedule", "zb", "--costs", "1,1,1"]) == 0
    assert "step time 27 s" in capsys.readouterr().out
    assert schedule_command(["--pp", "4", "--microbatches", "2", "--schedule", "interleaved"]) == 2
    assert "needs at least 4 micro-batches" in capsys.readouterr().err
