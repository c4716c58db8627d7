"""`tetrad report RUN_DIR`: what a run did and where its time went, as PNGs and one
self-contained HTML page (the PNGs embedded) in RUN_DIR/report/.

Panels: loss and validation loss; step time split into compute / exposed communication / pipeline bubble; bytes per
group against the planner's count; predicted (planner) against measured step time and memory;
counted memory per rank (model states, saved activations) against the planner's parts;
the measured pipeline timeline beside the simulated one when the run recorded one
(RUN_DIR/timeline/pp<rank>.json: [[rank, kind, mb, chunk, start, end], ...] for the last step);
a few short samples from the run's latest checkpoint, decoded with its tokenizer (train/generate.py).
"""

from __future__ import annotations

import argparse
import base64
import html
import json
import statistics
import sys
from pathlib import Path

from tetrad.config.wording import counted
from tetrad.dist.layout import GRAD_DIMS, REPORTED as GROUPS  # REPORTED: the comm_bytes keys

COLOURS = {"compute": "#3b6fb6", "bubble": "#b0b0b0", "tp": "#c8463c", "cp": "#e08a2c", "pp": "#8e5ea2",
           "dp": "#4f9a55", "ep": "#a0522d", "comm": "#c8463c", "optimizer": "#d4b24c", "data": "#7fc6c0",
           "predicted": "#9ab8e0", "measured": "#3b6fb6"}


def group_label(group: str) -> str:
    """A comm_bytes key as drawn: the gradient group (dp x cp) is reported under its first
    dimension's key, so a cp-only run moves "dp" bytes; the label says whose they are."""
    return f"{group} ({'×'.join(GRAD_DIMS)} grads)" if group == GRAD_DIMS[0] else group


def load_run(run_dir: Path):
    from tetrad.config import load_config
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines() if line.strip()]
    if not records:
        raise ValueError(f"{run_dir}/metrics.jsonl has no steps yet")
    return load_config(run_dir / "config.toml", runtime=False), records


def new_figure(width=7.5, height=3.4):
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure
    fig = Figure(figsize=(width, height), dpi=110, layout="constrained")
    FigureCanvasAgg(fig)
    return fig


def style_axes(ax, title, xlabel, ylabel):
    ax.set_title(title, loc="left", fontsize=11, fontweight="bold")
    ax.set_xlabel(xlabel)
    ax.set_ylabel(ylabel)
    ax.grid(alpha=0.3)
    ax.spines[["top", "right"]].set_visible(False)


def plot_loss(records, path: Path) -> None:
    fig = new_figure()
    ax = fig.add_subplot()
    steps = [r["step"] for r in records]
    # A line needs two points: a run of one step (a quick check, an early stop) shows a marker.
    ax.plot(steps, [r["loss"] for r in records], color=COLOURS["compute"], lw=1.8, label="training",
            marker="o" if len(steps) == 1 else None, ms=4)
    val = [(r["step"], r["val_loss"]) for r in records if "val_loss" in r]
    if val:
        ax.plot(*zip(*val), color=COLOURS["tp"], lw=1.5, marker="o", ms=4, label="validation (after the step)")
        by_source = [(r["step"], r["val_loss_by_source"]) for r in records if "val_loss_by_source" in r]
        for name in (by_source[-1][1] if by_source else {}):  # a blend: each source's, thinner
            ax.plot([step for step, _ in by_source], [losses[name] for _, losses in by_source], lw=0.8,
                    marker=".", ms=3, label=f"validation: {name}")
        ax.legend(loc="upper center", fontsize=8, frameon=False)
    style_axes(ax, "Training and validation loss" if val else "Training loss", "step", "loss (mean per token)")
    ax2 = ax.twinx()
    ax2.plot(steps, [r["lr"] for r in records], color="#999999", lw=1, ls="--")
    ax2.set_ylabel("learning rate (dashed)", color="#777777")
    ax2.spines[["top"]].set_visible(False)
    fig.savefig(path)


