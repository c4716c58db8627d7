"""Pipeline parallelism: every schedule trains the same model as one process.

Parity is per-step loss and every final parameter against a single-process run of the same
config (fp32, 5 AdamW steps). Stages hold disjoint parameters, so a pipeline changes only the
order of the gradient sum over micro-batches, never its terms.
"""

import pytest
import torch
import torch.distributed as dist

from conftest import assert_parity, run_ranks, tiny_config, train_layout
from tetrad import launch
from tetrad.config import ConfigError, load_config
from tetrad.parallel.pipeline.registry import check_config
from tetrad.parallel.pipeline.split import layer_split
from tetrad.train.trainer import Trainer

pytestmark = pytest.mark.dist

# Layers: one per stage for pp=4 or pp=2 x vpp=2, and 8 for pp=4 x vpp=2. micro_batch 1, so
# global_batch sets the number of micro-batches m.
RUNS: dict = {}


def run(parallel: dict, microbatches: int, layers: int = 4):
    key = (tuple(sorted(parallel.items())), microbatches, layers)
    if key not in RUNS:
        dp = parallel.get("dp", 1)
        cfg = tiny_config(model={"n_layers": layers}, parallel=parallel,
                          train={"micro_batch": 1, "global_batch": microbatches * dp})
        RUNS[key] = train_layout(cfg)
    return RUNS[key]


CASES = [
    # (schedule, pp, vpp, m): m = p, 2p, and one m that p does not divide (interleaved needs m >= p).
    *[(s, pp, 1, m) for s in ("gpipe", "1f1b", "zb") for pp in (2, 4) for m in (pp, 2 * pp, pp + 1)],
    *[("interleaved", 2, 2, m) for m in (2, 4, 3)],
    ("interleaved", 4, 2, 5),
]


@pytest.mark.parametrize("schedule,pp,vpp,m", CASES, ids=lambda v: str(v))
def test_schedule_matches_single_process(schedule, pp, vpp, m):
    layers = max(4, pp * vpp)
    assert_parity(run({"pp": pp, "vpp": vpp, "schedule": schedule}, m, layers), run({}, m, layers))


@pytest.mark.parametrize("parallel", [{"dp": 2, "pp": 2}, {"tp": 2, "pp": 2}, {"tp": 2, "pp": 2, "sequence_parallel": True},
                                      {"dp": 2, "pp": 2, "vpp": 2, "schedule": "interleaved"},
                                      {"tp": 2, "pp": 2, "schedule": "zb"}, {"dp": 2, "pp": 2, "schedule": "zb", "zero": 2},
                                      {"dp": 2, "pp": 2, "schedule": "zb", "zero": 3}],
                         ids=lambda p: "-".join(f"{k}{v}" for k, v in p.items()))
def test_pipeline_composes(parallel):
    m = 4  # micro-batches per dp rank; the reference runs the same global batch in one process
    # With tp, matmuls and the loss are also summed in pieces; Adam turns the ~1e-7 relative
    # gradient differences of near-zero entries into update differences of up to 5e-5 absolute
    # after 5 steps at lr 1e-2 (measured, dp1-tp2-pp2): atol 1e-4, still 1/100 of one step.
    atol = 1e-4 if parallel.get("tp", 1) > 1 else 1e-5
    assert_parity(run(parallel, m), run({}, m * parallel.get("dp", 1)), atol)


def _gathered_blocks_after_backward(cfg):
    """Transformer blocks whose ZeRO-3 parameters are still gathered once a step's forward and
    backward passes are over (before the reducer's end-of-step free), and the blocks held."""
    from tetrad.train.trainer import Trainer
    trainer = Trainer(cfg, torch.device("cpu"))
    micro = trainer.batches.microbatches(0, trainer.topo.coords["dp"], cfg.parallel.dp, cfg.train.micro_batch)
    trainer.forward_backward(micro, trainer.batches.loss_tokens(0))
    grads = trainer.grads
    blocks = len(grads.blocks)
    return sum(grads.flat[k].untyped_storage().nbytes() > 0 for k in range(blocks)), blocks


