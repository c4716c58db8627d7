"""Data-parallel parity: dp=2 and dp=4 train the same model as one process."""

import pytest

from conftest import assert_parity, tiny_config, train_layout

pytestmark = pytest.mark.dist


@pytest.fixture(scope="module")
def reference():
    return train_layout(tiny_config())


@pytest.mark.parametrize("dp", [2, 4])
def test_dp_matches_single_process(reference, dp):
    # fp32; the only difference is the order of the gradient sum (all-reduce across ranks vs
    # accumulation in one process): ~1e-7 relative per step, slightly amplified by 5 Adam steps.
    assert_parity(train_layout(tiny_config(parallel={"dp": dp})), reference)
