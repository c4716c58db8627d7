"""Multi-token prediction (model.mtp_layers > 0, model/mtp.py): a depth's loss is the spec's (the
embedding first in the concat, the target k + 1 ahead), computed here in plain torch from the
module's weights; the step's gradient is that of main / N + w / D * sum_k Loss_k / N; every layout
trains as one process does (the depths on the last stage, the embedding's copy there, the targets
packed before cp sharding, recomputed, their MoE layers' expert biases moved, fp16's loss scale
reaching them) and reports the same mtp_loss; what it cannot take is refused in one
line; generation from an MTP run's checkpoint is the main model's."""

import json
from functools import lru_cache, partial

import pytest
import torch
import torch.nn.functional as F

from conftest import assert_parity, doc_shards, first_step_gradients, grad_norms, run_ranks, sft_shards, tiny_config, train_layout
from nccl_collectives import NcclTrainer
from nccl_semantics import NcclSemantics
from test_latent_attention import DS3
from tetrad.cli import main
from tetrad.config import ConfigError
from tetrad.dist.topology import Topology
from tetrad.model.layers import IGNORED_LABEL
from tetrad.model.llama import Transformer
from tetrad.model.moe import expert_biases
from tetrad.model.mtp import pack_targets
from tetrad.model.sharding import init_parameters
from tetrad.train.generate import generate, load_generator
from tetrad.train.trainer import Trainer

MTP = {"mtp_layers": 2, "mtp_loss_weight": 0.5, "n_layers": 4}


def _model(seed: int = 1, **model) -> Transformer:
    net = Transformer(tiny_config(model={**MTP, **model}).model, Topology.single())
    init_parameters(net, seed=seed)
    with torch.no_grad():  # norms unequal to one and to each other: a swapped concat shows
        for i, p in enumerate(q for name, q in net.named_parameters() if name.endswith("norm.weight")):
            p.uniform_(0.5, 1.5, generator=torch.Generator().manual_seed(i))
    return net


def _rms(x, weight, eps):
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * weight


def _reference_losses(net: Transformer, x: torch.Tensor, y: torch.Tensor, swapped: bool = False,
                      unnormed: bool = False) -> list[torch.Tensor]:
    """Each depth's summed loss by the spec, from inputs `x` and labels `y` [b, s] (IGNORED_LABEL
    where the loss leaves one out): h^0 the main model's output (after the final norm; `unnormed`:
    before it), then per depth in plain torch but for its block, the head the embedding where tied."""
    eps, s = net.cfg.norm_eps, x.shape[1]
    head = net.embed.weight if net.head is None else net.head.weight
    rope = net.rope(torch.arange(s))
    h = F.embedding(x, net.embed.weight)
    for block in net.layers.values():
        h = block(h, rope)
    h = h if unnormed else _rms(h, net.norm.weight, eps)
    losses = []
    for k, depth in enumerate(net.mtp, 1):
        e = F.embedding(torch.cat([x[:, k:], x.new_zeros(x.shape[0], k)], 1), net.embed.weight)
        parts = [_rms(e, depth.enorm.weight, eps), _rms(h, depth.hnorm.weight, eps)]
        h = depth.block(torch.cat(parts[::-1] if swapped else parts, -1) @ depth.eh_proj.weight.T, rope)
        logits = _rms(h, depth.norm.weight, eps) @ head.T
        # position i predicts y[i + k] (token i + k + 1): positions 0 .. s - k - 1 have one
        losses.append(F.cross_entropy(logits[:, :s - k].flatten(0, 1), y[:, k:].flatten(), reduction="sum",
                                      ignore_index=IGNORED_LABEL))
    return losses


def _tokens(b=2, s=16, seed=0):
    return torch.randint(0, 256, (b, s + 1), generator=torch.Generator().manual_seed(seed))


