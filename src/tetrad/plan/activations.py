"""Activation memory: what one layer keeps for its backward, per saved tensor, and what a
pipeline rank's layers weigh in the schedule simulator's count of held sets.

Activations follow Korthikanti et al. 2022, written per saved tensor so that they generalise to
GQA, SwiGLU, fp32, flash attention (no s^2 scores kept, a log-sum-exp instead), TP with or
without SP, CP (a rank holds seq_len/cp tokens) and recomputation: with 16-bit activations,
dropout, GELU and materialised scores they are exactly sbh(34 + 5as/h) per layer. Document
masking adds its bias (`mask_bias_bytes`, a sliding window's too). Where layers differ
(model.dense_layers: an MoE model's dense layers) each is counted as its kind
(flops.layer_model), and a pipeline chunk's set weighs its own layers (`chunk_weights`).
"""

from __future__ import annotations

from dataclasses import replace

from tetrad.config import Config, ModelConfig
from tetrad.model import flops
from tetrad.model.flops import hides_keys
from tetrad.parallel.pipeline.registry import schedule_spec
from tetrad.parallel.pipeline.split import rank_chunk_layers
from tetrad.plan import moe
from tetrad.plan.kernels import masked_attention
from tetrad.plan.latent import core_inputs, latents, projections, widths
from tetrad.plan.stacks import STACKS, Stack


def as_run(cfg: Config, stack: Stack, is_cpu: bool = False) -> Stack:
    """`stack` as `cfg` runs it: tetrad with `train.compile` is the `tetrad-compiled` stack, and
    tetrad's own stacks keep sequence parallelism's gathered input for backward unless
    `parallel.sp_regather` (model/mappings.py); other stacks do as they do. On CPU torch has no
    fused RMSNorm: the composite runs (measured with autograd's saved-tensor hooks, torch 2.13)."""
    if cfg.train.compile and stack.name == "tetrad":
        stack = STACKS["tetrad-compiled"]
    if is_cpu:
        stack = replace(stack, fused_rms_norm=False)
    if cfg.parallel.sp_regather and stack.name.startswith("tetrad"):
        return replace(stack, sp_saves_gathered_input=False)
    return stack


def activation_bytes(dtype: str) -> int:
    """Bytes per activation element: fp32 training keeps fp32 activations, all else 16-bit."""
    return 4 if dtype == "fp32" else 2


def norm_saved_bytes(m: ModelConfig, tokens: int, e: int, stack: Stack) -> float:
    """Bytes one norm keeps for backward over `tokens` tokens: its input, or under the composite
    RMSNorm (Stack.fused_rms_norm) two fp32 tensors, as Gemma's always keeps (its fp32 output and
    the fp32 input, fused or not)."""
    return tokens * m.d_model * (8 if m.norm == "gemma_rmsnorm" else _norm_bytes(m, e, stack))


def _norm_bytes(m: ModelConfig, e: int, stack: Stack) -> int:
    return e if m.norm == "layernorm" or (stack.fused_rms_norm and m.norm == "rmsnorm") else 8


