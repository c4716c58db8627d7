"""Multi-head latent attention (model.kv_lora_rank > 0, model/latent_attention.py): its output is
transformers' DeepseekV3Attention's with the same weights (with and without the q latent); every
layout trains it as one process does (its replicated down projections and latent norms, under tp
with and without SP; values padded to the q/k width through the ring and all-to-all); decoding
over the cached latents gives the full forward's logits; the keys it does not take are refused
in one line; under DeepSeek-V3's YaRN its softmax scale is transformers' (tests/test_deepseek_hf.py
imports YaRN models whole); heads of an odd width train."""

from functools import lru_cache, partial

import pytest
import torch
from torch.nn.attention import SDPBackend, sdpa_kernel
from torch.utils import _pytree as pytree
from torch.utils._python_dispatch import TorchDispatchMode

from conftest import assert_parity, doc_shards, run_ranks, tiny_config, train_layout
from nccl_collectives import NcclTrainer
from nccl_semantics import NcclSemantics
from test_generate_batch import PROMPTS, SAMPLINGS, _alone, _batch_on_this_rank, _early_stop, _sharp
from tetrad.config import ConfigError
from tetrad.dist.topology import Topology
from tetrad.model import flops
from tetrad.model.llama import Transformer
from tetrad.model.sharding import init_parameters
from tetrad.train.batched import generate_batch
from tetrad.train.checkpoint import CheckpointError
from tetrad.train.trainer import Trainer

# 4 heads of q/k width 12 + 4 = 16 over d_model 64; values 12 wide (padded to 16 in the core)
MLA = {"kv_lora_rank": 16, "q_lora_rank": 24, "qk_nope_head_dim": 12, "qk_rope_head_dim": 4, "v_head_dim": 12,
       "n_kv_heads": 4}
FULL_Q = {**MLA, "q_lora_rank": 0}  # DeepSeek-V2-Lite's: no q latent
# family (a layout name's first word) -> (model, train keys that change the training: its reference's)
# DeepSeek-V3's whole layer: latent attention over an MoE with its routing and shared expert
DS3 = {**MLA, "n_experts": 4, "experts_per_token": 2, "router_score": "sigmoid", "expert_groups": 2,
       "expert_groups_per_token": 1, "expert_weight_scale": 2.5, "router_aux_loss": 1.0, "shared_expert_ffn_hidden": 32}
FAMILIES = {"mla": (MLA, {}), "mlaq": (FULL_Q, {}), "mladocs": (MLA, {"document_mask": True}), "mlads3": (DS3, {})}
LAYOUTS = {  # name -> (parallel, train keys that leave the training alone)
    "mla-tp2": ({"tp": 2}, {}),  # the replicated weights' gradients whole on every rank without SP
    "mla-tp2-sp": ({"tp": 2, "sequence_parallel": True}, {}),  # the latents gathered; those gradients summed
    "mlaq-tp2-sp": ({"tp": 2, "sequence_parallel": True}, {}),
    "mla-cp2-ring": ({"cp": 2, "cp_algo": "ring"}, {}),
    "mla-cp2-alltoall": ({"cp": 2, "cp_algo": "alltoall"}, {}),
    "mla-pp2-zb": ({"pp": 2, "schedule": "zb"}, {}),  # the down projections' weight gradients deferred to BW
    "mla-dp2-tp2-sp-zero1": ({"dp": 2, "tp": 2, "sequence_parallel": True, "zero": 1}, {}),
    "mla-dp2-zero3": ({"dp": 2, "zero": 3}, {}),
    "mla-cp2-ring-selective-op": ({"cp": 2, "cp_algo": "ring"}, {"recompute": "selective-op"}),
    "mla-tp2-sp-selective": ({"tp": 2, "sequence_parallel": True}, {"recompute": "selective"}),
    "mla-tp2-compile": ({"tp": 2}, {"compile": True}),
    "mladocs-cp2-ring": ({"cp": 2, "cp_algo": "ring"}, {}),  # the ring's masked blocks, values padded
    # the replicated weights beside sharded experts: ZeRO-3 gathers, SP's sums, EP's all-to-alls
    "mlads3-dp2-tp2-sp-ep2-zero3": ({"dp": 2, "tp": 2, "sequence_parallel": True, "ep": 2, "zero": 3}, {}),
}


