"""The one model definition: a decoder-only transformer, Llama-style (RMSNorm, RoPE, SwiGLU,
grouped-query attention) or GPT-style (LayerNorm, GELU, learned positions), by config.

Parallelism enters only through the layers it is built from: with every size 1 they are plain
linears and the model is an ordinary single-device model. A `Transformer` can hold a slice of the
layers (a pipeline chunk): the embedding lives on the first chunk, the final norm, head and loss
on the last; parameter names keep the global layer index, so they are the same in every layout.

How blocks run is a training choice, set after construction by `set_execution`: activation
recomputation (`full`: each block's forward is recomputed in its backward; `selective`: only the
attention core, Korthikanti et al. 2022; `selective-op`: torchtitan's per-op policy, below) and
torch.compile of each block.
"""

from __future__ import annotations

import contextlib
import math

import torch
import torch.nn as nn
from torch.utils.checkpoint import CheckpointPolicy, checkpoint, create_selective_checkpoint_contexts

from tetrad.config import ModelConfig
from tetrad.model.attention import attention, sequence_mask, uses_varlen
from tetrad.model.chunked_loss import chunked_head_loss
from tetrad.model.documents import Documents
from tetrad.model.kv_cache import LayerCache, cached_attention, padded_visibility
from tetrad.model.flops import hides_keys
from tetrad.model.moe import MoE
from tetrad.model.replay import RingReplay
from tetrad.model.rope import apply_rope, rope_frequencies, rope_tables, uses_long_factors
from tetrad.model.execution import Execution
from tetrad.model.sharding import new_param
from tetrad.model.latent_attention import LatentAttention
from tetrad.model.layers import (MLP, ColumnParallelLinear, Norm, ResidualDropout, RowParallelLinear,
                                 VocabParallelEmbedding, vocab_parallel_cross_entropy)
from tetrad.model.mappings import column_parallel_linear, column_parallel_linears, sequence_shard
from tetrad.model.mtp import MTPDepth, MultiTokenPrediction, unpack_targets, with_mtp_gradient