def plot_breakdown(records, path: Path) -> None:
    """Stacked per step: compute, exposed comm by group (when recorded), pipeline bubble,
    optimizer, data; the measured step time as a line over them, so a gap or overshoot shows
    an accounting error."""
    fig = new_figure()
    ax = fig.add_subplot()
    steps = [r["step"] for r in records]
    layers = [("compute", COLOURS["compute"], [r.get("compute_s") or 0.0 for r in records])]
    by_group = [r.get("exposed_comm_s_by_group") for r in records]
    if all(by_group):  # its "pp" entry is the bubble, drawn below
        layers += [(f"exposed comm: {group_label(g)}", COLOURS[g], [b.get(g, 0.0) for b in by_group]) for g in GROUPS
                   if g != "pp" and any(b.get(g, 0.0) for b in by_group)]
    else:
        layers.append(("exposed comm", COLOURS["comm"], [r.get("exposed_comm_s") or 0.0 for r in records]))
    layers += [(name, COLOURS[colour], [r.get(key) or 0.0 for r in records]) for name, colour, key in
               (("pipeline bubble", "bubble", "bubble_s"), ("optimizer", "optimizer", "optimizer_s"),
                ("data", "data", "data_s")) if any(r.get(key) for r in records)]
    # Step s spans [s - 0.5, s + 0.5]: every step, the first, last and only one included, is a full block.
    edges = [s - 0.5 for s in steps] + [steps[-1] + 0.5]
    ms = lambda xs: [1e3 * x for x in xs + xs[-1:]]  # noqa: E731
    ax.stackplot(edges, *[ms(v) for _, _, v in layers], labels=[n for n, _, _ in layers],
                 colors=[c for _, c, _ in layers], alpha=0.85, step="post")
    ax.plot(edges, ms([r["step_time_s"] for r in records]), color="black", lw=1.2, label="measured step time",
            drawstyle="steps-post")
    style_axes(ax, "Where each step's time went", "step", "milliseconds")
    # The first steps warm up allocators and the backend: scale the axis to the steady state.
    steady = sorted(r["step_time_s"] for r in records)[int(0.9 * (len(records) - 1))]
    ax.set_ylim(0, 1.5e3 * steady)
    # Beside the plot, not over it: the tallest steps reach the top of the axes.
    ax.legend(loc="upper left", bbox_to_anchor=(1.01, 1), fontsize=8, frameon=False)
    fig.savefig(path)


def layout_segments(records, cfg) -> list[tuple[str, list[dict]]]:
    """The run's steps cut where the layout changed (a resume under another [parallel] section):
    (layout label, its records) in order. Lines without a layout (older runs) count as config.toml's."""
    from tetrad.train.metrics import layout_label
    default = layout_label(cfg.parallel)
    segments: list[tuple[str, list[dict]]] = []
    for r in records:
        label = r.get("layout", default)
        if not segments or segments[-1][0] != label:
            segments.append((label, []))
        segments[-1][1].append(r)
    return segments


def comm_medians(records) -> list[float]:
    """Median MiB per step of each group in GROUPS."""
    return [statistics.median(r["comm_bytes"].get(g, 0) for r in records) / 2**20 for g in GROUPS]


def plot_comm(segments, predicted: dict | None, path: Path) -> None:
    """Bytes each group moved per step (rank 0's count, median), one bar per layout the run
    used, beside the planner's count for the current (last) layout."""
    fig = new_figure(height=2.4 + 0.6 * len(segments))
    ax = fig.add_subplot()
    series = [(f"measured: {label}, steps {rs[0]['step']}-{rs[-1]['step']}" if len(segments) > 1
               else "measured (tetrad.comm)", comm_medians(rs)) for label, rs in segments]
    if predicted:
        series.append(("planner" + (f": {segments[-1][0]}" if len(segments) > 1 else ""),
                       [predicted.get(g, 0) / 2**20 for g in GROUPS]))
    h = 0.8 / len(series)
    shades = [COLOURS["measured"], "#1f3f73", "#6d8fc7", "#0d2340"]
    for k, (name, values) in enumerate(series):
        colour = COLOURS["predicted"] if predicted and k == len(series) - 1 else shades[k % len(shades)]
        bars = ax.barh([i - 0.4 + h * (k + 0.5) for i in range(len(GROUPS))], values, height=h, color=colour,
                       label=name)
        ax.bar_label(bars, labels=[f"{v:.3g} MiB" if v else "" for v in values], padding=3, fontsize=8)
    if len(series) > 1:
        ax.legend(loc="upper left", bbox_to_anchor=(1.01, 1), fontsize=8, frameon=False)
    ax.set_yticks(list(range(len(GROUPS))), [group_label(g) for g in GROUPS])
    ax.invert_yaxis()
    ax.set_xlim(0, 1.25 * max([v for _, values in series for v in values] + [1e-9]))
    style_axes(ax, "Communication per step, by group (rank 0)", "MiB handed to collectives", "")
    fig.savefig(path)