@pytest.mark.parametrize("tied", [False, True])
def test_a_depths_loss_is_the_specs(tied):
    """The recorded sums are the plain-torch ones (tied: the embedding the depths' head), and not
    those of the hidden state first or of the main model's output before its final norm."""
    net, seq = _model(tie_embeddings=tied), _tokens()
    x, y = seq[:, :-1], seq[:, 1:]
    assert (net.head is None) == tied
    net(x, torch.arange(16), pack_targets(x, y, 2))
    sums, counts = net.execution.mtp_loss.take()
    with torch.no_grad():
        ref, swapped = _reference_losses(net, x, y), _reference_losses(net, x, y, swapped=True)
    torch.testing.assert_close(sums, torch.stack(ref), rtol=1e-5, atol=1e-5)
    assert counts.tolist() == [2 * 15, 2 * 14]
    assert (torch.stack(swapped) - sums).abs().min() > 1e-3
    with torch.no_grad():
        unnormed = _reference_losses(net, x, y, unnormed=True)
    assert (torch.stack(unnormed) - sums).abs().min() > 1e-3


def test_packed_targets_roll_the_inputs_and_labels_and_mask_past_the_window_and_documents():
    x = torch.tensor([[5, 6, 7, 8, 9]])
    y = torch.tensor([[6, IGNORED_LABEL, 8, 9, 10]])  # a masked label (SFT's prompt) stays masked
    docs = torch.tensor([[0, 0, 0, 1, 1]])
    packed = pack_targets(x, y, 2, docs)
    assert packed.shape == (1, 5, 5) and packed.dtype == torch.int64
    n = IGNORED_LABEL
    assert packed[0].tolist() == [[6, n, 8, 9, 10],
                                  [6, 7, 8, 9, 0], [n, 8, n, 10, n],  # depth 1: 2 -> 3 crosses a document
                                  [7, 8, 9, 0, 0], [8, n, n, n, n]]


@pytest.mark.parametrize("data", ["bytes", "sft"])
def test_the_steps_gradient_is_the_objectives(data):
    """One process's first-step gradient (fp32, ZeRO-0: p.grad) is autograd's of main / N +
    w / D * sum_k Loss_k / N over the step's micro-batches, the depths' losses the reference's; N
    the step's loss_tokens, fewer than its tokens where the loss masks prompts (sft)."""
    cfg = tiny_config(model=MTP, data={"source": sft_shards()} if data == "sft" else {})
    trainer = Trainer(cfg, torch.device("cpu"))
    net = _model()
    net.load_state_dict({name: p.detach() for name, p in trainer.model.named_parameters()})
    micro = trainer.batches.microbatches(0, 0, 1, cfg.train.micro_batch)
    n = trainer.batches.loss_tokens(0)
    assert (n < cfg.train.global_batch * cfg.model.seq_len) == (data == "sft")
    trainer.forward_backward(micro, n)
    trainer.grads.reduce()
    objective = 0
    for x, y in micro:
        objective = objective + (net(x, torch.arange(x.shape[1]), y) + 0.5 / 2 * sum(_reference_losses(net, x, y))) / n
    objective.backward()
    ours = dict(trainer.model.named_parameters())
    for name, p in net.named_parameters():
        torch.testing.assert_close(ours[name].grad, p.grad, rtol=1e-4, atol=1e-7, msg=name)
    assert net.mtp[1].eh_proj.weight.grad.abs().max() > 0


# family -> (model, train, data)
FAMILIES = {"mtp": (MTP, {}), "mtpdocs": (MTP, {"document_mask": True}),
            "mtptied": ({**MTP, "tie_embeddings": True}, {}),
            "mtpmoe": ({**MTP, "n_experts": 4, "experts_per_token": 2, "router_aux_loss": 0.1}, {}),
            "mtpds3": ({**MTP, **DS3}, {}),
            "mtpbias": ({**MTP, "n_experts": 4, "experts_per_token": 2, "router_bias_update_rate": 0.01}, {}),
            "mtpfp16": (MTP, {"dtype": "fp16"})}