class Attention(nn.Module):
    """`window`: this layer's sliding window (ModelConfig.window_of; 0: none)."""

    def __init__(self, cfg: ModelConfig, topo, ex: Execution, out_std: float, window: int = 0):
        super().__init__()
        self.cfg, self.topo, self.ex, self.window = cfg, topo, ex, window
        hd = cfg.head_dim
        # Gemma's softmax scale, query_pre_attn_scalar ** -0.5, as q times this under every kernel's
        # head_dim ** -0.5 (RoPE is linear: before or after it alike)
        self.q_scale = (hd / cfg.query_pre_attn_scalar) ** 0.5 if cfg.query_pre_attn_scalar else 1.0
        self.heads = cfg.n_heads // topo.tp_size
        self.kv_heads = cfg.n_kv_heads // topo.tp_size
        self.wq = ColumnParallelLinear(cfg.d_model, cfg.n_heads * hd, topo, ex, bias=cfg.qkv_bias)
        self.wk = ColumnParallelLinear(cfg.d_model, cfg.n_kv_heads * hd, topo, ex, bias=cfg.qkv_bias)
        self.wv = ColumnParallelLinear(cfg.d_model, cfg.n_kv_heads * hd, topo, ex, bias=cfg.qkv_bias)
        self.wo = RowParallelLinear(cfg.n_heads * hd, cfg.d_model, topo, ex, std=out_std)
        self.q_norm = Norm(cfg, hd, per_head=True) if cfg.qk_norm else None
        self.k_norm = Norm(cfg, hd, per_head=True) if cfg.qk_norm else None
        self.recompute_core = False  # selective recompute (see `core`)
        self.ring_replay = RingReplay()  # per-op recompute under ring cp (model/replay.py)

    def forward(self, x: torch.Tensor, rope: tuple[torch.Tensor, torch.Tensor] | None,
                cache: LayerCache | None = None, docs: Documents | torch.Tensor | None = None) -> torch.Tensor:
        """`cache` (decoding): x holds the newest tokens only; their keys and values join the cache.
        `docs`: the sequence's `Documents`, or the mask bias the chunk's layers share (model/masks.py);
        with a cache, a left-padded batch's visibility (kv_cache.padded_visibility) or None."""
        # q, k, v share one input collective; under SP x is a sequence chunk, q/k/v the whole sequence.
        q, k, v = column_parallel_linears(x, [self.wq.weight, self.wk.weight, self.wv.weight], self.topo, self.ex)
        q, k, v = self.wq.add_bias(q), self.wk.add_bias(k), self.wv.add_bias(v)
        b, s, _ = q.shape
        hd = self.cfg.head_dim
        q, k, v = q.view(b, s, self.heads, hd), k.view(b, s, self.kv_heads, hd), v.view(b, s, self.kv_heads, hd)
        if self.q_norm is not None:
            q, k = self.q_norm(q), self.k_norm(k)
        if self.q_scale != 1.0:
            q = q * self.q_scale
        if cache is not None:
            if rope is not None:
                q, k = apply_rope(q, *rope), apply_rope(k, *rope)
            out = cached_attention(q, *cache.extend(k, v), self.window, docs)
        elif self.recompute_core and torch.is_grad_enabled():
            out = checkpoint(self.core, q, k, v, rope, docs, use_reentrant=False)
        else:
            out = self.core(q, k, v, rope, docs)
        return self.wo(out.reshape(b, s, self.heads * hd))

    def core(self, q, k, v, rope, docs=None):
        """Rotary embedding and attention: what selective recompute recomputes, keeping only q, k,
        v (Korthikanti et al. 2022). With a flash kernel the core itself keeps little (its output
        and log-sum-exp); the rotated q and k, elementwise and cheap to redo, are the bulk."""
        if rope is not None:
            q, k = apply_rope(q, *rope), apply_rope(k, *rope)
        return attention(q, k, v, self.topo, self.ex.cp_algo, self.ring_replay, docs, self.window)


aten = torch.ops.aten
# Attention kernels whose outputs (output and log-sum-exp) `selective-op` keeps.
_ATTENTION_OPS = {aten._scaled_dot_product_flash_attention.default, aten._scaled_dot_product_efficient_attention.default,
                  aten._scaled_dot_product_cudnn_attention.default,
                  aten._scaled_dot_product_flash_attention_for_cpu.default}
# model/varlen.py's kernel, by name: its module registers it at varlen's first call, not here.
_VARLEN_OP = "torch_attn::_varlen_attn"


def _save_attention_and_every_other_matmul(ring: RingReplay, hold=None, mlp: nn.Module | None = None):
    """Per-op selective checkpointing as torchtitan's "op" mode runs it (its `_save_list` and
    policy): the block is recomputed in backward except the attention kernels' outputs and every
    other matmul's (the 1st, 3rd, ... in forward order: q, v, gate and down for a SwiGLU layer),
    which the recompute reads back instead of computing. One policy per block call. The kept
    outputs live outside autograd until the recompute: `hold` (an activation meter's) counts them.
    Under ring cp the ring keeps its merged output and log-sum-exp itself, and the recompute
    replays them without running the ring (`ring`, the layer's RingReplay): the policy keeps
    nothing from inside it. (torch's recompute finds a kept output by its op and that op's call
    count; the ring calls no matmul, so skipping it leaves the later matmuls' counts as they were.)
    An MoE layer's routing (`mlp.routing`: router, experts, the shared expert's gate) keeps every
    matmul's output, as torchtitan's keeps its grouped GEMMs', outside the count (their number
    changes with the routing: counted, "every other" would keep another set each call); its
    shared expert's matmuls are counted."""
    matmuls, held, kept = 0, [], []

    def policy(ctx, op, *args, **kwargs):
        nonlocal matmuls
        if ring.running:
            return CheckpointPolicy.PREFER_RECOMPUTE
        routing = getattr(mlp, "routing", False)
        matmuls += op is aten.mm.default and not routing
        keep = op in _ATTENTION_OPS or op.name() == _VARLEN_OP or (op is aten.mm.default and (routing or matmuls % 2 == 1))
        if keep and hold is not None:
            outputs = ctx.op_output if isinstance(ctx.op_output, tuple) else (ctx.op_output,)
            held.extend(hold(t) for t in outputs if isinstance(t, torch.Tensor))
        return CheckpointPolicy.MUST_SAVE if keep else CheckpointPolicy.PREFER_RECOMPUTE
    forward, recompute = create_selective_checkpoint_contexts(policy)
    forward, recompute = _both(forward, ring.recording(kept, hold)), _both(recompute, ring.replaying(kept))
    return forward, _both(recompute, _on_exit(held.clear))


