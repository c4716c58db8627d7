"""Gradient codecs and hierarchical reduction: training stays near the uncompressed curve and
the counted dp bytes shrink by the codec's factor."""

import pytest
import torch

from conftest import assert_parity, run_ranks, tiny_config, train_layout
from tetrad.dist.codec_shapes import powersgd_shape
from tetrad.dist.codecs import PowerSGD
from tetrad.model.sharding import spec_of
from tetrad.plan.comm_bytes import comm_bytes_per_step
from tetrad.train.trainer import Trainer

pytestmark = pytest.mark.dist

TRAIN = {"micro_batch": 1, "steps": 6}


RUNS: dict = {}


def run(**parallel):
    key = tuple(sorted(parallel.items()))
    if key not in RUNS:
        RUNS[key] = train_layout(tiny_config(parallel={"dp": 2, **parallel}, train=TRAIN))
    return RUNS[key]


def dp_bytes(history):
    return sum(r["comm_bytes"]["dp"] for r in history)


# (codec, zero, loss tolerance, minimum byte reduction). bf16 rounds each summed gradient to
# 8 bits of mantissa; int8 uses 127 // N levels per rank with error feedback; rank-4 PowerSGD
# drops most of the spectrum (error feedback returns it later), so it is allowed the most.
# Under ZeRO >= 2 bf16 is the reduce-scatter's dtype (every micro-batch); the updated weights'
# all-gather is not compressed (factor None: fewer bytes than uncompressed, exactly the planner's).
CASES = [("bf16", 0, 0.02, 1.9), ("bf16", 1, 0.02, 1.9), ("int8", 0, 0.05, 3.5), ("int8", 1, 0.05, 3.5),
         ("powersgd", 0, 0.3, 5.0), ("bf16", 2, 0.02, None), ("bf16", 3, 0.02, None)]


@pytest.mark.parametrize("codec, zero, tol, factor", CASES)
def test_codec_tracks_uncompressed_curve(codec, zero, tol, factor):
    losses, _, history = run(grad_codec=codec, zero=zero)
    ref_losses, _, ref_history = run(zero=zero)
    torch.testing.assert_close(torch.tensor(losses), torch.tensor(ref_losses), rtol=0, atol=tol)
    assert losses[-1] < losses[0] - 0.5  # it still learns
    if factor is None:
        assert dp_bytes(history) < dp_bytes(ref_history)
        return
    # Gradient bytes only: ZeRO-1's all-gather of the updated parameters is not compressed; its
    # bytes are what plain ZeRO-1 counts beyond plain ZeRO-0.
    grad_bytes = dp_bytes(run(zero=0)[2])
    gathered = dp_bytes(ref_history) - grad_bytes
    assert grad_bytes / (dp_bytes(history) - gathered) > factor


@pytest.mark.parametrize("codec, zero", [(c, z) for c, z, *_ in CASES])
def test_the_planner_counts_the_codecs_bytes(codec, zero):
    """What the runtime's counters measure under a codec, the planner predicts (its comm panel
    and its time model rank codecs by these bytes)."""
    cfg = tiny_config(parallel={"dp": 2, "grad_codec": codec, "zero": zero}, train=TRAIN)
    assert [r["comm_bytes"] for r in run(grad_codec=codec, zero=zero)[2]] == [comm_bytes_per_step(cfg)] * TRAIN["steps"]


def _replicated_weights(cfg):
    """(this rank's dp coordinate, tp coordinate, its tp-replicated parameters) after training."""
    trainer = Trainer(cfg, torch.device("cpu"))
    trainer.fit()
    replicated = {n: p.detach().clone() for n, p in trainer.model.named_parameters() if spec_of(p)[2] == 1}
    return trainer.topo.coords["dp"], trainer.topo.coords["tp"], replicated


@pytest.mark.parametrize("codec", ["int8", "powersgd"])
def test_tp_replicas_stay_identical_under_a_codec_that_mixes_elements(codec):
    """int8's block scales and PowerSGD's low rank span a bucket, whose other elements differ
    between tp ranks: each got another sum of a norm's identical gradients, so the norm's tp
    replicas drifted apart (by 0.017 and 0.05 after 5 steps) and a resume, which restores one
    copy, was not exact."""
    cfg = tiny_config(parallel={"dp": 2, "tp": 2, "grad_codec": codec}, train={"micro_batch": 1, "steps": 3})
    weights = {(dp, tp): state for dp, tp, state in run_ranks(_replicated_weights, 4, cfg)}
    assert weights[0, 0].keys() and weights[0, 0].keys() == weights[0, 1].keys()
    for dp in (0, 1):
        assert [n for n in weights[dp, 0] if not torch.equal(weights[dp, 0][n], weights[dp, 1][n])] == []


@pytest.mark.parametrize("n", [4096, 106816, 65537, 1_000_003, 2 * 999_983])  # primes, twice a prime
def test_powersgd_compresses_whatever_the_bucket_size(n):
    rows, cols = powersgd_shape(n)
    assert rows * cols >= n > (rows - 1) * cols  # exact, or zero padding of less than one row
    assert (rows + cols) * 4 < n / 4  # P and Q (rank 4) send under a quarter of the bucket
    assert powersgd_shape(106816) == (1669, 64)  # an exact factorisation where one compresses


class _OneRank:
    """A comm of one rank: the sum is the tensor itself."""

    def all_reduce(self, t, group, async_op=False):
        return self

    def wait(self) -> None:
        pass


@pytest.mark.parametrize("n", [1, 8, 12, 13, 16])
def test_powersgd_takes_a_bucket_of_few_values(n):
    """A bucket of under 13 values (latent attention's 8-wide latent norm alone in a small bucket:
    fuzz seed 69630) gives a matrix of fewer rows than the rank, which crashed the codec; now it
    has `rank` rows at least, and rank-4 factors of a matrix at most 4 wide are exact."""
    grad = torch.randn(n, generator=torch.Generator().manual_seed(n))
    flat = grad.clone()
    PowerSGD(1).all_reduce(flat, _OneRank(), "dp", 0).wait()
    torch.testing.assert_close(flat, grad)


def test_hierarchical_equals_flat():
    flat = train_layout(tiny_config(parallel={"dp": 4}, train=TRAIN))
    hier = train_layout(tiny_config(parallel={"dp": 4, "hierarchical": True, "ranks_per_node": 2}, train=TRAIN))
    # The same sum in another order (intra-node, then inter-node): fp32 rounding only.
    assert_parity(hier, flat)