LAYOUTS = {
    "mtp-dp2": {"dp": 2},
    "mtp-tp2": {"tp": 2},  # eh_proj's gradient whole on every tp rank
    "mtp-tp2-sp": {"tp": 2, "sequence_parallel": True},  # ... summed over tp
    "mtpdocs-cp2-ring": {"cp": 2, "cp_algo": "ring"},  # the targets rolled before sharding
    "mtpdocs-cp2-alltoall": {"cp": 2, "cp_algo": "alltoall"},
    "mtp-pp2-1f1b": {"pp": 2, "schedule": "1f1b"},  # the embedding's copy on the last stage
    "mtp-pp2-zb": {"pp": 2, "schedule": "zb"},
    "mtp-pp2-vpp2": {"pp": 2, "vpp": 2, "schedule": "interleaved"},
    "mtp-dp2-pp2-zb-zero2": {"dp": 2, "pp": 2, "schedule": "zb", "zero": 2},
    "mtp-tp2-sp-full": {"tp": 2, "sequence_parallel": True},  # recompute (RECOMPUTE): the depths' forward again
    "mtp-dp2-selop": {"dp": 2},
    "mtp-dp2-zero3": {"dp": 2, "zero": 3},  # the depths' blocks gathered as blocks
    "mtp-dp2-pp2-zero3": {"dp": 2, "pp": 2, "zero": 3},
    "mtptied-dp2-pp2-zero1": {"dp": 2, "pp": 2, "zero": 1},  # one copy: the head's and the depths' inputs
    "mtptied-tp2-sp-pp2-zb": {"tp": 2, "sequence_parallel": True, "pp": 2, "schedule": "zb"},
    "mtpmoe-dp2-ep2": {"dp": 2, "ep": 2},
    "mtpds3-pp2": {"pp": 2},
    "mtpds3-tp2-sp": {"tp": 2, "sequence_parallel": True},
}


RECOMPUTE = {"mtp-tp2-sp-full": "full", "mtp-dp2-selop": "selective-op"}  # layout -> train.recompute


def _config(family: str, parallel: dict, recompute: str = "none"):
    model, train = FAMILIES[family]
    data = {"source": doc_shards()} if train.get("document_mask") else {}
    return tiny_config(parallel=parallel, model=model, train={**train, "recompute": recompute}, data=data)


class _WithBiases(Trainer):
    """full_state with each MoE layer's expert bias (`<layer>.expert_bias`)."""

    def full_state(self):
        biases = {f"{name}.expert_bias": b.cpu().clone() for name, b in expert_biases(self.model).items()}
        return {**super().full_state(), **biases}


@lru_cache(maxsize=None)
def _one_process(family: str):
    return train_layout(_config(family, {}), trainer_class=_WithBiases)


def _assert_parity_and_mtp_loss(got, ref, atol):
    assert_parity(got, ref, atol=atol)
    ahead = torch.tensor([r["mtp_loss"] for r in got[2]])
    assert ahead.shape == (len(got[2]), 2)
    torch.testing.assert_close(ahead, torch.tensor([r["mtp_loss"] for r in ref[2]]), rtol=1e-5, atol=1e-6)


@pytest.mark.dist
@pytest.mark.parametrize("name", LAYOUTS)
def test_layout_matches_single_process(name):
    family = name.split("-")[0]
    got = train_layout(_config(family, LAYOUTS[name], RECOMPUTE.get(name, "none")), trainer_class=_WithBiases)
    # Gradient elements near Adam's eps, whose updates amplify another order of sums: mtpdocs, an
    # embedding row first used at step 3 (the ring's sums differ by 3e-8 on it, the update by up to
    # 4e-4); mtpds3 under tp2 SP, experts with gradient elements down to 3e-9 (the first step's
    # gradients differ by 2e-8 at most, the state after 5 steps by up to 1.5e-4). Their first-step
    # gradients are compared tightly below.
    _assert_parity_and_mtp_loss(got, _one_process(family), {"mtpdocs": 5e-4, "mtpds3": 2e-4}.get(family, 1e-4))


@pytest.mark.dist
def test_the_depths_expert_bias_moves_as_one_process_s():
    """router_bias_update_rate > 0: each depth's MoE layer's expert bias moves, under dp2 x ep2
    exactly as in one process (its counts summed over the job), the weights and mtp_loss alike."""
    got = train_layout(_config("mtpbias", {"dp": 2, "ep": 2}), trainer_class=_WithBiases)
    ref = _one_process("mtpbias")
    _assert_parity_and_mtp_loss(got, ref, 1e-4)
    for k in range(MTP["mtp_layers"]):
        name = f"mtp.{k}.block.mlp.expert_bias"
        assert torch.equal(got[1][name], ref[1][name]) and ref[1][name].abs().min() > 0, name