class Block(nn.Module):
    """Layer `index`: pre-norm attention and MLP; under model.sandwich_norm (Gemma 2/3) each
    output normed again (attn_out_norm, mlp_out_norm) before it joins the residual stream."""

    def __init__(self, cfg: ModelConfig, topo, ex: Execution, index: int = 0):
        super().__init__()
        out_std = 0.02 / math.sqrt(2 * cfg.n_layers)  # GPT-2/Megatron scaling of residual outputs
        self.local_rope = cfg.local_rope(index)  # the sliding layers' RoPE (model.rope_local_base_freq)
        self.attn_norm = Norm(cfg)
        attention_kind = LatentAttention if cfg.latent_attention else Attention
        self.attn = attention_kind(cfg, topo, ex, out_std, cfg.window_of(index))
        self.mlp_norm = Norm(cfg)
        self.mlp = MoE(cfg, topo, ex, out_std) if cfg.moe_layer(index) else MLP(cfg, topo, ex, out_std)
        self.attn_out_norm = Norm(cfg) if cfg.sandwich_norm else nn.Identity()
        self.mlp_out_norm = Norm(cfg) if cfg.sandwich_norm else nn.Identity()
        self.dropout = ResidualDropout(cfg.dropout, topo, ex) if cfg.dropout else nn.Identity()
        self.recompute = "none"  # "full" or "selective-op": the block runs under a checkpoint
        self.compiled_body = None  # torch.compile's version of `body`, when compiling

    def body(self, x: torch.Tensor, rope, docs: Documents | torch.Tensor | None = None) -> torch.Tensor:
        x = x + self.dropout(self.attn_out_norm(self.attn(self.attn_norm(x), rope, docs=docs)))
        return x + self.dropout(self.mlp_out_norm(self.mlp(self.mlp_norm(x))))

    def forward(self, x: torch.Tensor, rope, cache: LayerCache | None = None,
                docs: Documents | torch.Tensor | None = None) -> torch.Tensor:
        if cache is not None:  # decoding: no recompute, no compile
            x = x + self.attn_out_norm(self.attn(self.attn_norm(x), rope, cache, docs))
            return x + self.mlp_out_norm(self.mlp(self.mlp_norm(x)))
        # The checkpoint sits inside the module call, so module hooks (ZeRO-3's gathers) run once
        # per forward and never during the recompute.
        body = self.compiled_body or self.body
        if self.recompute != "none" and torch.is_grad_enabled():
            return checkpoint(body, x, rope, docs, use_reentrant=False, context_fn=self._recompute_contexts)
        return body(x, rope, docs)

    def _recompute_contexts(self):
        """(forward, recompute) contexts of the checkpoint: the per-op policy's, if any, and the
        dropout replay."""
        forward, recompute = contextlib.nullcontext(), contextlib.nullcontext()
        if self.recompute == "selective-op":
            forward, recompute = _save_attention_and_every_other_matmul(self.attn.ring_replay,
                                                                         self.attn.ex.weight_grads.hold, self.mlp)
        return forward, _both(recompute, self._replay_dropout())

    def _replay_dropout(self):
        """The recompute must draw the dropout masks of the forward. torch.utils.checkpoint
        replays the default generators; ResidualDropout's own tp-shared generator (tp > 1 without
        SP) it does not know, so record its state in the forward, rewind it for the recompute
        and restore it after."""
        generator = getattr(self.dropout, "generator", None)
        if generator is None:
            return contextlib.nullcontext()
        at_forward = generator.get_state()

        @contextlib.contextmanager
        def replay():
            now = generator.get_state()
            generator.set_state(at_forward)
            try:
                yield
            finally:
                generator.set_state(now)
        return replay()