def _most_full_buckets_in_backward(cfg):
    """The most reducer buckets holding a full gradient at once during one step's backward passes."""
    from unittest import mock

    from tetrad.parallel.data.lifecycle import GradSync
    from tetrad.train.trainer import Trainer
    most, buckets = [0], []

    def record(sync, *args):  # each arrival: from autograd's hook (BI) or BW's landing
        arrive(sync, *args)
        most[0] = max(most[0], sum(b.grad is not None for b in buckets))

    arrive = GradSync.arrive
    with mock.patch.object(GradSync, "arrive", record):
        trainer = Trainer(cfg, torch.device("cpu"))
        buckets.extend(trainer.grads.buckets)
        micro = trainer.batches.microbatches(0, trainer.topo.coords["dp"], cfg.parallel.dp, cfg.train.micro_batch)
        trainer.forward_backward(micro, trainer.batches.loss_tokens(0))
    return most[0], len(buckets)


@pytest.mark.parametrize("zero", [2, 3])
def test_zero_gradient_buckets_stay_few_under_split_backward(zero):
    """BI makes the norms' gradients, BW the linears': the norms' wait apart until BW starts the
    bucket, so a bucket is not held full from one to the other."""
    cfg = tiny_config(model={"n_layers": 8}, parallel={"dp": 2, "pp": 2, "schedule": "zb", "zero": zero,
                                                      "grad_bucket_mb": 0.15},
                      train={"micro_batch": 1, "global_batch": 8})
    for most, buckets in run_ranks(_most_full_buckets_in_backward, 4, cfg):
        assert buckets >= 5 and most <= 2, (most, buckets)


def test_zero3_frees_blocks_under_split_backward():
    """Zero-bubble defers weight gradients (BW), which need no weights: a block is released once
    its input gradient is out, instead of staying gathered until the step ends."""
    cfg = tiny_config(model={"n_layers": 4}, parallel={"dp": 2, "pp": 2, "schedule": "zb", "zero": 3},
                      train={"micro_batch": 1, "global_batch": 8})
    for gathered, blocks in run_ranks(_gathered_blocks_after_backward, 4, cfg):
        assert blocks == 2 and gathered <= 1, (gathered, blocks)


@pytest.mark.parametrize("parallel", [{"pp": 2}, {"pp": 2, "vpp": 2, "schedule": "interleaved"},
                                      {"dp": 2, "pp": 2, "tp": 2, "zero": 2}, {"pp": 4, "schedule": "zb"},
                                      # ZeRO-3: the tied embedding's own bucket, gathered for the whole step
                                      {"dp": 2, "pp": 2, "zero": 3}, {"dp": 2, "pp": 2, "schedule": "zb", "zero": 3},
                                      {"dp": 2, "pp": 2, "vpp": 2, "schedule": "interleaved", "zero": 3}],
                         ids=lambda p: "-".join(f"{k}{v}" for k, v in p.items()))
def test_tied_embeddings_across_stages(parallel):
    """The last stage's head is a copy of the first stage's embedding: it starts equal, their
    gradients are summed, so the pair trains as one tied weight; the "embed" all-reduce is counted
    under pp as the planner counts it."""
    from tetrad.plan.comm_bytes import comm_bytes_per_step

    dp, m = parallel.get("dp", 1), 4
    model = {"n_layers": 4, "tie_embeddings": True, "vocab_size": 258}
    train = {"micro_batch": 1, "global_batch": m * dp}
    got = train_layout(tiny_config(model=model, parallel=parallel, train=train))
    ref = train_layout(tiny_config(model=model, train={"micro_batch": 1, "global_batch": m * dp}))
    assert_parity(got, ref, atol=1e-4 if parallel.get("tp", 1) > 1 else 1e-5)  # tp: see test_pipeline_composes
    cfg = tiny_config(model=model, parallel=parallel, train=train)
    assert all(r["comm_bytes"]["pp"] == comm_bytes_per_step(cfg)["pp"] for r in got[2])