def _model(model: dict, seed: int = 1) -> Transformer:
    net = Transformer(tiny_config(model=model).model, Topology.single())
    init_parameters(net, seed=seed)
    return net


# DeepSeek-V3's YaRN: the softmax scale times mscale(40, 1) ** 2 = 1.8738 (rope.yarn_softmax_factor)
V3_YARN = {"rope_type": "yarn", "factor": 40, "original_max_position_embeddings": 4096, "beta_fast": 32,
           "beta_slow": 1, "mscale": 1.0, "mscale_all_dim": 1.0}
ODD = {**MLA, "qk_nope_head_dim": 11}  # heads 15 wide: RoPE pairs the rope dims alone; no kernel needs an even width
ATTENTIONS = {"q-latent": MLA, "full-q": FULL_Q, "v3-yarn": {**MLA, "rope_scaling": V3_YARN}, "odd-nope": ODD}


@pytest.mark.parametrize("case", ATTENTIONS)
def test_the_attention_is_transformers_deepseek_v3s(case):
    """One layer's attention with the same weights (norm weights made unequal to one, so a latent
    norm on the wrong slice shows; the up projections' weights scaled up, so the scores are far
    from uniform and the softmax scale shows), causal over 10 tokens at positions 3..12."""
    from transformers import DeepseekV3Config
    from transformers.models.deepseek_v3.modeling_deepseek_v3 import DeepseekV3Attention, DeepseekV3RotaryEmbedding
    model = ATTENTIONS[case]
    net = _model(model)  # norm_eps 1e-5: the latent norms take transformers' 1e-6 all the same
    attn = net.layers["0"].attn
    with torch.no_grad():
        for name in ("q_a_norm", "kv_a_norm"):
            if hasattr(attn, name):
                getattr(attn, name).weight.uniform_(0.5, 1.5, generator=torch.Generator().manual_seed(2))
        for name in ("wq_b", "wq", "wkv_b"):
            if hasattr(attn, name):
                getattr(attn, name).weight.mul_(20)
    scaling = {"rope_parameters": {**model["rope_scaling"], "rope_theta": net.cfg.rope_theta}} \
        if "rope_scaling" in model else {}
    hf_cfg = DeepseekV3Config(hidden_size=64, num_attention_heads=4, num_key_value_heads=4,
                              q_lora_rank=model["q_lora_rank"] or None, kv_lora_rank=model["kv_lora_rank"],
                              qk_nope_head_dim=model["qk_nope_head_dim"], qk_rope_head_dim=model["qk_rope_head_dim"],
                              v_head_dim=model["v_head_dim"], rope_interleave=False, max_position_embeddings=64,
                              attn_implementation="sdpa", **scaling)
    hf = DeepseekV3Attention(hf_cfg, 0)
    names = {"kv_a_proj_with_mqa": "wkv_a", "kv_a_layernorm": "kv_a_norm", "kv_b_proj": "wkv_b", "o_proj": "wo",
             **({"q_a_proj": "wq_a", "q_a_layernorm": "q_a_norm", "q_b_proj": "wq_b"} if model["q_lora_rank"]
                else {"q_proj": "wq"})}
    hf.load_state_dict({f"{theirs}.weight": getattr(attn, ours).weight for theirs, ours in names.items()})
    x = torch.randn(2, 10, 64, generator=torch.Generator().manual_seed(3))
    positions = torch.arange(3, 13)
    with torch.no_grad():
        ours = attn(x, net.rope(positions))
        theirs, _ = hf(x, DeepseekV3RotaryEmbedding(hf_cfg)(x, positions[None]), None)
        attn.q_scale = 1.0 if attn.q_scale != 1.0 else 2.0  # another softmax scale: not theirs
        other = attn(x, net.rope(positions))
    torch.testing.assert_close(ours, theirs, atol=1e-5, rtol=1e-5)
    assert theirs.abs().max() > 1e-2 and (other - theirs).abs().max() > 1e-3