@contextlib.contextmanager
def _both(first, second):
    with first, second:
        yield


@contextlib.contextmanager
def _on_exit(action):
    try:
        yield
    finally:
        action()


def set_execution(model: nn.Module, recompute: str = "none", compile: bool = False) -> None:
    """Set how every transformer block in `model` runs: recompute `none`, `selective`, `selective-op` or `full`,
    and whether each block's body is compiled with torch.compile (module hooks stay outside)."""
    for block in model.modules():
        if isinstance(block, Block):
            block.recompute = recompute if recompute in ("full", "selective-op") else "none"
            block.attn.ex.op_recompute = recompute == "selective-op"  # every block's, shared
            block.attn.recompute_core = recompute == "selective"
            block.compiled_body = torch.compile(block.body) if compile else None


class Transformer(nn.Module):
    """Layers `layers` (global indices) of the model; `first`/`last` add embedding and head, `last`
    also multi-token prediction's depths (`mtp`, model/mtp.py), which read the embedding: a last
    chunk that is not the first then holds a copy of it (pipeline/stages.py), which a tied head
    shares. `execution` says how its layers run (model/execution.py; default: plainly)."""

    def __init__(self, cfg: ModelConfig, topo, layers: range | None = None, first: bool = True, last: bool = True,
                 execution: Execution | None = None):
        super().__init__()
        ex = self.execution = execution or Execution()
        self.cfg, self.topo = cfg, topo
        self.first, self.last = first, last
        layers = range(cfg.n_layers) if layers is None else layers
        if first or (last and cfg.mtp_layers):
            self.embed = VocabParallelEmbedding(cfg.vocab_size, cfg.d_model, topo, ex)
        if first:
            if cfg.pos == "learned":
                self.pos_embed = new_param((cfg.seq_len, cfg.d_model), std=0.01)
        self.layers = nn.ModuleDict({str(i): Block(cfg, topo, ex, i) for i in layers})
        self.mtp = None
        if last:
            self.norm = Norm(cfg)
            if cfg.tie_embeddings and hasattr(self, "embed"):
                self.head = None  # logits from the embedding's weight
            else:
                # Its weight gradient is made in BI under zero-bubble: queued, it would hold the
                # logits' fp32 gradient until BW (16 MiB a micro-batch at vocab 16384, seq 128,
                # micro-batch 2; test_plan_runtime).
                self.head = ColumnParallelLinear(cfg.d_model, cfg.vocab_size, topo, ex, pad_to=topo.tp_size,
                                                 grad_in_bi=True)
            self.mtp = MultiTokenPrediction(MTPDepth(cfg, ex, Block(cfg, topo, ex, cfg.n_layers + k))
                                            for k in range(cfg.mtp_layers)) if cfg.mtp_layers else None
        self._rope: dict[bool, tuple] = {}  # local -> (positions, their version, tables): see `rope`
        self._inv_freq: dict[tuple[torch.device, bool, bool], torch.Tensor] = {}  # see `_frequencies`

    def _shared_mask(self, docs: Documents | None, positions: torch.Tensor, h: torch.Tensor, window: int):
        """The mask (documents, a sliding `window`) the chunk's layers of that window take, made
        once for all of them on the paths that attend over the whole sequence (the ring builds
        per-block masks): the varlen kernel's segments always (a few integers), the bias where no
        layer recomputes its attention (a recompute rebuilds the bias instead of keeping one;
        model/masks.py). None where the layers make their own, or need none."""
        cp = self.topo.size("cp")
        length = positions.shape[-1] * cp  # positions: [s], or [b, s] under train.reset_positions
        if docs is None and not hides_keys(window, length):
            return None
        if cp > 1 and self.execution.cp_algo != "alltoall":
            return None
        recomputes = any(b.recompute != "none" or b.attn.recompute_core for b in self.layers.values())
        if recomputes and not uses_varlen(h.device, h.dtype, self.cfg.head_dim):
            return None
        return sequence_mask(docs, window, h.shape[0], length, h.dtype, h.device, self.cfg.head_dim)

    def forward(self, x: torch.Tensor, positions: torch.Tensor, labels: torch.Tensor | None = None,
                cache: dict[str, LayerCache] | None = None, docs: Documents | None = None, tail: int = 0) -> torch.Tensor:
        """x: tokens [b, s] on the first chunk, else hidden states [b, s, d]; positions: [s], each
        token's true position, or [b, s] (train.reset_positions: each row's own). On the last
        chunk returns the summed token loss (labels given) or this rank's vocabulary slice of the
        logits; otherwise the hidden states. `cache` (decoding; under tp this rank's heads): per
        layer name, the keys and values of the earlier tokens; x then holds only the new tokens, at
        `positions`, and the cache grows by them; positions [b, s] there: a left-padded batch, each
        row's own (kv_cache.padded_visibility). `docs` (document masking): the `Documents` of the
        whole window, [b, seq_len], on every rank and stage (not sharded: attention derives each
        rank's part); the mask bias, documents and sliding window, is made here once for the
        chunk's layers where they share it (`_shared_mask`). `tail` (decoding, a sample's loss): the
        logits, or the loss with `labels` [b, tail], of the last `tail` positions alone (0: all):
        the head's output is positions x vocabulary floats (4 GiB in fp32 for an 8k prompt and a
        128k vocabulary), where sampling reads the last one."""
        if tail and (self.topo.size("cp") > 1 or (self.execution.sequence_parallel and self.topo.tp_size > 1)):
            raise ValueError(f"tail={tail} takes the sequence's last positions, and under sequence or context "
                             "parallelism this rank holds a shard of it; run the model with neither")
        if self.first:
            h = self._embed(x)
            if self.cfg.pos == "learned":
                h = h + self.pos_embed[sequence_shard(positions, self.topo, self.execution, dim=-1)]  # SP: h is a chunk
        else:
            h = x
        blocks = [*self.layers.values(), *(depth.block for depth in self.mtp or ())]
        ropes = {local: self.rope(positions, cache is not None, local) for local in {b.local_rope for b in blocks}
                 if self.cfg.pos == "rope"}  # the global layers' RoPE, and the sliding layers' where it differs
        windows = {b.attn.window for b in blocks}
        if cache is None:  # once for all the chunk's layers of a window
            masks = {w: self._shared_mask(docs, positions, h, w) for w in windows}
        else:
            layers = {name: cache.setdefault(name, LayerCache(block.attn.window)) for name, block in self.layers.items()}
            # a left-padded batch: x's tokens join the keys each window's layers hold
            keys = {block.attn.window: layers[name].keys_with(x.shape[1]) for name, block in self.layers.items()}
            masks = {w: padded_visibility(positions, n, w) for w, n in keys.items()} if positions.dim() == 2 else {}
        for name, block in self.layers.items():
            rope, mask = ropes.get(block.local_rope), masks.get(block.attn.window)
            h = block(h, rope, docs=docs if mask is None else mask) if cache is None else \
                block(h, rope, layers[name], mask)
        if not self.last:
            return h
        if labels is None:
            return self._logits(self.norm(h[:, -tail:] if tail else h))
        ahead = None
        if labels.dim() == 3:  # multi-token prediction's targets beside the labels (model/mtp.py)
            labels, ahead = unpack_targets(labels)
        normed = self.norm(h[:, -tail:] if tail else h)  # the main model's output: the head's and depth 1's input
        loss = self._token_loss(normed, labels)
        if ahead is None or self.mtp is None or not torch.is_grad_enabled():  # validation: the main loss alone
            return loss
        state, docs = self.execution.mtp_loss, {w: docs if masks.get(w) is None else masks[w] for w in windows}
        sums = self.mtp.losses(normed, ahead, self._embed, self._token_loss, ropes, docs, state)
        return with_mtp_gradient(loss, sums, state)

    def _embed(self, tokens: torch.Tensor) -> torch.Tensor:
        h = self.embed(tokens)
        if self.cfg.scale_embeddings:  # sqrt(d_model) in h's dtype first, as HF's Gemma rounds it
            h = h * h.new_full((), self.cfg.d_model ** 0.5)
        return h

    def _logits(self, h: torch.Tensor) -> torch.Tensor:
        """This rank's vocabulary slice of the logits of normed hidden states `h`."""
        weight = self.embed.weight if self.head is None else self.head.weight
        return column_parallel_linear(h, weight, self.topo, self.execution, in_bi=True)  # as self.head's

    def _token_loss(self, h: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        """The summed token loss of normed hidden states `h` against `labels`."""
        if self.execution.loss_chunk:
            weight = self.embed.weight if self.head is None else self.head.weight
            return chunked_head_loss(h, weight, labels, self.cfg.vocab_size, self.topo, self.execution,
                                     self.execution.loss_chunk)
        return vocab_parallel_cross_entropy(self._logits(h), labels, self.cfg.vocab_size, self.topo).sum()

    def rope(self, positions: torch.Tensor, decoding: bool = False, local: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
        """`rope_tables` of `positions` (`local`: the sliding layers' own, Block.local_rope), kept
        for the next call with the same, unmodified tensor: the trainer passes one positions tensor
        every step; decoding passes new ones. Never under inference mode, whose tensors have no
        version and cannot be saved for a later backward."""
        if torch.is_inference_mode_enabled() or positions.is_inference():
            return rope_tables(positions, self.cfg, self._frequencies(positions, decoding, local), local)
        kept = self._rope.get(local)
        if kept is None or kept[0] is not positions or kept[1] != positions._version:
            kept = self._rope[local] = positions, positions._version, rope_tables(
                positions, self.cfg, self._frequencies(positions, decoding, local), local)
        return kept[2]

    def _frequencies(self, positions: torch.Tensor, decoding: bool, local: bool = False) -> torch.Tensor:
        """rope_frequencies for `positions`, each set made once per device (LongRoPE's factors are
        Python lists, whose copy to a GPU waits for it: else once per micro-batch under
        train.reset_positions). The length that picks LongRoPE's factors (uses_long_factors) is,
        decoding, the largest position + 1, the tokens so far, as transformers' generate picks
        them each step (a left-padded batch's rows each by their own, as each prompt alone: then
        [b, 1, 1, rotary_dim / 2], train/batched.py) (the cache keeps keys rotated before a step crossed
        original_max_position_embeddings, as transformers' does); else the whole window, which a
        cp rank holds part of. Where train.reset_positions restarts positions at each document,
        transformers would pick by the longest document of the batch; tetrad keeps the window's
        choice, which every layout and micro-batch makes alike without a collective."""
        length = positions.amax(-1) + 1 if decoding else positions.shape[-1] * self.topo.size("cp")
        long, device = uses_long_factors(self.cfg, length), positions.device

        def made(which: bool) -> torch.Tensor:
            if (device, which, local) not in self._inv_freq:
                with torch.inference_mode(False):  # kept for later calls, with autograd too
                    self._inv_freq[device, which, local] = rope_frequencies(self.cfg, device, which, local)
            return self._inv_freq[device, which, local]
        return torch.where(long[..., None, None, None], made(True), made(False)) if isinstance(long, torch.Tensor) \
            else made(long)