def plot_predicted(measured: dict, predicted: dict, path: Path) -> None:
    """Side-by-side bars of the planner's prediction and the measurement for each quantity."""
    names = [k for k in predicted if measured.get(k) is not None]
    fig = new_figure(width=3.0 + 1.6 * len(names), height=3.2)
    axes = fig.subplots(1, len(names), squeeze=False)[0]
    for ax, name in zip(axes, names):
        values = [predicted[name], measured[name]]
        bars = ax.bar(["planner", "measured"], values, color=[COLOURS["predicted"], COLOURS["measured"]])
        ax.bar_label(bars, labels=[f"{v:.3g}" for v in values], fontsize=8)
        ax.set_title(name, fontsize=10)
        ax.spines[["top", "right"]].set_visible(False)
        ax.set_ylim(0, 1.2 * max(values + [1e-9]))
    fig.suptitle("Planner's prediction vs this run", x=0.02, ha="left", fontsize=11, fontweight="bold")
    fig.savefig(path)


MEMORY_PARTS = (("params", "weights"), ("grads", "grads"), ("optimizer", "optimizer"), ("activations", "activations"))


def plot_memory(record: dict, predicted, path: Path) -> None:
    """Rank 0's counted memory at the last step (model states from the tensors, the peak of saved
    activations) beside the planner's parts for pipeline rank 0 (None: no prediction)."""
    fig = new_figure(height=3.0)
    ax = fig.add_subplot()
    names = [name for name, _ in MEMORY_PARTS]
    x = range(len(names))
    measured = [record["memory_bytes"][name] / 2**20 for name in names]
    if predicted is not None:
        ax.bar([i - 0.2 for i in x], [getattr(predicted, part) / 2**20 for _, part in MEMORY_PARTS], width=0.4,
               color=COLOURS["predicted"], label="predicted (planner)")
    ax.bar([i + (0.2 if predicted is not None else 0) for i in x], measured, width=0.4,
           color=COLOURS["measured"], label="counted (this run, rank 0)")
    ax.set_xticks(list(x), names)
    style_axes(ax, "Memory per rank: model states and saved activations", "", "MiB")
    ax.legend(frameon=False, fontsize=8)
    fig.savefig(path)


