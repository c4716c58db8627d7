"""Layouts drawn at random (tests/layout_draws.py) that the fixed parametrized tests do not
combine: zero-bubble with ZeRO-3, tp and SP; interleaved vpp 3 with tied embeddings; Ulysses with
tp and hierarchical reduction over 8 ranks; validation in pipeline and cp layouts; "auto"
buckets; uneven stage splits; and checkpoints resumed in another random layout. Each is compared
with one process as every parity test is. The seeds were picked from tools/fuzz_layouts.py's
runs to cover the most feature pairs in the least time (about 25 s here)."""

from pathlib import Path

import pytest

from conftest import assert_parity, tiny_config, train_layout
from layout_draws import draw, parity_atol, reference_of, resume_pair

pytestmark = pytest.mark.dist

SEEDS = [1003, 1129, 1180, 1035, 1112, 1122, 1049, 1258, 1051, 1040, 1088, 1168, 1161, 1030]
RESUME_SEEDS = [1026, 1077, 1092]


def describe(parallel: dict) -> str:
    dims = "-".join(f"{k}{parallel[k]}" for k in ("dp", "tp", "pp", "cp") if parallel[k] > 1)
    return f"{dims}-z{parallel['zero']}" + (f"-{parallel['schedule']}" if parallel["pp"] > 1 else "")


@pytest.mark.parametrize("seed", SEEDS, ids=[f"{s}-{describe(draw(s)['parallel'])}" for s in SEEDS])
def test_drawn_layout_matches_single_process(seed):
    overrides = draw(seed)
    got = train_layout(tiny_config(**overrides))
    assert_parity(got, train_layout(tiny_config(**reference_of(overrides))), atol=parity_atol(overrides["parallel"]))


@pytest.mark.parametrize("seed", RESUME_SEEDS, ids=[f"{s}-{describe(resume_pair(s)['a']['parallel'])}-to-"
                                                    f"{describe(resume_pair(s)['b']['parallel'])}" for s in RESUME_SEEDS])
def test_drawn_layout_resumes_in_another(seed):
    # Layout a trains steps 1-2 and saves; layout b loads that checkpoint and trains steps 3-4:
    # together they follow one process's four steps.
    pair = resume_pair(seed)
    first = tiny_config(**pair["a"], checkpoint={"every": 2})
    losses, _, history = train_layout(first)
    step2 = str(Path(first.run.dir) / "checkpoints" / "step_00000002")
    b_losses, state, b_history = train_layout(tiny_config(**pair["b"], checkpoint={"resume": step2}))
    widest = {d: max(pair["a"]["parallel"][d], pair["b"]["parallel"][d]) for d in ("dp", "tp", "pp", "cp")}
    assert_parity((losses[:2] + b_losses, state, history[:2] + b_history),
                  train_layout(tiny_config(**reference_of(pair["a"]))), atol=parity_atol(widest))