@pytest.mark.dist
def test_fp16_s_loss_scale_reaches_the_depths():
    """train.dtype fp16: a dp2 ZeRO-1 layout takes one fp16 process's steps and mtp_loss, whose first
    gradient norm is fp32's (test_precision's bound): the depths' injected gradient carries the loss
    scale (MTPLoss.grad_scale) that unscaling divides by, else it would be 2^-16 of theirs."""
    got, ref = train_layout(_config("mtpfp16", {"dp": 2, "zero": 1})), _one_process("mtpfp16")
    scales = [(r["loss_scale"], r["skipped"]) for r in got[2]]
    assert scales == [(r["loss_scale"], r["skipped"]) for r in ref[2]] and scales[0] == (2.0**16, False)
    # fp16 activations summed in another order over dp: 1.8e-5 apart at most (measured), bound at 2e-4
    torch.testing.assert_close(torch.tensor(got[0]), torch.tensor(ref[0]), rtol=0, atol=2e-4)
    torch.testing.assert_close(torch.tensor([r["mtp_loss"] for r in got[2]]),
                               torch.tensor([r["mtp_loss"] for r in ref[2]]), rtol=0, atol=2e-4)
    torch.testing.assert_close(grad_norms(got[2])[0], grad_norms(ref[2])[0], rtol=2e-4, atol=0)
    torch.testing.assert_close(grad_norms(ref[2])[0], grad_norms(_one_process("mtp")[2])[0], rtol=2e-4, atol=0)


@pytest.mark.dist
@pytest.mark.parametrize("family, parallel", [("mtpdocs", {"cp": 2, "cp_algo": "ring"}),
                                              ("mtpdocs", {"cp": 2, "cp_algo": "alltoall"}),
                                              ("mtpds3", {"tp": 2, "sequence_parallel": True})])
def test_the_first_step_gradient_is_one_process_s(family, parallel):
    """mtpdocs: the targets rolled over the whole window before sharding, masked across documents;
    mtpds3: latent attention and experts under tp2 SP."""
    got = first_step_gradients(_config(family, parallel))
    ref = first_step_gradients(_config(family, {}))
    for name in ref:
        torch.testing.assert_close(got[name], ref[name], rtol=1e-4, atol=1e-7, msg=name)


@pytest.mark.dist
def test_pp2_under_nccl_semantics_matches_single_process():
    """The embedding copy's sum over "embed" and the last stage's extra work under NCCL's ordering of
    point-to-point and timing of collectives (tests/nccl_semantics.py, nccl_collectives.py)."""
    cfg = _config("mtp", {"dp": 2, "pp": 2, "schedule": "zb", "zero": 1})
    got = train_layout(cfg, transport=partial(NcclSemantics, timeout_s=20), trainer_class=NcclTrainer)
    got[2][-1].pop("posted")
    _assert_parity_and_mtp_loss(got, _one_process("mtp"), 1e-4)


def test_the_depths_train_and_the_loss_is_the_main_ones():
    """Every MTP weight moves; `loss` is the main LM loss: the same first-step loss as without MTP."""
    _, state, history = _one_process("mtp")
    start = Transformer(tiny_config(model=MTP).model, Topology.single())
    init_parameters(start, seed=0)
    moved = {name: (state[name] - p).abs().max() > 0 for name, p in start.state_dict().items()
             if name.startswith("mtp.")}
    assert len(moved) == 2 * 13 and all(moved.values())
    plain = Trainer(tiny_config(model={**MTP, "mtp_layers": 0}, train={"steps": 1}), torch.device("cpu")).fit()
    assert history[0]["loss"] == pytest.approx(plain[0]["loss"], rel=1e-6)
    assert all(last < first for first, last in zip(history[0]["mtp_loss"], history[-1]["mtp_loss"]))


@pytest.mark.parametrize("keys, fix", [({"layer_types": ["full_attention"] * 4}, "unset model.layer_types"),
                                       ({"pos": "learned"}, "set model.pos='rope'")])
def test_what_the_depths_cannot_take_is_refused_in_one_line(keys, fix):
    with pytest.raises(ConfigError, match=rf"^[^\n]*{fix} or set model.mtp_layers=0$"):
        tiny_config(model={**MTP, **keys})