def _bw_handover(cfg):
    """One step's torch.autograd.backward calls, each parameter's arrivals at its bucket and each
    bucket's reductions started (GradSync.start), and the micro-batches of this rank."""
    from collections import Counter
    from unittest import mock

    from tetrad.parallel.data.lifecycle import GradSync
    arrivals, starts = Counter(), Counter()
    arrive, start = GradSync.arrive, GradSync.start

    def count_arrival(sync, bucket, i, p, *grad):
        arrivals[id(p)] += 1
        arrive(sync, bucket, i, p, *grad)

    def count_start(sync, bucket):
        starts[bucket.index] += 1
        start(sync, bucket)
    with mock.patch.object(GradSync, "arrive", count_arrival), mock.patch.object(GradSync, "start", count_start):
        trainer = Trainer(cfg, torch.device("cpu"))
        with mock.patch.object(torch.autograd, "backward", wraps=torch.autograd.backward) as backward:
            trainer.train_step(0)
    return (backward.call_count, sorted(set(arrivals[id(p)] for p in trainer.params)), len(arrivals),
            len(trainer.params), sorted(set(starts.values())), len(starts), len(trainer.grads.buckets))


@pytest.mark.parametrize("zero", [0, 2])
def test_bw_hands_weight_gradients_to_the_buckets_without_autograd(zero, monkeypatch):
    """Zero-bubble's BW lands each weight gradient in its bucket itself (GRAD_LANDING), with no
    torch.autograd.backward per layer: the step's only backward calls are its BIs, one per
    micro-batch. Each parameter still arrives once per micro-batch and, under ZeRO-0, each
    bucket starts reducing once a step. Every linear goes through the sink (fp32 ZeRO-0)."""
    import tetrad.parallel.data
    monkeypatch.setattr(tetrad.parallel.data, "SINK_MIN_NUMEL", 0)  # forked ranks inherit it
    m = 4
    cfg = tiny_config(model={"n_layers": 4}, parallel={"dp": 2, "pp": 2, "schedule": "zb", "zero": zero},
                      train={"micro_batch": 1, "global_batch": m * 2})
    for backwards, arrivals, arrived, params, starts, started, buckets in run_ranks(_bw_handover, 4, cfg):
        assert backwards == m and arrivals == [m] and arrived == params, (backwards, arrivals, arrived, params)
        if zero == 0:
            assert starts == [1] and started == buckets, (starts, started, buckets)


def _one_zb_step(cfg):
    Trainer(cfg, torch.device("cpu")).train_step(0)


def test_a_weight_deferred_to_bw_that_the_reducer_does_not_expect_is_refused(monkeypatch):
    """A linear whose weight gradient zero-bubble's BW computes must be in the reducer's
    deferred set: one left out (here every row-parallel one, as a new layer type would be) ends
    the run with what to change, instead of landing in p.grad past its bucket."""
    import tetrad.parallel.data

    class NotALayer:
        pass
    monkeypatch.setattr(tetrad.parallel.data, "RowParallelLinear", NotALayer)  # forked ranks inherit it
    cfg = tiny_config(parallel={"pp": 2, "schedule": "zb"}, train={"micro_batch": 1, "global_batch": 4})
    with pytest.raises(launch.RankFailure, match="add its layer to GradReducer's deferred_weights"):
        run_ranks(_one_zb_step, 2, cfg, timeout_s=120)


def test_split_backward_does_the_work_of_one_backward():
    """Zero-bubble's BI + BW: the same gradients as one backward, and the same FLOPs between them;
    every linear's weight gradient waits for BW but the head's."""
    from torch.utils.flop_counter import FlopCounterMode

    from tetrad.model.llama import Transformer
    from tetrad.dist.topology import Topology
    from tetrad.model.execution import Execution

    cfg = tiny_config()
    ex = Execution(split_backward=True)
    torch.manual_seed(0)
    model = Transformer(cfg.model, Topology.single(), execution=ex)
    for p in model.parameters():
        torch.nn.init.normal_(p, std=0.02)
    tokens = torch.randint(0, cfg.model.vocab_size, (2, cfg.model.seq_len))
    positions = torch.arange(cfg.model.seq_len)

    def flops(fn):
        with FlopCounterMode(display=False) as counter:
            fn()
        return counter.get_total_flops()
    loss = model(tokens, positions, tokens)
    full = flops(lambda: loss.backward())
    reference = {n: p.grad.clone() for n, p in model.named_parameters()}
    model.zero_grad(set_to_none=True)
    loss = model(tokens, positions, tokens)
    with ex.weight_grads.collecting() as deferred:
        input_half = flops(lambda: loss.backward())
    linears = [n for n in reference if ".attn.w" in n or ".mlp.w" in n]
    assert linears and all(model.get_parameter(n).grad is None for n in linears)  # they wait for BW
    assert model.get_parameter("head.weight").grad is not None  # made in BI: it needs the logits' gradient

    weight = flops(lambda: ex.weight_grads.apply(deferred))
    assert weight > 0.3 * full and input_half + weight == full
    for name, grad in reference.items():
        torch.testing.assert_close(model.get_parameter(name).grad, grad, rtol=1e-6, atol=1e-7, msg=name)


