"""Gantt chart of a pipeline step (simulated or measured) and the `tetrad schedule` command.

A timeline is a list of (rank, Action, start, end); the simulator returns one and the trainer can
record one, so both are drawn the same way: ranks as rows, time across, one box per action,
coloured by kind, lighter for later model chunks, with the micro-batch number inside.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from tetrad.config.arguments import non_negative
from tetrad.parallel.pipeline.registry import SCHEDULES, build_schedule, schedule_spec
from tetrad.parallel.pipeline.schedules import Action, ScheduleError
from tetrad.parallel.pipeline.simulate import SimResult, StageCosts, simulate

COLOURS = {"F": "#3b6fb6", "B": "#c8463c", "BI": "#e08a2c", "BW": "#4f9a55"}
NAMES = {"F": "forward", "B": "backward", "BI": "backward (input)", "BW": "backward (weight)"}
FORMATS = (".png", ".svg")


def _whiteness(chunk: int, chunks: int) -> float:
    """How far chunk's shade is mixed towards white: chunk 0 full colour, the last about half."""
    return 0.55 * chunk / max(chunks - 1, 1)


def _shade(colour: str, chunk: int, chunks: int) -> tuple[float, ...]:
    rgb = [int(colour[i:i + 2], 16) / 255 for i in (1, 3, 5)]
    return tuple(c + (1 - c) * _whiteness(chunk, chunks) for c in rgb)


def render_timeline(timeline: SimResult | list[tuple[int, Action, float, float]], path: str | Path,
                    title: str = "pipeline schedule", pp: int | None = None, span: float | None = None) -> None:
    """Draw `timeline` to `path` (.png or .svg). `pp` fixes the number of rows (default: ranks
    seen); `span` the length of the time axis (default: the timeline's), so that two timelines
    drawn with one span compare by eye."""
    try:
        from matplotlib.backends.backend_agg import FigureCanvasAgg
        from matplotlib.figure import Figure
        from matplotlib.patches import Patch
    except ImportError as e:
        raise ImportError("drawing a timeline needs matplotlib: pip install 'tetrad[report]'") from e

    path = Path(path)
    if path.suffix.lower() not in FORMATS:
        raise ValueError(f"cannot draw {path.name}: use a file name ending in {' or '.join(FORMATS)}")
    rows = timeline.timeline if isinstance(timeline, SimResult) else list(timeline)
    if not rows:
        raise ValueError("nothing to draw: the timeline is empty")
    ranks = pp or max(r for r, *_ in rows) + 1
    chunks = max(a.chunk for _, a, _, _ in rows) + 1
    t0 = min(start for *_, start, _ in rows)
    span = span or max(end for *_, end in rows) - t0 or 1  # all-zero costs still draw
    per_rank = max(sum(1 for r, *_ in rows if r == rank) for rank in range(ranks))

    width = min(max(4 + 0.22 * per_rank, 8), 40)
    fig = Figure(figsize=(width, 1.4 + 0.45 * ranks), layout="constrained")
    FigureCanvasAgg(fig)
    ax = fig.add_subplot()
    box_points = fig.get_figwidth() * 72 * 0.9 / span  # points per unit of time, roughly
    for rank, a, start, end in rows:
        colour = _shade(COLOURS[a.kind], a.chunk, chunks)
        ax.broken_barh([(start - t0, end - start)], (rank - 0.4, 0.8), facecolors=colour,
                       edgecolors="white", linewidth=0.6)
        label = str(a.mb)
        fontsize = min(8.0, 0.8 * (end - start) * box_points / len(label))
        if fontsize >= 4:
            ink = "black" if _whiteness(a.chunk, chunks) > 0.3 else "white"
            ax.text((start + end) / 2 - t0, rank, label, ha="center", va="center", fontsize=fontsize,
                    color=ink)

    ax.set_ylim(ranks - 0.5, -0.5)
    ax.set_yticks(range(ranks), [f"rank {r}" for r in range(ranks)])
    ax.set_xlim(0, span)
    ax.set_xlabel("time (s)")
    ax.set_title(title)
    ax.spines[["top", "right"]].set_visible(False)
    kinds = [k for k in COLOURS if any(a.kind == k for _, a, _, _ in rows)]
    handles = [Patch(facecolor=_shade(COLOURS[k], c, chunks),
                     label=NAMES[k] if chunks == 1 else f"{k} chunk {c}")
               for k in kinds for c in range(chunks)]
    ax.legend(handles=handles, loc="upper left", bbox_to_anchor=(1.0, 1.0), frameon=False, fontsize=8)
    fig.savefig(path, dpi=150)


def _costs(text: str) -> tuple[float, float, float]:
    parts = text.split(",")
    try:
        values = tuple(float(x) for x in parts)
    except ValueError:
        values = ()
    if len(values) != 3 or min(values) < 0:
        raise argparse.ArgumentTypeError(f"expected three costs F,BI,BW >= 0 (e.g. 1,1,1), got {text!r}")
    return values


def schedule_command(args: list[str]) -> int:
    """`tetrad schedule`: build a schedule, simulate it, print the numbers, optionally draw it."""
    parser = argparse.ArgumentParser(
        prog="tetrad schedule",
        description="Simulate a pipeline schedule: step time, bubble fraction, peak in-flight activations.")
    parser.add_argument("--pp", type=int, default=4, help="pipeline ranks (default 4)")
    parser.add_argument("--microbatches", type=int, default=8, help="micro-batches per step (default 8)")
    parser.add_argument("--schedule", choices=list(SCHEDULES), default="1f1b")
    parser.add_argument("--vpp", type=int, default=None,
                        help="model chunks per rank (default 2 for interleaving schedules, else 1)")
    parser.add_argument("--costs", type=_costs, default=(1.0, 1.0, 1.0), metavar="F,BI,BW",
                        help="seconds per micro-batch for one rank's share of the model, split evenly "
                             "over its vpp chunks: forward, backward-input, backward-weight (a full "
                             "backward costs BI+BW; default 1,1,1)")
    parser.add_argument("--p2p", type=non_negative, default=0.0, help="latency of one transfer between ranks (s)")
    parser.add_argument("--out", help="write the Gantt chart here (.png or .svg)")
    opts = parser.parse_args(args)
    vpp = opts.vpp or schedule_spec(opts.schedule).default_vpp()
    try:
        s = build_schedule(opts.schedule, opts.pp, opts.microbatches, vpp)
        result = simulate(s, StageCosts(*(c / vpp for c in opts.costs), p2p=opts.p2p))
    except ScheduleError as e:
        print(f"tetrad schedule: {e}", file=sys.stderr)
        return 2
    f, bi, bw = opts.costs
    print(f"{s.name}: pp={s.pp} microbatches={s.microbatches} vpp={s.vpp}; costs F={f:g} BI={bi:g} "
          f"BW={bw:g} p2p={opts.p2p:g}")
    print(f"step time {result.step_time:g} s, bubble {result.bubble_fraction:.2%}, "
          f"peak in-flight per rank {result.peak_inflight}")
    if opts.out:
        title = (f"{s.name}  pp={s.pp} m={s.microbatches}" + (f" vpp={s.vpp}" if s.vpp > 1 else "")
                 + f"  bubble {result.bubble_fraction:.1%}")
        try:
            render_timeline(result, opts.out, title=title, pp=s.pp)
        except ValueError as e:
            print(f"tetrad schedule: {e}", file=sys.stderr)
            return 2
        print(f"wrote {opts.out}")
    return 0