def test_the_parameters_are_the_specs_and_the_planners_count():
    """Names and logical shapes as the HF import writes them (docs/design.md); the count flops.py
    gives the planner and MFU is the built model's."""
    for model in (MLA, FULL_Q):
        net = _model(model)
        shapes = {name.removeprefix("layers.0.attn."): tuple(p.shape) for name, p in net.named_parameters()
                  if name.startswith("layers.0.attn.")}
        q = {"wq_a.weight": (24, 64), "q_a_norm.weight": (24,), "wq_b.weight": (64, 24)} if model["q_lora_rank"] \
            else {"wq.weight": (64, 64)}
        assert shapes == {**q, "wkv_a.weight": (20, 64), "kv_a_norm.weight": (16,), "wkv_b.weight": (96, 16),
                          "wo.weight": (64, 48)}
        assert flops.parameter_count(net.cfg) == sum(p.numel() for p in net.parameters())


@pytest.mark.parametrize("model", [MLA, FULL_Q])
def test_the_training_flops_count_every_weight_and_the_value_width(model):
    """MFU's numerator (model/flops.py): 2 FLOPs per token for each weight of a layer's matrices,
    the replicated down projections as the split ones; QK^T at the q/k width 16, AV at v_head_dim
    12 (not the core's padding)."""
    net = _model(model)
    weights = sum(p.numel() for name, p in net.named_parameters() if name.startswith("layers.0.") and p.dim() == 2)
    assert flops.layer_matmul_flops(net.cfg) == 2 * weights
    assert flops.attention_core_flops(net.cfg, 32) == 2 * 32 * 4 * (16 + 12)


