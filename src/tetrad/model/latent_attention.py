"""Multi-head latent attention (MLA: DeepSeek-V2/V3, model.kv_lora_rank > 0), as transformers'
DeepseekV3Attention computes it.

Each token's keys and values come from one small latent: wkv_a maps x to [c (kv_lora_rank),
k_rope (qk_rope_head_dim)], c is normed (kv_a_norm) and wkv_b maps it to every head's [k_nope,
v]; a head's key is [k_nope, RoPE(k_rope)], k_rope one vector every head shares. Its query is
[q_nope, RoPE(q_rope)], from x through wq, or through the q latent (wq_a, q_a_norm, wq_b) where
model.q_lora_rank > 0; the latent norms' eps is 1e-6 whatever model.norm_eps is (LATENT_NORM_EPS).
RoPE rotates the rope dims alone (apply_rope's pairing, no interleave: an import de-interleaves
DeepSeek's weights). Softmax scale (nope + rope) ** -0.5, times YaRN's mscale ** 2 (model/rope.py's
`yarn_softmax_factor`).

Tensor parallelism: the down projections (wq_a, wkv_a) and their norms are replicated, the up
projections column-parallel by heads, wo row-parallel. The latents are made from this rank's
tokens and then handed to the heads (mappings.tp_input): under sequence parallelism each rank
projects its sequence chunk and the latents, q_lora_rank + kv_lora_rank + rope wide, are
all-gathered (Megatron-Core's choice: not d_model wide x), so each rank's down projections' and
norms' gradients cover its tokens alone and are summed over tp as every replicated weight's are
under SP (parallel/data/finalize.py); without SP tp_input's backward sums the latents' gradient
over the ranks' heads, so every rank's replicated gradients are whole.

The attention core (model/attention.py: every kernel, the ring, all-to-all, masks) takes q, k and
v of one width, which the ring's travelling block (k and v stacked) and the fused CUDA kernels
need: the values are zero-padded from v_head_dim to the q/k width nope + rope and the output's
padding sliced off (the padded columns' weights are exactly zero; their output is zero). That
costs (nope + rope - v) / (nope + rope) more of the AV product (DeepSeek-V3: 192 for 128).

Decoding caches the latent alone, [c, RoPE(k_rope)] per token (kv_lora_rank + rope numbers: 576
for DeepSeek-V3 where per-head keys and values are 128 x 2 x 192), and attends in the latent
space (the up projections absorbed): q_nope times each head's k rows of wkv_b gives the head a
query over c, so every head attends over the one latent as over a single shared key (keys and
values the same cached tensor), and the values' rows of wkv_b map its output back to v. That
one key head is what kv_cache.folded_attention takes with the heads folded into the query rows,
so no kernel copies the cache per head (there: which kernel runs). A prompt with nothing cached
before it (its first pass, or a chat's after keep(0)) runs the training forward's attention
instead, per-head keys of nope + rope (DeepSeek-V3: 192, flash's on CUDA, against the absorbed
576, which no flash kernel takes) whose memory is the prompt's alone, and caches only the
latents: a prompt is compute-bound, and the absorbed form costs a query head 2 kv_lora_rank +
rope multiply-adds per key (1088) where this one costs 2 (nope + rope) with the padded values (384).
"""

from __future__ import annotations

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.utils.checkpoint import checkpoint

from tetrad.config import ModelConfig
from tetrad.model.attention import attention
from tetrad.model.execution import Execution
from tetrad.model.kv_cache import LayerCache, cached_attention
from tetrad.model.layers import ColumnParallelLinear, Norm, ReplicatedLinear, RowParallelLinear
from tetrad.model.mappings import linear, tp_input
from tetrad.model.masks import additive_bias
from tetrad.model.replay import RingReplay
from tetrad.model.rope import apply_rope, yarn_softmax_factor

# The latent norms' epsilon, whatever model.norm_eps is: transformers' DeepSeek-V2/V3 build
# q_a_layernorm and kv_a_layernorm with their RMSNorm's default 1e-6, not rms_norm_eps.
LATENT_NORM_EPS = 1e-6