def activation_bytes_per_layer(m: ModelConfig, tokens: int, tp: int, sp: bool, recompute: str, e: int,
                               stack: Stack) -> float:
    """Bytes one layer keeps for its backward, for one micro-batch of `tokens` tokens on this
    rank (micro_batch x seq_len / cp), `e` bytes per activation element; `m`: the layer's kind
    (flops.layer_model)."""
    div = tp if sp else 1
    hidden = tokens * m.d_model * e
    norm_input = norm_saved_bytes(m, tokens, e, stack)
    if recompute == "full":
        return hidden / div  # only the layer's input (Korthikanti: 2sbh in 16 bit)
    w = widths(m, tp)
    if recompute == "selective-op":  # the input, the kept matmul outputs (a row-parallel one whole,
        # before its all-reduce or reduce-scatter; a "chunk" one over the rank's own tokens), the
        # attention's output and fp32 log-sum-exp (under ring cp the ring's merged ones, once:
        # model/replay.py RingReplay)
        share = {"column": 1 / tp, "row": 1, "chunk": 1 / div}  # of each token's output (flops.layer_matmuls)
        kept = sum(n * rows * share[split] for _, n, split, rows in flops.op_checkpoint_saved_matmuls(m))
        # a sigmoid router's logits leave their matmul in fp32 (model/routing.py router_logits)
        fp32_logits = (4 - e) * m.n_experts if m.router_score == "sigmoid" else 0
        return hidden / div + tokens * (e * (kept + w.out) + fp32_logits) + 4 * m.n_heads / tp * tokens
    f = flops.mlp_hidden(m, active=True) / tp  # MoE: each token's k experts' hidden tensors, k·H
    dropout = m.dropout > 0
    # Replicated over tp unless SP: both norms' inputs and the 1-byte dropout masks after
    # attention and MLP; the attention and MLP inputs (norm outputs) too, unless the stack keeps
    # them all-gathered under SP.
    norms = (4 if m.sandwich_norm else 2) * norm_input + (2 * tokens * m.d_model if dropout else 0)
    routed = bool(m.n_experts)  # the router keeps the MLP's input whole (gathered under SP)
    gathered = hidden / (1 if sp and stack.sp_saves_gathered_input else div)
    inputs = (1 - routed) * gathered + routed * hidden + _attention_input_bytes(m, hidden / div, gathered)
    replicated = norms / div + inputs
    # Split over tp: q, k, v (after RoPE), the attention output, the MLP's hidden tensors.
    mlp = stack.swiglu_saved if m.gated_mlp else 2  # GELU: its input and the fc2 input
    mlp = moe.expert_hidden_saved(m) if m.n_experts else mlp
    attention = w.q + w.k + w.v + w.out + (stack.attn_out_copies - 1) * w.wo
    if recompute == "selective" and m.latent_attention:  # the core's inputs, and the sliced output wo keeps
        attention = core_inputs(m, tp) + w.wo
    split = tokens * e * (attention + mlp * f)
    replicated += latent_saved_bytes(m, tokens, tp, sp, e, stack)
    # MoE: the routing's tensors; a shared expert's as a dense MLP of its width, and its gate's
    replicated += tokens * moe.routing_saved_bytes_per_token(m, e)
    replicated += tokens * moe.shared_expert_saved_bytes_per_token(m, tp, e, stack.swiglu_saved if m.gated_mlp else 2)
    if m.qk_norm:  # q's and k's norms keep their inputs, as the layer's norms do theirs
        split += tokens * (w.q + w.k) * _norm_bytes(m, e, stack)
    core = 0.0
    if recompute != "selective":
        heads = m.n_heads / tp
        if stack.flash_attention:
            core = 4 * heads * tokens  # fp32 log-sum-exp per query and head
        else:  # softmax output, and with dropout its mask and output: Korthikanti's 5as^2b
            core = (e + (e + 1 if dropout else 0)) * heads * tokens * m.seq_len
    return replicated + split + core


def _attention_input_bytes(m: ModelConfig, chunk: float, gathered: float) -> float:
    """Bytes of the attention's input its projections keep: q, k and v's, gathered under SP where
    the stack keeps it so (`gathered`); latent attention's down projections' the rank's own
    tokens (`chunk`: under SP its sequence chunk), and without a query latent q's projection's
    (gathered) too, unless that is the same tensor (no SP)."""
    if not m.latent_attention:
        return gathered
    return chunk + (gathered if not m.q_lora_rank and gathered != chunk else 0.0)


def latent_saved_bytes(m: ModelConfig, tokens: int, tp: int, sp: bool, e: int, stack: Stack) -> float:
    """Bytes latent attention's latents keep, whole on every tp rank (0 without it): their norms'
    inputs over the rank's own tokens (under SP its chunk; the kv latent's a slice of its down
    projection's output, whose storage holds the rope dims too where the norm keeps the input
    itself), and the normed latents with the rotated key's dims, gathered, which the up
    projections keep (one tensor: model/latent_attention.py)."""
    q_latent, kv_latent = latents(m)
    if not kv_latent:
        return 0.0
    norm, own = _norm_bytes(m, e, stack), tokens / (tp if sp else 1)
    rope = m.qk_rope_head_dim * e if e == 4 or norm == e else 0  # the input itself kept: its storage
    return own * ((q_latent + m.kv_lora_rank) * norm + rope) + tokens * (q_latent + kv_latent) * e


def mask_bias_bytes(cfg: Config, is_cpu: bool = False) -> float:
    """Bytes of the mask bias (train.document_mask, a model.sliding_window shorter than seq_len) on
    the local and all-to-all paths, whose kernel takes the whole sequence: [micro_batch, 1,
    seq_len, seq_len] in the activations' dtype with documents, [1, 1, seq_len, seq_len] with a
    window alone (model/masks.py). Without recompute it is built once per micro-batch and model
    chunk and kept by every layer's attention: one per activation set in flight (`memory_by_rank`
    passes it to the simulator as what each set carries). Under recompute each layer builds it in
    the recomputed region and keeps none: the layer rebuilt during backward holds one. The ring
    keeps none: its backward builds each block's mask again from the window's ids. Nor does flash's
    varlen kernel (CUDA, 16-bit: plan/kernels.py), which takes the segments' bounds instead."""
    m, t = cfg.model, cfg.train
    if masked_attention(cfg, is_cpu) != "square":
        return 0.0
    rows = t.micro_batch if t.document_mask else 1
    # one per window the layers mask with (model.layer_types: a sliding and a full layer's differ)
    biases = {w for w in flops.layer_windows(m) if t.document_mask or hides_keys(w, m.seq_len)}
    return len(biases) * rows * m.seq_len ** 2 * activation_bytes(t.dtype)


