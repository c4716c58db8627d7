"""The planner against published runs: the calibration rows each within 10% (known gaps kept
visible), and the held-out runs' error and rank agreement per source and per kind of run."""

from __future__ import annotations

import pytest

from tetrad.plan.reference import (CALIBRATION_MAPE, agreement, best_estimate, format_agreement, predicted_value,
                                   ranking_group, read_rows)

ROWS = read_rows(held_out=False)  # the calibration runs shipped with the package (src/tetrad/plan/reference_runs)
# Known gaps, kept visible: torchtitan's Dec 2024 context parallelism at cp = 4 and 8. Every rank
# holds 32768 tokens in all four rows, and torch's ring (torch 1963fc8) then runs cp rounds of the
# same work: one 32768-token causal flash call, or a 32768 x 16384 one, with the same fp32 merges and
# the same K/V bytes per round. Any cost per round makes time per token affine in cp >= 2, with a
# slope no larger than the step from cp = 1 to 2. Published: 257, 394, 934, 1825 us per token; within
# 10% on tokens/s the step from 1 to 2 is at most 204 us and the slope from 2 to 4 at least 205.5,
# so no per-round physics meets all four rows (docs/planner.md, Validation).
KNOWN_GAPS = {"tt-8b-cp4", "tt-8b-cp8"}


# The held-out runs' MAPE as docs/planner.md reports it (bench/bench_plan.py prints the same): a
# change of the model that makes it worse on runs it never saw fails here.
HELD_OUT_MAPE = 0.056


def test_published_runs_within_10_percent(capsys):
    errors, results = {}, []
    with capsys.disabled():
        print(f"\n{'run':<18}{'metric':<22}{'published':>11}{'predicted':>11}{'error':>9}")
        for row in ROWS:
            pred, pub = predicted_value(row, best_estimate(row)), float(row["value"])
            errors[row["id"]] = (pred - pub) / pub
            results.append((row["source"], ranking_group(row), pub, pred))
            gap = "  (known gap)" if row["id"] in KNOWN_GAPS else ""
            print(f"{row['id']:<18}{row['metric']:<22}{pub:>11.4g}{pred:>11.4g}{100 * errors[row['id']]:>+8.1f}%{gap}")
        summary = agreement(results)
        print(format_agreement(summary))
    # Where a source measured several layouts of one model on one cluster, the order must match.
    assert all(s["tau"] in (None, 1.0) for s in summary.values()), summary
    # `tetrad plan`'s stated spread is the error measured here.
    assert 100 * CALIBRATION_MAPE == pytest.approx(summary["all"]["mape"], abs=0.5), summary["all"]
    bad = {k: f"{100 * v:+.1f}%" for k, v in errors.items() if abs(v) > 0.10 and k not in KNOWN_GAPS}
    assert not bad, f"rows off by more than 10%: {bad}"
    closed = [k for k in KNOWN_GAPS if k in errors and abs(errors[k]) <= 0.10]
    assert not closed, f"known gaps closed, remove them from KNOWN_GAPS: {closed}"


def test_held_out_runs_per_source_and_category(capsys):
    """Published runs no constant was fitted to: MAPE and Kendall's tau per source and per kind
    of run, printed; the order of each source's runs of one model on one cluster must match."""
    results = [(r, float(r["value"]), predicted_value(r, best_estimate(r))) for r in read_rows(held_out=True)]
    with capsys.disabled():
        for key in ("source", "category"):
            summary = agreement([(r[key], ranking_group(r), pub, pred) for r, pub, pred in results])
            print("\n" + format_agreement(summary).replace("source", key, 1))
            assert all(s["tau"] in (None, 1.0) for s in summary.values()), summary
    assert summary["all"]["mape"] <= 100 * HELD_OUT_MAPE + 0.5, summary["all"]