def _timelines(run_dir: Path, cfg, out: Path) -> tuple[list[Path], str]:
    """Measured and simulated pipeline timelines, or the reason there are none."""
    p = cfg.parallel
    if p.pp == 1:
        return [], "pp = 1: no pipeline, so no timeline."
    # pp<rank>.json of this layout's ranks only: a resume from a deeper pipeline leaves stale higher ranks.
    recorded = [run_dir / "timeline" / f"pp{r}.json" for r in range(p.pp)]
    if not all(path.is_file() for path in recorded):
        return [], f"pp = {p.pp}, but the run recorded no complete timeline (timeline/pp*.json)."
    from tetrad.parallel.pipeline.registry import build_schedule
    from tetrad.parallel.pipeline.schedules import Action
    from tetrad.parallel.pipeline.simulate import StageCosts, simulate
    from tetrad.viz.timeline import render_timeline
    rows = [(r, Action(kind, mb, chunk), s, e) for path in recorded
            for r, kind, mb, chunk, s, e in json.loads(path.read_text())]
    mean = lambda kind: statistics.mean(e - s for _, a, s, e in rows if a.kind == kind) if any(  # noqa: E731
        a.kind == kind for _, a, _, _ in rows) else 0.0
    f, b = mean("F"), mean("B") or mean("BI") + mean("BW")
    bi, bw = (mean("BI"), mean("BW")) if mean("BI") else (b / 2, b / 2)
    micro = 1 + max(a.mb for _, a, _, _ in rows)  # the last step's: under a ramp-up maybe below cfg.microbatches
    sim = simulate(build_schedule(p.schedule, p.pp, micro, p.vpp), StageCosts(f, bi, bw))
    measured_span = max(e for *_, e in rows) - min(s for *_, s, _ in rows)
    paths = [out / "timeline_measured.png", out / "timeline_simulated.png"]
    span = max(measured_span, sim.step_time)  # one time axis for both
    render_timeline(rows, paths[0], title=f"measured: {p.schedule}, pp={p.pp}, {counted(micro, 'micro-batch', 'micro-batches')}",
                    pp=p.pp, span=span)
    render_timeline(sim, paths[1], title="simulated with the measured mean action costs", pp=p.pp, span=span)
    idle = 1 - sum(e - s for *_, s, e in rows) / (p.pp * measured_span)  # SimResult.bubble_fraction's definition
    return paths, (f"bubble (idle share of rank-time, last step) measured {100 * idle:.1f}%, "
                   f"simulated {100 * sim.bubble_fraction:.1f}%.")


def _prediction(cfg, cluster_ref: str | None):
    """(planner estimate, its comm bytes, cluster label), or (None, None, reason) when unavailable."""
    try:
        from tetrad.plan.comm_bytes import comm_bytes_per_step
        from tetrad.plan.cost import estimate
        from tetrad.plan.hardware import load_cluster
    except ImportError as e:
        return None, None, f"the planner is not available ({e})"
    ref = cluster_ref or ("bench/cluster.toml" if Path("bench/cluster.toml").exists() else "cpu")
    try:
        return estimate(cfg, load_cluster(ref)), comm_bytes_per_step(cfg), ref
    except Exception as e:  # a planner that cannot model this layout should not stop the report
        return None, None, f"the planner could not estimate this layout: {e}"


# Sample k (from 0) is what `tetrad generate RUN_DIR --prompt SAMPLE_PROMPTS[k] --seed k --max-new-tokens
# SAMPLE_TOKENS` prints, in its sampling; short, so that the report stays fast. No prompt ends in a space: byte-level
# BPE joins a space to the word after it ("Ġword"), so a trailing space would be a token that running text never has.
SAMPLE_PROMPTS = ("", "The", "This")
SAMPLE_TOKENS = 48


def samples(run_dir: Path, cfg, count: int) -> tuple[list[str], str]:
    """Up to `count` texts sampled from the run's latest checkpoint, and a note saying how."""
    from tetrad.train.checkpoint import CheckpointError
    from tetrad.train.generate import complete, load_generator, run_sampling
    if count == 0:
        return [], "Samples: not asked for (--samples 0)."
    checkpoints = Path(cfg.checkpoint.dir) if cfg.checkpoint.dir else run_dir
    try:
        model, tokenizer, source = load_generator(checkpoints)
        sampling = run_sampling(source)
        texts = [complete(model, tokenizer, prompt, SAMPLE_TOKENS, sampling, seed=k, source=source)[0]
                 for k, prompt in enumerate(SAMPLE_PROMPTS[:count])]
    except CheckpointError as e:
        return [], f"Samples: no checkpoint: no samples ({e})."
    except ValueError as e:  # the run's tokenizer is not found from here
        return [], f"Samples: none, {e}."
    return texts, (f"Samples: from the latest checkpoint, tokenizer {source or 'bytes'}; sample k (from 0) is `tetrad "
                   f"generate {checkpoints} --device cpu --max-new-tokens {SAMPLE_TOKENS} --seed k --prompt P` with "
                   f"the k-th of the prompts {SAMPLE_PROMPTS[:count]} ({sampling.describe()}).")