@pytest.mark.parametrize("model", [MLA, FULL_Q, {**MLA, "sliding_window": 5}])
def test_decoding_over_the_cached_latents_gives_the_full_forward_logits(model):
    """The prompt at once, three tokens after it (a chat turn's), then a token at a time, attending
    in the latent space (up projections absorbed); a window's layer keeps two windows of latents
    and moves them as it fills."""
    net = _model(model).eval()
    tokens = torch.randint(0, 256, (2, 20), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        full = net(tokens, torch.arange(20))
        cache = {}
        steps = [net(tokens[:, :7], torch.arange(7), cache=cache),
                 net(tokens[:, 7:10], torch.arange(7, 10), cache=cache)]
        steps += [net(tokens[:, i:i + 1], torch.tensor([i]), cache=cache) for i in range(10, 20)]
    torch.testing.assert_close(torch.cat(steps, dim=1), full, atol=1e-5, rtol=1e-5)
    assert full.abs().max() > 1e-2
    held = cache["0"]
    assert held.v is None and held.k.shape[1:] == (1, held.k.shape[2], 16 + 4)  # one latent per token


class OutputShapes(TorchDispatchMode):
    """Records the shape of every tensor an op returns."""

    def __init__(self):
        super().__init__()
        self.shapes: list[tuple[int, ...]] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        self.shapes += [tuple(t.shape) for t in pytree.tree_leaves(out) if isinstance(t, torch.Tensor)]
        return out


@pytest.mark.parametrize("kernel", [SDPBackend.FLASH_ATTENTION, SDPBackend.MATH])
@pytest.mark.parametrize("padded", [False, True])
def test_decoding_never_makes_a_tensor_of_heads_by_tokens_by_the_latent_width(kernel, padded):
    """The cache's point: a prompt, a chat turn of 3 tokens and single tokens, unpadded and as a
    left-padded batch (a mask), make no tensor with a dimension of each: the 4 heads, the t keys
    so far and a latent width (kv_lora_rank 32, or with rope 36), as grouped-query SDPA repeating
    the latent per head would ([2, 4, t, 36]); so under the math kernel, where CUDA falls to for a
    576-wide latent, which repeats any grouped key heads. The logits stay the full forward's."""
    net = _model({**MLA, "kv_lora_rank": 32}).eval()
    tokens = torch.randint(0, 256, (2, 46), generator=torch.Generator().manual_seed(0))
    pads = torch.tensor([0, 5 if padded else 0])
    cache, made, steps = {}, [], []
    with torch.no_grad(), sdpa_kernel(kernel):
        full = net(tokens, torch.arange(46))
        for start, end in ((0, 41), (41, 44), (44, 45), (45, 46)):  # no t a width
            positions = (torch.arange(start, end) - pads[:, None]).clamp(min=0) if padded else torch.arange(start, end)
            with OutputShapes() as meter:
                steps.append(net(tokens[:, start:end], positions, cache=cache))
            made += [shape for shape in meter.shapes if 4 in shape and end in shape and {32, 36} & set(shape)]
    assert not made, made
    if not padded:
        torch.testing.assert_close(torch.cat(steps, dim=1), full, atol=1e-5, rtol=1e-5)


def test_a_left_padded_batch_and_tp2_decode_each_prompt_as_alone():
    """Prompts of 1 to 27 tokens left-padded in one batch (the cached latents' pad columns hidden),
    seeded, one row stopping at an EOS: each row's tokens are its own alone; so on two tp ranks,
    each with half the heads (its slice of wkv_b absorbed) and the whole latent cache."""
    net, sampling = _sharp(MLA), SAMPLINGS["seeded"]
    stop = _early_stop(net, sampling)
    alone = _alone(net, PROMPTS, 10, sampling, stop)
    assert len({tuple(new[:3]) for new, _ in alone}) == len(PROMPTS), alone  # each row its own tokens
    assert generate_batch(net, PROMPTS, 10, sampling, seed=3, stop=stop) == alone
    state = {name: p.detach().clone() for name, p in net.named_parameters()}
    assert run_ranks(_batch_on_this_rank, 2, net.cfg, state, sampling, stop) == [alone, alone]


@pytest.mark.parametrize("change,fix", [
    ({"n_kv_heads": 2}, "set model.n_kv_heads=4"),
    ({"head_dim": 32}, "set model.head_dim=16 or leave it 0"),
    ({"qk_rope_head_dim": 3, "qk_nope_head_dim": 13}, "make it even"),
    ({"v_head_dim": 17}, "set model.v_head_dim <= 16"),
    ({"pos": "learned"}, "set model.pos='rope'"),
    ({"partial_rotary_factor": 0.5}, "set model.partial_rotary_factor=1"),
    ({"qk_norm": True}, "set model.qk_norm=false"),
    ({"qkv_bias": True}, "set model.qkv_bias=false"),
    ({"norm": "layernorm"}, "set model.norm='rmsnorm'"),
    ({"query_pre_attn_scalar": 20.0}, "set model.query_pre_attn_scalar=0"),
])
def test_what_latent_attention_does_not_take_is_refused_in_one_line(change, fix):
    with pytest.raises(ConfigError, match=r"^[^\n]*" + fix.replace("(", r"\(").replace(")", r"\)") + r"[^\n]*$"):
        tiny_config(model={**MLA, **change})


def _run(run_dir, steps: int, model: dict) -> None:
    Trainer(tiny_config(model=model, train={"steps": steps}, checkpoint={"every": 1}, run={"dir": str(run_dir)}),
            torch.device("cpu")).fit()


def test_an_odd_head_width_trains():
    """qk_nope_head_dim 11 (heads 15 wide, what DeepseekV3Attention takes above): a step's loss is
    finite and every attention weight moves to finite values."""
    cfg = tiny_config(model=ODD, train={"steps": 1})
    trainer = Trainer(cfg, torch.device("cpu"))
    start = {name: p.detach().clone() for name, p in trainer.model.named_parameters() if ".attn." in name}
    loss = trainer.fit()[-1]["loss"]
    moved = {name: bool(p.isfinite().all()) and not torch.equal(p, start[name])
             for name, p in trainer.model.named_parameters() if name in start}
    assert torch.isfinite(torch.tensor(loss)) and all(moved.values()), (loss, moved)


def test_resuming_with_another_latent_width_is_refused_by_name(tmp_path):
    """The latent widths decide the weights' shapes: a resume with another is refused naming it,
    as any shape key; a model without latent attention ignores them (not a shape)."""
    _run(tmp_path / "mla", 1, MLA)
    with pytest.raises(CheckpointError, match=r"model\.kv_lora_rank = 16 in the checkpoint, 8 here"):
        _run(tmp_path / "mla", 2, {**MLA, "kv_lora_rank": 8})
    _run(tmp_path / "plain", 1, {})
    _run(tmp_path / "plain", 2, {"v_head_dim": 7})
    assert (tmp_path / "plain" / "checkpoints" / "step_00000002").is_dir()


def _config(family: str, parallel: dict, train: dict):
    model, changes = FAMILIES[family]
    data = {"source": doc_shards()} if changes.get("document_mask") else {}
    return tiny_config(parallel=parallel, model=model, train={**changes, **train}, data=data)


@lru_cache(maxsize=None)
def _one_process(family: str):
    return train_layout(_config(family, {}, {}))


@pytest.mark.dist
@pytest.mark.parametrize("name", LAYOUTS)
def test_layout_matches_single_process(name):
    parallel, train = LAYOUTS[name]
    family = name.split("-")[0]
    got = train_layout(_config(family, parallel, train), timeout_s=900 if "compile" in name else 300)
    # tp's bound (tests/test_tp.py); with documents test_document_mask's
    assert_parity(got, _one_process(family), atol=2e-4 if family == "mladocs" else 1e-4)


NCCL_LAYOUTS = {  # name -> parallel
    # the latents' gather and its backward's sum among zero-bubble's deferred weight gradients and the
    # pipeline's transfers
    "mla-tp2-sp-pp2-zb": {"tp": 2, "sequence_parallel": True, "pp": 2, "schedule": "zb"},
    # ZeRO-3's prefetched gathers of replicated and expert weights around the experts' all-to-alls
    "mlads3-dp2-ep2-zero3": {"dp": 2, "ep": 2, "zero": 3},
}


@pytest.mark.dist
@pytest.mark.parametrize("name", NCCL_LAYOUTS)
def test_layout_under_nccl_semantics_matches_single_process(name):
    """Under NCCL's ordering of point-to-point (tests/nccl_semantics.py) and its timing of
    collectives (tests/nccl_collectives.py), as a cluster runs them."""
    family = name.split("-")[0]
    got = train_layout(_config(family, NCCL_LAYOUTS[name], {}), transport=partial(NcclSemantics, timeout_s=20),
                       trainer_class=NcclTrainer)
    got[2][-1].pop("posted")
    assert_parity(got, _one_process(family), atol=1e-4)


def test_the_latent_weights_train():
    """The latent norms start at one and the down projections from their init: a layout that
    dropped their gradients shows in the parity above; here they move at all."""
    _, state, _ = _one_process("mla")
    start = _model(MLA, seed=0).state_dict()
    for leaf in ("wq_a.weight", "q_a_norm.weight", "wkv_a.weight", "kv_a_norm.weight"):
        name = f"layers.1.attn.{leaf}"
        assert (state[name] - start[name]).abs().min() > 0, name
