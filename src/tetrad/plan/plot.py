"""`tetrad plan --plot`: step time against memory per GPU of the layouts the search looked at.

The layouts that fit take the main panel, at a scale that separates them: estimated ones solid,
those pruned by their lower bound faint (their time is at least that), the best few labelled.
Those that do not fit are counted in a narrow panel beside it, on their own memory scale, so
that a 900 GiB candidate does not squeeze the ones that fit into a corner. Plain tick labels.
"""

from __future__ import annotations

from tetrad.plan.hardware import Cluster
from tetrad.plan.search import Plan

LABELLED = 3  # the best layouts named on the plot
TIME_RANGE = 2.0  # the main panel shows up to this many times the best step time


def short_label(cfg) -> str:
    p, t = cfg.parallel, cfg.train
    parts = [f"tp{p.tp}", f"pp{p.pp}" + (f"x{p.vpp}" if p.vpp > 1 else ""),
             f"cp{p.cp}" + ("/a2a" if p.cp > 1 and p.cp_algo == "alltoall" else ""), f"dp{p.dp}",
             f"z{p.zero}", f"mb{t.micro_batch}"]
    if t.recompute != "none":
        parts.append(t.recompute)
    if p.pp > 1:
        parts.append(p.schedule)
    return " ".join(parts)


def plan_figure(result: Plan, cluster: Cluster, title: str):
    """The figure (matplotlib's object-oriented API, no global state), for `savefig`."""
    from matplotlib.figure import Figure
    from matplotlib.ticker import FuncFormatter

    usable = result.ranked[0].usable_gib if result.ranked else cluster.gpu.hbm_gib
    best = [e for e in result.ranked if e.fits][:LABELLED]
    top = TIME_RANGE * (best[0].step_time_s if best else min((t for _, t, _ in result.points), default=1.0))
    fitting = [(m, t, exact) for m, t, exact in result.points if m <= usable]
    over = [(m, t) for m, t, _ in result.points if m > usable]
    fig = Figure(figsize=(9, 5.2), layout="constrained")
    main, side = fig.subplots(1, 2, sharey=True, gridspec_kw={"width_ratios": [4, 1]})
    _draw_fitting(main, fitting, best, top, usable)
    shown = _draw_out_of_memory(side, over, top, usable)
    plain = FuncFormatter(lambda v, _: f"{v:g}")
    for ax in (main, side):
        ax.xaxis.set_major_formatter(plain)
        ax.yaxis.set_major_formatter(plain)
        ax.spines[["top", "right"]].set_visible(False)
        ax.grid(alpha=0.3)
    times = [t for _, t, _ in fitting if t <= top] + [t for _, t in shown]
    if times:  # the spread of the candidates, not from zero: they differ by percents
        lo, hi = min(times), max(times)
        pad = 0.08 * (hi - lo or hi)
        main.set_ylim(lo - 2.5 * pad, hi + pad)
    fig.suptitle(title, fontsize=11)
    return fig


def _draw_fitting(ax, fitting: list, best: list, top: float, usable: float) -> None:
    """The layouts that fit, up to `top` seconds; the best ones marked and named."""
    for exact, style in ((False, dict(s=10, c="#c8c8c8", label="pruned: at least this slow")),
                         (True, dict(s=22, c="#1f77b4", label="estimated"))):
        pts = [(m, t) for m, t, x in fitting if x == exact and t <= top]
        if pts:
            ax.scatter(*zip(*pts), zorder=2, **style)
    for rank, e in enumerate(best):
        ax.scatter([e.peak_memory_gib], [e.step_time_s], s=140 if rank == 0 else 60, marker="*" if rank == 0 else "D",
                   c="#d62728", zorder=3, label="best" if rank == 0 else None)
        ax.annotate(f"{rank + 1}. {short_label(e.cfg)}  {e.step_time_s:.3g} s", (e.peak_memory_gib, e.step_time_s),
                    xytext=(-14, -16 - 14 * rank), textcoords="offset points", ha="right", va="top", fontsize=8,
                    bbox=dict(boxstyle="round,pad=0.2", fc="white", ec="#cccccc", alpha=0.9), zorder=4,
                    arrowprops=dict(arrowstyle="-", color="#888888", linewidth=0.6))
    ax.axvline(usable, color="#d62728", linestyle="--", linewidth=1, label=f"usable memory ({usable:.0f} GiB)")
    ax.set_xlim(0, usable * 1.04)
    ax.set_xlabel("peak memory per GPU (GiB)")
    ax.set_ylabel("step time (s)")
    ax.legend(loc="upper left", fontsize=8, frameon=False)
    if not fitting:
        ax.text(0.5, 0.5, "no layout fits in memory", transform=ax.transAxes, ha="center", fontsize=11,
                color="#d62728")
    hidden = sum(1 for _, t, _ in fitting if t > top)
    if hidden:
        ax.text(0.99, 0.99, f"{hidden} slower layouts (> {TIME_RANGE:g}x the best) not shown", transform=ax.transAxes,
                ha="right", va="top", fontsize=7, color="#666666")


def _draw_out_of_memory(ax, over: list, top: float, usable: float) -> list:
    """The layouts that do not fit, on their own memory scale; returns those drawn."""
    from matplotlib.ticker import MaxNLocator

    shown = [(m, t) for m, t in over if t <= top]
    if shown:
        ax.scatter(*zip(*shown), s=8, c="#e5a0a0", marker="x", zorder=2)
        ax.set_xlim(usable, max(m for m, _ in shown) * 1.05)
    ax.set_title(f"out of memory: {len(over)}\n(times: lower bounds)", fontsize=9)
    ax.set_xlabel("GiB per GPU")
    ax.xaxis.set_major_locator(MaxNLocator(3))
    return shown
