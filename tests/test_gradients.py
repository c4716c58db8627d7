"""The parity net itself: gradients compared directly, and a deliberately wrong gradient scale
(summed over dp instead of averaged) that the loss and parameter checks alone let through."""

from collections import Counter
from unittest import mock

import pytest
import torch

import tetrad.parallel.data
from conftest import assert_parity, first_step_gradients, grad_norms, run_ranks, tiny_config, train_layout
from tetrad.dist.topology import Topology
from tetrad.model import execution, mappings
from tetrad.model.execution import GRAD_SINK, run_eagerly
from tetrad.parallel.data.lifecycle import GradSync
from tetrad.train.trainer import Trainer

pytestmark = pytest.mark.dist

# First-step gradients only differ in the order of their sums (ranks, micro-batches, tp pieces,
# sequence chunks): ~1e-7 relative of each gradient's scale.
LAYOUTS = [{"dp": 2}, {"tp": 2}, {"tp": 2, "sequence_parallel": True}, {"cp": 2}, {"pp": 2},
           {"dp": 2, "pp": 2, "tp": 2}]
MODEL = {"n_kv_heads": 4, "tie_embeddings": True, "vocab_size": 258}  # tp's replicated and tied sums


@pytest.fixture(scope="module")
def reference_gradients():
    return first_step_gradients(tiny_config(model=MODEL))


@pytest.mark.parametrize("parallel", LAYOUTS, ids=lambda p: "-".join(f"{k}{v}" for k, v in p.items()))
def test_reduced_gradients_match_single_process(reference_gradients, parallel):
    grads = first_step_gradients(tiny_config(model=MODEL, parallel=parallel))
    assert grads.keys() == reference_gradients.keys()
    for name, ref in reference_gradients.items():
        scale = float(ref.abs().max())
        assert scale > 0, name  # every parameter gets a gradient: the comparison is not vacuous
        torch.testing.assert_close(grads[name], ref, rtol=1e-5, atol=1e-5 * scale, msg=name)


def _sunk_weights(cfg) -> list[str]:
    trainer = Trainer(cfg, torch.device("cpu"))
    return [name for name, p in trainer.model.named_parameters() if hasattr(p, GRAD_SINK)]


def _sink_writes(cfg) -> tuple[int, int]:
    """(the sink's writes in one step, this rank's sunk weights x its micro-batches)."""
    with mock.patch.object(GradSync, "_sink", autospec=True, side_effect=GradSync._sink) as sink:
        trainer = Trainer(cfg, torch.device("cpu"))
        trainer.train_step(0)
    sunk = sum(hasattr(p, GRAD_SINK) for p in trainer.model.parameters())
    return sink.call_count, sunk * cfg.microbatches


# The sink also writes zero-bubble's deferred weight gradients (in BW) and the column-parallel
# ones of tp's shared-input matmul.
FUSED_LAYOUTS = [{"dp": 2}, {"tp": 2}, {"tp": 2, "sequence_parallel": True}, {"pp": 2, "schedule": "zb"}, {"dp": 2, "pp": 2, "schedule": "zb"}]


@pytest.mark.parametrize("parallel", FUSED_LAYOUTS, ids=lambda p: "-".join(f"{k}{v}" for k, v in p.items()))
def test_fused_linear_gradients_match_autograds(reference_gradients, monkeypatch, parallel):
    # Gradient accumulation fusion against autograd's linear: the tiny model's weights are below
    # SINK_MIN_NUMEL (the reference ran unfused), so lower it to fuse every linear; micro_batch 1
    # accumulates several micro-batches per rank (the sink's first write and its later adds).
    assert run_ranks(_sunk_weights, 1, tiny_config(model=MODEL))[0] == []
    monkeypatch.setattr(tetrad.parallel.data, "SINK_MIN_NUMEL", 0)  # forked ranks inherit it
    assert len(run_ranks(_sunk_weights, 1, tiny_config(model=MODEL))[0]) == 2 * 7  # q k v o, w1 w2 w3
    cfg = tiny_config(model=MODEL, parallel=parallel, train={"micro_batch": 1})
    for writes, expected in run_ranks(_sink_writes, cfg.parallel.world_size, cfg):
        assert writes == expected > 0
    grads = first_step_gradients(cfg)
    for name, ref in reference_gradients.items():
        torch.testing.assert_close(grads[name], ref, rtol=1e-5, atol=1e-5 * float(ref.abs().max()), msg=name)


def _backward_nodes(cfg) -> Counter:
    """How many autograd nodes of each kind one micro-batch's loss hangs on."""
    trainer = Trainer(cfg, torch.device("cpu"))
    x, y = trainer.batches.microbatches(0, 0, 1, cfg.train.micro_batch)[0]
    seen, todo = set(), [trainer.model(x, trainer.positions, y).grad_fn]
    while todo:
        node = todo.pop()
        if node is not None and node not in seen:
            seen.add(node)
            todo.extend(n for n, _ in node.next_functions)
    return Counter(type(n).__name__ for n in seen)