def deferred_weight_grad_bytes_per_layer(m: ModelConfig, tokens: int, tp: int, e: int, sp: bool = False) -> float:
    """What one layer still holds between its input-gradient and weight-gradient passes
    (zero-bubble's BI and BW): each linear's input and output gradient. Column-parallel linears
    (qkv, gate/up) take the whole hidden state (gathered under SP) and give 1/tp outputs;
    row-parallel ones (output, down) take 1/tp inputs and give the whole hidden state. MoE's
    experts, router and shared expert gate hold nothing: their weight gradients are made in BI
    (model/moe.py); its shared expert's linears hold what a dense MLP's do."""
    h = m.d_model
    width = m.shared_expert_ffn_hidden if m.n_experts else m.ffn_hidden
    f = width / tp
    up = 2 * f if m.gated_mlp else f
    mlp = (h + f) + (up + h) if width else 0  # gate/up's and down's inputs and output gradients
    # the attention's input projections' (qkv's; latent attention's down projections' over the
    # rank's own tokens, a chunk under SP, and up projections') and the output projection's
    attention = sum((k + n) / (tp if own and sp else 1) for k, n, own in projections(m, tp)) + widths(m, tp).wo + h
    return tokens * e * (attention + mlp)


def after_bi_weight(cfg: Config, stack: Stack, is_cpu: bool = False) -> float:
    """Under zero-bubble, a layer's held memory between BI and BW in units of its activation set
    (what `peak_held` weighs); 1.0 for schedules without a split backward. Where layers differ
    (model.dense_layers) the model's layers' together: one ratio for every set (the simulator's)."""
    if not schedule_spec(cfg.parallel.schedule).splits_backward:
        return 1.0
    m, p, t = cfg.model, cfg.parallel, cfg.train
    tokens = t.micro_batch * m.seq_len // p.cp
    e = activation_bytes(t.dtype)
    stack = as_run(cfg, stack, is_cpu)
    full = flops.over_layers(m, lambda k: activation_bytes_per_layer(k, tokens, p.tp, p.sequence_parallel,
                                                                     t.recompute, e, stack))
    return round(flops.over_layers(m, lambda k: deferred_weight_grad_bytes_per_layer(k, tokens, p.tp, e, p.sequence_parallel)) / full, 2)


def chunk_weights(cfg: Config, stack: Stack, tokens: int, e: int) -> tuple[float, tuple[tuple[float, ...], ...]]:
    """(the unit: an MoE layer's activation set, every layer's in a dense model; what each pipeline
    rank's chunks' sets weigh in it, their layers' sets summed, the last stage's with its
    multi-token prediction modules' layers, which it runs as its own): the simulator's `chunk_layers`."""
    m, p, t = cfg.model, cfg.parallel, cfg.train
    mtp = flops.mtp_kind_counts(m)
    sets = {kind: activation_bytes_per_layer(flops.layer_model(m, kind), tokens, p.tp, p.sequence_parallel,
                                             t.recompute, e, stack)
            for kind in {**flops.kind_counts(m), **mtp}}  # each kind's once: the planner weighs many layouts
    unit = sets.get(True, sets.get(False))
    if len(sets) == 1:  # one kind: a chunk weighs its layer count, counted without a call per chunk
        weights = [list(map(len, rank)) for rank in rank_chunk_layers(cfg)]
    else:
        weights = [[sum(n * (sets[k] / unit) for k, n in flops.kind_counts(m, [layers]).items()) for layers in rank]
                   for rank in rank_chunk_layers(cfg)]
    weights[-1][-1] += sum(n * (sets[k] / unit) for k, n in mtp.items())
    return unit, tuple(map(tuple, weights))