def write_report(run_dir: str | Path, cluster: str | None = None, sample_count: int = 3) -> tuple[Path, list[str]]:
    """The report page, and the samples it shows."""
    run_dir = Path(run_dir)
    cfg, records = load_run(run_dir)
    out = run_dir / "report"
    out.mkdir(exist_ok=True)
    est, predicted_bytes, cluster_label = _prediction(cfg, cluster)
    segments = layout_segments(records, cfg)
    current = segments[-1][1]  # the layout of config.toml, which the planner predicts
    steady = steady_steps(current)
    measured = {"step time (s, median)": statistics.median(r["step_time_s"] for r in steady),
                "peak memory (GiB)": max(r.get("peak_memory_gib") or 0 for r in current) or None}
    panels = [("loss.png", plot_loss, (records,)), ("breakdown.png", plot_breakdown, (records,)),
              ("comm.png", plot_comm, (segments, predicted_bytes))]
    if est is not None:
        predicted = {"step time (s, median)": est.step_time_s, "peak memory (GiB)": est.peak_memory_gib}
        panels.append(("predicted.png", plot_predicted, (measured, predicted)))
    if "memory_bytes" in records[-1]:
        panels.append(("memory.png", plot_memory, (records[-1], est.memory_by_rank[0] if est else None)))
    images = []
    for name, plot, args in panels:
        plot(*args, out / name)
        images.append(out / name)
    timeline_images, timeline_note = _timelines(run_dir, cfg, out)
    notes = [f"Pipeline timeline: {timeline_note}",
             f"Prediction: cluster {cluster_label}." if est is not None else f"Prediction: skipped, {cluster_label}."]
    if measured["peak memory (GiB)"] is None:
        notes.append("The run recorded no peak memory.")
    elif cfg.train.device != "cuda":
        notes.append("On CPU, measured peak memory is each rank's resident-set growth since it started "
                     "(docs/planner.md); the memory panel counts tensors instead.")
    if records[-1].get("diverged"):
        notes.insert(0, f"The run diverged: at step {records[-1]['step']} the gradient norm was "
                        f"{records[-1]['grad_norm']}; that step was not applied and the run stopped there.")
    texts, sample_note = samples(run_dir, cfg, sample_count)
    notes.append(sample_note)
    page = out / "report.html"
    if len(segments) > 1:
        notes.append("The layout changed on resume: " + "; then ".join(
            f"{label} for steps {rs[0]['step']}-{rs[-1]['step']}" for label, rs in segments)
            + ". Communication is drawn per layout; times and the prediction are the last layout's.")
    page.write_text(_html(cfg, records, current, images + timeline_images, texts, notes))
    return page, texts


def layout_fact(p) -> str:
    """The [parallel] section as the page states it: the options of the dimensions in use only
    (a schedule without a pipeline, or sequence parallelism without tp, would mislead)."""
    words = [f"dp={p.dp} tp={p.tp} pp={p.pp} cp={p.cp}" + (f" ep={p.ep}" if p.ep > 1 else ""), f"zero={p.zero}"]
    if p.tp > 1 and p.sequence_parallel:
        words.append("sequence parallel")
    if p.pp > 1:
        words.append(f"schedule {p.schedule}" + (f" (vpp={p.vpp})" if p.vpp > 1 else ""))
    if p.cp > 1:
        words.append(f"cp_algo {p.cp_algo}")
    return ", ".join(words)


def steady_steps(current: list[dict]) -> list[dict]:
    """The steps whose times the report summarises: all but the first, which pays warm-up,
    unless it is the only one."""
    return current[1:] or current