class LatentAttention(nn.Module):
    """Model/llama.py's Block builds it for Attention where cfg.latent_attention; the same calls.
    `window`: this layer's sliding window (0: none)."""

    def __init__(self, cfg: ModelConfig, topo, ex: Execution, out_std: float, window: int = 0):
        super().__init__()
        self.cfg, self.topo, self.ex, self.window = cfg, topo, ex, window
        self.heads = cfg.n_heads // topo.tp_size
        self.q_scale = yarn_softmax_factor(cfg)  # the kernels scale by (nope + rope) ** -0.5
        hd, r = cfg.head_dim, cfg.kv_lora_rank
        if cfg.q_lora_rank:
            self.wq_a = ReplicatedLinear(cfg.d_model, cfg.q_lora_rank, ex)
            self.q_a_norm = Norm(cfg, cfg.q_lora_rank, eps=LATENT_NORM_EPS)
            self.wq_b = ColumnParallelLinear(cfg.q_lora_rank, cfg.n_heads * hd, topo, ex)
        else:
            self.wq = ColumnParallelLinear(cfg.d_model, cfg.n_heads * hd, topo, ex)
        self.wkv_a = ReplicatedLinear(cfg.d_model, r + cfg.qk_rope_head_dim, ex)
        self.kv_a_norm = Norm(cfg, r, eps=LATENT_NORM_EPS)
        self.wkv_b = ColumnParallelLinear(r, cfg.n_heads * (cfg.qk_nope_head_dim + cfg.v_head_dim), topo, ex)
        self.wo = RowParallelLinear(cfg.n_heads * cfg.v_head_dim, cfg.d_model, topo, ex, std=out_std)
        self.recompute_core = False  # selective recompute (see `core`)
        self.ring_replay = RingReplay()  # per-op recompute under ring cp (model/replay.py)

    def forward(self, x: torch.Tensor, rope: tuple[torch.Tensor, torch.Tensor],
                cache: LayerCache | None = None, docs=None) -> torch.Tensor:
        """As llama.Attention's: `cache` (decoding) holds the earlier tokens' latents; `docs` the
        documents or mask bias, or with a cache a left-padded batch's visibility."""
        q, latent, k_rope = self._project(x)
        b, s = q.shape[:2]
        if cache is not None and cache.length:
            out = self._decode(q, latent, k_rope, rope, cache, docs)
        else:
            if cache is not None:  # a prompt (module docstring): the training forward's attention
                cache.extend(self._latent_keys(latent, k_rope, rope))
                docs = None if docs is None else additive_bias(docs, q.dtype)
            kv = linear(latent, self.wkv_b.weight, self.ex).view(b, s, self.heads, -1)
            if self.recompute_core and torch.is_grad_enabled():
                out = checkpoint(self.core, q, kv, k_rope, rope, docs, use_reentrant=False)
            else:
                out = self.core(q, kv, k_rope, rope, docs)
        return self.wo(out.reshape(b, s, self.heads * self.cfg.v_head_dim))

    def _project(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """(q [b, s, heads, nope + rope] times q_scale, the normed kv latent [b, s, kv_lora_rank],
        k_rope [b, s, 1, rope] unrotated) of the whole local sequence. The latents, made from this
        rank's tokens (under SP its chunk), go to the heads in one tp_input (module docstring)."""
        cfg, r = self.cfg, self.cfg.kv_lora_rank
        kv_a = self.wkv_a(x)
        latents = [self.kv_a_norm(kv_a[..., :r]), kv_a[..., r:]]
        if cfg.q_lora_rank:
            latents.append(self.q_a_norm(self.wq_a(x)))
        whole = tp_input(torch.cat(latents, dim=-1), self.topo, self.ex)
        latent, k_rope = whole[..., :r], whole[..., r:r + cfg.qk_rope_head_dim]
        q = linear(whole[..., r + cfg.qk_rope_head_dim:], self.wq_b.weight, self.ex) if cfg.q_lora_rank \
            else self.wq(x)
        b, s = latent.shape[:2]
        q = q.view(b, s, self.heads, cfg.head_dim)
        return (q * self.q_scale if self.q_scale != 1.0 else q), latent, k_rope.view(b, s, 1, -1)

    def core(self, q, kv, k_rope, rope, docs=None):
        """RoPE, the keys and padded values, and attention: what selective recompute recomputes,
        keeping q, the up-projected kv [b, s, heads, nope + v] and k_rope. Returns [b, s, heads, v]."""
        nope, v = self.cfg.qk_nope_head_dim, self.cfg.v_head_dim
        k_nope, value = kv[..., :nope], kv[..., nope:]
        q = torch.cat([q[..., :nope], apply_rope(q[..., nope:], *rope)], dim=-1)
        k = torch.cat([k_nope, apply_rope(k_rope, *rope).expand(-1, -1, self.heads, -1)], dim=-1)
        value = F.pad(value, (0, q.shape[-1] - v))
        out = attention(q, k, value, self.topo, self.ex.cp_algo, self.ring_replay, docs, self.window)
        return out[..., :v]

    def _latent_keys(self, latent, k_rope, rope) -> torch.Tensor:
        """What the cache holds of each token: [c, RoPE(k_rope)], [b, s, 1, kv_lora_rank + rope]."""
        return torch.cat([latent[:, :, None], apply_rope(k_rope, *rope)], dim=-1)

    def _decode(self, q, latent, k_rope, rope, cache: LayerCache, visible=None) -> torch.Tensor:
        """The newest tokens' attention over the cached latents, the up projections absorbed
        (module docstring); the kernels scale by the latent query's width, so q is rescaled to
        the model's. Returns [b, s, heads, v]."""
        nope, r = self.cfg.qk_nope_head_dim, self.cfg.kv_lora_rank
        w = self.wkv_b.weight.view(self.heads, -1, r)  # per head: nope rows of k, then v rows
        q_latent = torch.einsum("bshn,hnr->bshr", q[..., :nope], w[:, :nope])
        q = torch.cat([q_latent, apply_rope(q[..., nope:], *rope)], dim=-1)
        q = q * (q.shape[-1] / self.cfg.head_dim) ** 0.5
        keys, _ = cache.extend(self._latent_keys(latent, k_rope, rope))
        out = cached_attention(q, keys, keys, self.window, visible)[..., :r]  # values: the latent's c
        return torch.einsum("bshr,hvr->bshv", out, w[:, nope:])