def test_shared_input_linears_partly_sunk_run_as_one_function_at_tp1(monkeypatch):
    # bench_pp's model at d_model 256: wq and the SwiGLU gates are sunk, wk and wv (half wq's
    # size under GQA) are not. Each group runs as one _ColumnParallelMatmul, as under tp, not one
    # Python Function per sunk weight (mappings.py `_sinks_a_group`); the gradients are autograd's.
    model = {**MODEL, "n_kv_heads": 2}
    reference = first_step_gradients(tiny_config(model=model))  # below SINK_MIN_NUMEL: no sinks
    monkeypatch.setattr(tetrad.parallel.data, "SINK_MIN_NUMEL", 64 * 64)  # wq, wo, w1-w3; not wk, wv
    nodes = run_ranks(_backward_nodes, 1, tiny_config(model=model))[0]
    assert nodes["_ColumnParallelMatmulBackward"] == 2 * 2  # q/k/v and the gates of 2 layers
    assert nodes["_LinearBackward"] == 2 * 2  # wo and w2
    grads = first_step_gradients(tiny_config(model=model, parallel={"dp": 2}, train={"micro_batch": 1}))
    for name, ref in reference.items():
        torch.testing.assert_close(grads[name], ref, rtol=1e-5, atol=1e-5 * float(ref.abs().max()), msg=name)


def test_run_eagerly_outside_torch_compile_is_a_plain_call():
    # torch.compiler.disable's wrapper cost ~60 us a call in a stage's forward (cold caches after
    # a GEMM), 0.5 ms of bench_pp's 25 ms F: run_eagerly enters it only under torch.compile
    # (test_compile: its graph breaks). Here a sunk q/k/v-like group and zero-bubble's split linear.
    torch.manual_seed(0)
    x = torch.randn(2, 3, 4, requires_grad=True)
    weights = [torch.nn.Parameter(torch.randn(5, 4)) for _ in range(2)]
    sunk = torch.zeros(5, 4)
    setattr(weights[0], GRAD_SINK, lambda a, b: sunk.add_(a @ b))
    with mock.patch.object(execution, "_run_eagerly_untraced", wraps=execution._run_eagerly_untraced) as wrapper:
        group = mappings.column_parallel_linears(x, weights, Topology.single(), execution.Execution())
        split = mappings.linear(x, weights[1], execution.Execution(split_backward=True))
    assert [type(y.grad_fn).__name__ for y in (*group, split)] == ["_ColumnParallelMatmulBackward"] * 2 + ["_LinearBackward"]
    assert wrapper.call_count == 0
    for y, w in zip((*group, split), (*weights, weights[1])):
        torch.testing.assert_close(y, torch.nn.functional.linear(x, w), rtol=0, atol=0)
    sum(y.sum() for y in group).backward()
    torch.testing.assert_close(sunk, torch.ones(6, 5).t() @ x.detach().reshape(6, 4))


def test_run_eagerly_under_torch_compile_is_a_graph_break():
    """The other half: while dynamo traces, run_eagerly's call is a clean graph break (the
    communicating Functions never enter a graph), with run_eagerly named as its reason."""
    def f(x):
        return run_eagerly(torch.sin, x * 2) + 1

    explained = torch._dynamo.explain(f)(torch.randn(3))
    assert explained.graph_break_count == 1 and explained.graph_count == 2, explained
    assert any("run_eagerly" in str(b.reason) or "run_eagerly" in str(b.user_stack)
               for b in explained.break_reasons), explained.break_reasons


class SummingTrainer(Trainer):
    """The bug the norm check is for: each dp rank normalises its loss by its own tokens, so the
    dp all-reduce sums dp per-rank means: the gradient is dp times the true one, every step."""

    def forward_backward(self, microbatches, loss_tokens: int, grad_scale: float = 1.0):
        return super().forward_backward(microbatches, loss_tokens, grad_scale * self.cfg.parallel.dp)


def test_a_doubled_dp_gradient_fails_parity():
    ref = train_layout(tiny_config())
    got = train_layout(tiny_config(parallel={"dp": 2}), trainer_class=SummingTrainer)
    torch.testing.assert_close(grad_norms(got[2]), 2 * grad_norms(ref[2]), rtol=1e-5, atol=0)
    # The losses and final parameters alone cannot tell (clipping and AdamW cancel the factor).
    torch.testing.assert_close(torch.tensor(got[0]), torch.tensor(ref[0]), rtol=1e-5, atol=1e-6)
    for name in ref[1]:
        torch.testing.assert_close(got[1][name], ref[1][name], rtol=1e-4, atol=1e-5, msg=name)
    with pytest.raises(AssertionError, match="grad_norm"):
        assert_parity(got, ref)
