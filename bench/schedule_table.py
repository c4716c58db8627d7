"""Print the README's pipeline-schedule table, computed by the simulator (never typed by hand).

Costs are per micro-batch for one rank's share of the model, split evenly over its vpp chunks, so
every row does the same work and step times compare directly.
"""

from __future__ import annotations

import argparse

from tetrad.parallel.pipeline.registry import build_schedule
from tetrad.parallel.pipeline.simulate import StageCosts, simulate

ROWS = [("gpipe", 1), ("1f1b", 1), ("interleaved", 2), ("interleaved", 4), ("zb", 1)]
SHAPES = [(4, 8), (4, 16), (8, 16), (8, 32)]


def table(f: float, bi: float, bw: float) -> str:
    lines = ["| schedule | p | m | v | bubble | (p−1)/(v·m+p−1) | step time | peak in-flight, rank 0…p−1 |",
             "|---|--:|--:|--:|--:|--:|--:|---|"]
    for p, m in SHAPES:
        for name, v in ROWS:
            r = simulate(build_schedule(name, p, m, v), StageCosts(f / v, bi / v, bw / v))
            closed = "—" if name == "zb" else f"{(p - 1) / (v * m + p - 1):.1%}"
            lines.append(f"| {name} | {p} | {m} | {v} | {r.bubble_fraction:.1%} | {closed} | "
                         f"{r.step_time:g} | {' '.join(map(str, r.peak_inflight))} |")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--costs", default="1,1,1", metavar="F,BI,BW",
                        help="forward, backward-input, backward-weight cost per micro-batch (default 1,1,1)")
    f, bi, bw = (float(x) for x in parser.parse_args().costs.split(","))
    print(f"Simulated with F={f:g}, BI={bi:g}, BW={bw:g} per micro-batch per rank (B = BI+BW), no "
          "point-to-point latency. Peak in-flight counts (micro-batch, chunk) activations alive at once; an "
          "interleaved chunk holds 1/v of a rank's layers, so divide its counts by v to compare.\n")
    print(table(f, bi, bw))


if __name__ == "__main__":
    main()