def test_generation_from_an_mtp_checkpoint_is_the_main_models(tmp_path):
    """`tetrad generate`'s model of an MTP run leaves the depths out (generation computes none: on
    DeepSeek-V3 they are 14B parameters) and holds its other trained weights, giving their text."""
    cfg = tiny_config(model=MTP, train={"steps": 2}, checkpoint={"every": 2}, run={"dir": str(tmp_path)})
    trainer = Trainer(cfg, torch.device("cpu"))
    trainer.fit()
    trained = trainer.full_state()
    model, _, _ = load_generator(tmp_path)
    loaded = dict(model.named_parameters())
    assert model.mtp is None and not any(name.startswith("mtp.") for name in loaded)
    assert all(torch.equal(loaded[name], p) for name, p in trained.items() if not name.startswith("mtp."))
    plain = Transformer(tiny_config(model={**MTP, "mtp_layers": 0}).model, Topology.single()).eval()
    plain.load_state_dict({name: p for name, p in trained.items() if not name.startswith("mtp.")})
    prompt = [3, 1, 4, 1, 5]
    tokens, _ = generate(model, prompt, 8)
    assert len(tokens) == 8 and tokens == generate(plain, prompt, 8)[0]


def test_eval_of_an_mtp_checkpoint_is_its_val_loss_at_pp2(tmp_path, capsys):
    """`tetrad eval` of an MTP run (the main loss alone) at pp2, the last stage loading its
    embedding copy, is the val_loss its last step logged."""
    run = tmp_path / "run"
    flags = ["--model.n_layers=2", "--model.d_model=64", "--model.n_heads=4", "--model.n_kv_heads=2",
             "--model.ffn_hidden=128", "--model.seq_len=32", "--model.mtp_layers=1", "--train.global_batch=4",
             "--train.micro_batch=2"]
    assert main(["train", *flags, "--train.steps=2", "--train.eval_every=2", "--data.val_fraction=0.1",
                 "--checkpoint.every=2", f"--run.dir={run}"]) == 0
    logged = json.loads((run / "metrics.jsonl").read_text().splitlines()[-1])
    capsys.readouterr()
    assert main(["eval", str(run), "--parallel.pp=2", "--json"]) == 0
    got = json.loads(capsys.readouterr().out.strip().splitlines()[-1])["val_loss"]
    assert len(logged["mtp_loss"]) == 1 and got == pytest.approx(logged["val_loss"], rel=1e-5)


def test_the_depths_moe_layers_join_the_load_balancing_mean():
    """A depth's MoE layer counts in the load-balancing loss's mean (model.routed_layers), as
    Megatron-LM counts mtp_num_layers: near its balanced value 1 at initialisation, where dividing
    the depths' sums by the main layers' count alone gives (n_layers + D) / n_layers of it."""
    m = _config("mtpmoe", {}).model
    assert (m.moe_layers, m.routed_layers) == (m.n_layers, m.n_layers + m.mtp_layers)
    _, _, history = _one_process("mtpmoe")
    assert 0.9 < history[0]["moe_aux_loss"] < 1.3


def _gathered_depth_buckets(cfg) -> tuple[set, set]:
    """This rank's ZeRO-3 buckets of the depths' blocks gathered (started or awaited) in a training
    step, and in a validation pass after it."""
    trainer = Trainer(cfg, torch.device("cpu"))
    gather = trainer.grads.zero3
    depths = {i for k in range(len(trainer.model.layers), len(gather.block_buckets)) for i in gather.block_buckets[k]}
    seen = set()
    for name in ("start", "gather"):
        original = getattr(gather, name)
        setattr(gather, name, lambda i, original=original: (seen.add(i), original(i))[1])
    trainer.train_step(0)
    trained, seen = seen & depths, set()
    trainer.evaluate()
    return trained, seen & depths


@pytest.mark.dist
def test_zero3_validation_gathers_no_depth_block():
    """The depths run in training alone: validation's forward prefetches none of their blocks
    (whose all-gathers it would hold to its end), where a training step gathers them all."""
    cfg = tiny_config(model=MTP, parallel={"dp": 2, "zero": 3}, train={"steps": 1, "eval_steps": 1},
                      data={"val_fraction": 0.1})
    for trained, evaluated in run_ranks(_gathered_depth_buckets, 2, cfg):
        assert trained and not evaluated