def rebuilt_bytes(cfg: Config, stack: Stack, tokens: int, e: int, is_cpu: bool) -> list[float]:
    """Per pipeline rank, what its backward holds at once beyond the held sets, the most over its
    kinds of layer: under full and per-op recompute the layer rebuilt during its backward, beyond
    what the held sets already count for it (what it keeps, or under a split backward the larger
    of that and what it keeps from its BI to its BW, `after_bi_weight`); an MoE layer's whole
    expert gradients (moe.expert_grad_bytes)."""
    m, p, t = cfg.model, cfg.parallel, cfg.train

    def rebuilt(k: ModelConfig) -> float:
        out = moe.expert_grad_bytes(k, p.tp, p.ep, e)
        if t.recompute in ("full", "selective-op"):
            counted = activation_bytes_per_layer(k, tokens, p.tp, p.sequence_parallel, t.recompute, e, stack)
            if schedule_spec(p.schedule).splits_backward:
                counted = max(counted, deferred_weight_grad_bytes_per_layer(k, tokens, p.tp, e, p.sequence_parallel))
            out += (activation_bytes_per_layer(k, tokens, p.tp, p.sequence_parallel, "none", e, stack)
                    + mask_bias_bytes(cfg, is_cpu) - counted)
        return out
    mtp = flops.mtp_kind_counts(m)  # the last rank's modules' layers too
    per_kind = {kind: rebuilt(flops.layer_model(m, kind)) for kind in {**flops.kind_counts(m), **mtp}}
    ranks = [list(flops.kind_counts(m, rank)) for rank in rank_chunk_layers(cfg)]
    ranks[-1] += list(mtp)
    return [max(map(per_kind.__getitem__, kinds)) for kinds in ranks]


# What the fused loss keeps per token for backward: its fp32 log-sum-exp, the label as this rank's
# int64 vocabulary row, and two masks (the label on this rank; counted by the loss).
CHUNKED_SAVED_PER_TOKEN = 4 + 8 + 1 + 1


def loss_bytes(cfg: Config, tokens: int, vocab_rows: int) -> tuple[float, float]:
    """(kept, transient) bytes of one head's cross-entropy on `tokens` rows of its input over this
    rank's `vocab_rows`, beside that input. Unfused: the fp32 softmax kept; the logits and their
    gradient in passing (without tp torch's cross-entropy takes an fp32 copy of 16-bit logits while
    they are still held, beside its fp32 log-softmax: the logits once more, seen on an H200,
    docs/gpu.md). Fused (model/chunked_loss.py): 14 bytes a token kept; in passing one chunk's
    logits at a time: forward, 6 bytes a logit (measured on CPU: a 16-bit product and its fp32
    copy, or fp32 logits and logsumexp's work); backward in 16 bits, over several chunks, beside the fp32 sum of
    the head's weight gradient, either the fp32 logits and their 16-bit gradient at the cast, or
    that gradient and the chunk's 16-bit weight part as it is summed. An fp32 head's backward holds
    4 bytes a logit, its weight gradient made as the unfused head's (uncounted there too)."""
    e = activation_bytes(cfg.train.dtype)
    chunk = cfg.train.loss_chunk_tokens
    sixteen = e if e < 4 else 0
    if not chunk:
        logits = tokens * vocab_rows
        return 4 * logits, (4 + (sixteen if cfg.parallel.tp == 1 else 0)) * logits
    rows = min(chunk, tokens)
    logits = rows * vocab_rows
    weights = vocab_rows * cfg.model.d_model if sixteen and rows < tokens else 0
    backward = max((4 + sixteen) * logits + 4 * weights, sixteen * logits + (4 + sixteen) * weights)
    return CHUNKED_SAVED_PER_TOKEN * tokens, max(6 * logits, backward)


def mtp_saved_bytes(cfg: Config, stack: Stack, tokens: int, e: int, vocab_rows: int) -> float:
    """Bytes the multi-token prediction modules (model.mtp_layers) keep beside their layers' sets
    (`chunk_weights` counts those) for the backward of one micro-batch of `tokens` tokens on the
    last stage, from its forward there until its backward, as the head's output is
    (memory.activations_by_rank): each depth's inputs of its enorm, hnorm, eh_proj (2d wide:
    replicated over tp, on the rank's own tokens, under SP its chunk) and final norm; the head's
    input and what its cross-entropy over this rank's `vocab_rows` keeps, as the main head's
    (`loss_bytes`). The loss's transients come one depth's at a time: the main head's count covers them."""
    m, p = cfg.model, cfg.parallel
    hidden = tokens * m.d_model * e
    own = (3 * norm_saved_bytes(m, tokens, e, stack) + 2 * hidden) / (p.tp if p.sequence_parallel else 1)
    head_input = hidden / (p.tp if p.sequence_parallel and not stack.sp_saves_gathered_input else 1)
    return m.mtp_layers * (own + head_input + loss_bytes(cfg, tokens, vocab_rows)[0])