def _html(cfg, records, current, images, texts, notes) -> str:
    p, last, steady = cfg.parallel, records[-1], steady_steps(current)
    step_s = statistics.median(r["step_time_s"] for r in steady)
    split = ", ".join(f"{name} {100 * statistics.median(r.get(key) or 0 for r in steady) / step_s:.0f}%"
                      for name, key in (("compute", "compute_s"), ("exposed comm", "exposed_comm_s"),
                                        ("bubble", "bubble_s"), ("optimizer", "optimizer_s"), ("data", "data_s")))
    facts = [("model", f"{cfg.model.preset}: {counted(cfg.model.n_layers, 'layer')}, d_model {cfg.model.d_model}"),
             ("layout", layout_fact(p)),
             ("steps", f"{last['step']} of {cfg.train.steps}"),
             ("loss", f"{records[0]['loss']:.4f} → {last['loss']:.4f}"),
             *[("validation loss", f"{r['val_loss']:.4f} at step {r['step']}" + "".join(
                 f"; {name} {loss:.4f}" for name, loss in r.get("val_loss_by_source", {}).items()))
               for r in records if "val_loss" in r][-1:],
             ("step time (median, after its first step)" if len(steady) < len(current) else
              "step time (its only step, warm-up included)", f"{1e3 * step_s:.1f} ms: {split}"),
             ("tokens/s (median)", f"{statistics.median(r['tokens_per_s'] for r in steady):,.0f}")]
    if all(r.get("mfu") is not None for r in steady):
        facts.append(("MFU / HFU (median)", f"{100 * statistics.median(r['mfu'] for r in steady):.2f}% / "
                                            f"{100 * statistics.median(r['hfu'] for r in steady):.2f}% of the "
                                            "device profile's peak (model/flops.py convention)"))
    from tetrad.train.telemetry import FIELDS as TELEMETRY_FIELDS
    sampled = [f"{label} {statistics.median(r[key] for r in steady if key in r):.1f}"
               for key, label in TELEMETRY_FIELDS.items() if any(key in r for r in steady)]
    if sampled:  # accelerators only
        facts.append(("device telemetry (median of step means)", ", ".join(sampled)))
    rows = "".join(f"<tr><th>{html.escape(k)}</th><td>{html.escape(v)}</td></tr>" for k, v in facts)
    figs = "".join(f'<figure><img alt="{img.stem}" src="data:image/png;base64,'
                   f'{base64.b64encode(img.read_bytes()).decode()}"></figure>' for img in images)
    items = "".join(f"<li>{html.escape(n)}</li>" for n in notes)
    shown = "".join(f"<pre>{html.escape(t)}</pre>" for t in texts)
    return f"""<!doctype html><html><head><meta charset="utf-8"><title>tetrad report: {html.escape(cfg.run.dir)}</title>
<style>body{{font-family:system-ui,sans-serif;max-width:60rem;margin:2rem auto;color:#222}}
th{{text-align:left;font-weight:600;padding:.15rem 1.5rem .15rem 0}}td{{padding:.15rem 0}}
img{{max-width:100%}}figure{{margin:1.5rem 0}}pre{{white-space:pre-wrap;background:#f4f4f4;padding:.5rem}}</style></head><body>
<h1>tetrad run report</h1><p><code>{html.escape(cfg.run.dir)}</code></p><table>{rows}</table>
{figs}<h2>Samples</h2>{shown or "<p>none (see the notes)</p>"}<h2>Notes</h2><ul>{items}</ul></body></html>
"""


def report_command(argv: list[str]) -> int:
    ap = argparse.ArgumentParser(prog="tetrad report", description="Write RUN_DIR/report/ (HTML and PNGs).")
    ap.add_argument("run_dir")
    ap.add_argument("--cluster", help="cluster for the planner's prediction (default: bench/cluster.toml if "
                                      "present, else the built-in 'cpu')")
    ap.add_argument("--samples", type=int, default=len(SAMPLE_PROMPTS), choices=range(len(SAMPLE_PROMPTS) + 1),
                    help="how many texts to sample from the latest checkpoint (0: none)")
    args = ap.parse_args(argv)
    if not (Path(args.run_dir) / "metrics.jsonl").is_file():
        print(f"tetrad: {args.run_dir} holds no metrics.jsonl; give the run.dir of a `tetrad train` run",
              file=sys.stderr)
        return 2
    try:
        if args.cluster:  # one the user named is checked first: a typo is not a report without the prediction
            from tetrad.plan.hardware import load_cluster
            load_cluster(args.cluster)
        page, texts = write_report(args.run_dir, args.cluster, args.samples)
    except ValueError as e:  # a run with no step yet; an unknown cluster (HardwareError)
        print(f"tetrad: {e}", file=sys.stderr)
        return 2
    for k, text in enumerate(texts, 1):
        print(f"--- sample {k}\n{text}")
    print(f"tetrad: report in {page}")
    return 0