def test_layer_split_is_balanced_or_explicit():
    cfg = load_config(overrides={"model": {"preset": "llama3-405b"}, "parallel": {"pp": 16}}, runtime=False)
    split = layer_split(cfg)
    assert len(split) == 16 and split[0].start == 0 and split[-1].stop == 126
    assert all(a.stop == b.start for a, b in zip(split, split[1:]))
    assert max(len(r) for r in split) - min(len(r) for r in split) <= 2
    explicit = [7] + [8] * 14 + [7]
    cfg = load_config(overrides={"model": {"preset": "llama3-405b"}, "parallel": {"pp": 16, "stage_layers": explicit}},
                      runtime=False)
    assert [len(r) for r in layer_split(cfg)] == explicit


@pytest.mark.parametrize("overrides,message", [
    ({"parallel": {"pp": 4}, "train": {"global_batch": 8, "micro_batch": 4}, "model": {"n_layers": 4}}, None),
    ({"parallel": {"pp": 2, "vpp": 2, "schedule": "interleaved"}, "train": {"global_batch": 4, "micro_batch": 4}},
     "needs at least 2 micro-batches"),
    ({"parallel": {"pp": 8}, "model": {"n_layers": 4}}, "fewer than pp\\*vpp"),
    ({"parallel": {"pp": 2, "stage_layers": [1, 2]}, "model": {"n_layers": 4}}, "adding up to n_layers=4"),
])
def test_bad_pipeline_config_is_refused(overrides, message):
    if message is None:  # 1f1b and gpipe run with fewer micro-batches than stages
        check_config(load_config(overrides=overrides))
        return
    with pytest.raises(ConfigError, match=message):
        check_config(load_config(overrides=overrides))


# Configs load_config accepts and the schedule registry refuses: an unknown schedule, a vpp the
# schedule does not run, too few micro-batches (1) for interleaving at pp=2.
REGISTRY_REFUSES = [{"parallel": {"pp": 2, "schedule": "Interleaved1F1B"}},
                    {"parallel": {"pp": 2, "vpp": 2, "schedule": "gpipe"}},
                    {"parallel": {"pp": 2, "vpp": 2, "schedule": "interleaved"},
                     "train": {"global_batch": 4, "micro_batch": 4}}]


@pytest.mark.parametrize("sections", REGISTRY_REFUSES)
def test_trainer_refuses_as_the_cli_does(sections):
    """A library user's Trainer gets `tetrad train`'s ConfigError, not build_schedule's ScheduleError."""
    cfg = tiny_config(model={"n_layers": 4}, **sections)
    with pytest.raises(ConfigError) as cli:
        check_config(cfg)
    with pytest.raises(ConfigError) as trainer:
        Trainer(cfg, torch.device("cpu"))
    assert str(trainer.value) == str(cli.value)


def _die_mid_schedule(cfg):
    """Rank 1 raises in its third action; rank 0 is then blocked in a receive."""
    trainer = Trainer(cfg, torch.device("cpu"))
    if dist.get_rank() == 1:
        original = trainer.model.forward
        calls = []

        def failing(*args, **kwargs):
            calls.append(1)
            if len(calls) == 3:
                raise RuntimeError("injected failure in the middle of the schedule")
            return original(*args, **kwargs)
        trainer.model.forward = failing
    trainer.fit()


def test_a_rank_dying_mid_schedule_ends_the_run():
    cfg = tiny_config(model={"n_layers": 4}, parallel={"pp": 2}, train={"micro_batch": 1, "global_batch": 4, "steps": 2})
    with pytest.raises(launch.RankFailure, match="injected failure in the middle of the schedule"):
        run_ranks(_die_mid_schedule, 2, cfg, timeout_s=120)
