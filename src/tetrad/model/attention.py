"""The attention core: softmax(q k^T / sqrt(d)) v with a causal mask, on this rank's heads.

`attention` dispatches on context parallelism: with cp = 1 it is one
`scaled_dot_product_attention` call (fused and flash kernels where the device has them); with
cp > 1 each rank holds two load-balanced chunks of the sequence (dist/layout.py) and either

- ring (`cp_algo="ring"`): K/V blocks travel the CP ring with non-blocking point-to-point, the
  next block in flight while the current one is computed, and partial outputs are merged with
  the log-sum-exp trick. The backward re-circulates K/V and passes the dK/dV accumulators
  around the ring, so nothing but the local block is kept for backward. Only KV heads travel.
  Under per-op recompute (`selective-op`) the recompute replays the ring's kept result
  (`RingReplay`) instead of running it again.
- all-to-all (`cp_algo="alltoall"`, Ulysses): re-shard from sequence to heads, attend over the
  whole sequence on heads/cp heads, re-shard back.

Kernels (`choose_kernel`, one decision per call): on CUDA the fused kernels whose forward returns
the log-sum-exp and whose backward takes the merged output and log-sum-exp, as torch's own ring
attention uses them: flash for bf16/fp16 (cuDNN where torch itself prefers it: Hopper/Blackwell
with a recent cuDNN), memory-efficient for fp32; on CPU the CPU flash kernel; elsewhere a plain
fp32 matmul + logsumexp with the same contract. Kernels without grouped-query support get K/V
heads repeated to the query heads (`expand_kv`), so fp32 GQA never falls back to SDPA's math kernel.

Masks beyond causality (model/masks.py): a sliding window (`window`, model.sliding_window) and
documents (`docs`, train.document_mask), AND-ed. The local and all-to-all paths run flash's
varlen kernel on CUDA in 16-bit (model/varlen.py: the rows and documents as segments), else hand
SDPA the sequence's additive bias (one tensor per micro-batch that every layer shares, unless the
layers recompute attention, which then build it); the ring decides on the host, from positions and the
window's document ids (`Documents`), which blocks it computes and which of those need a mask
(`ring_blocks`: a block no query row of which sees a key is skipped, so no layer waits on the
device), builds each masked block's visibility from the two ranks' chunks, and merges a row that
sees none of a block's keys as no contribution.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from tetrad import device as devices
from tetrad.dist.sequence import load_balanced_order
from tetrad.model.execution import run_eagerly
from tetrad.model.documents import Documents
from tetrad.model.flops import hides_keys
from tetrad.model.masks import RingMasks, additive_bias, block_visibility, ring_blocks, sequence_bias
from tetrad.model.replay import RingReplay
from tetrad.model.varlen import Packing, sequence_packing, varlen_attention


@dataclass(frozen=True)
class Kernel:
    """Which attention kernel runs: "flash", "efficient", "cudnn" (CUDA), "cpu_flash", "math"
    (the fp32 block kernel below) or "sdpa" (torch's own choice), and whether K/V heads are
    repeated to the query heads first because the kernel has no grouped-query support."""
    name: str
    expand_kv: bool


def choose_kernel(device: str | torch.device, dtype: torch.dtype, gqa: bool, cp_algo: str,
                  cudnn_preferred: bool = False, masked: bool = False, head_dim: int = 128) -> Kernel:
    """The kernel for attention on `device` in `dtype`. `cp_algo="ring"` needs a block
    kernel that returns the log-sum-exp; otherwise (all-to-all, or no CP) one SDPA call runs
    over the whole sequence, where torch picks among the kernels this choice makes eligible.

    SDPA's memory-efficient kernel (the only CUDA one for fp32) rejects grouped-query heads, so
    fp32 GQA repeats them rather than fall back to the math kernel; flash and the CPU kernel take
    them as they are. `cudnn_preferred` is `device.prefers_cudnn_attention`: where it holds, torch's
    one SDPA call runs cuDNN for bf16/fp16, grouped heads included (seen on an H200, torch 2.11),
    and the ring's blocks call cuDNN too, except with GQA (its block op takes equal heads only).
    Causal masking does not enter: a ring's causal blocks are square, which every kernel takes.
    A mask beyond it (`masked`: documents, a sliding window) does: over the whole sequence, where
    flash takes the dtype and head dim, its varlen kernel (model/varlen.py: segments and a window,
    grouped heads as they are); otherwise, and for the ring's blocks, the memory-efficient kernel
    with an additive bias; the CPU kernel takes one too. So do `head_dim` and whether a CUDA
    `device` runs flash at all (device.py: Ampere or newer; a type alone is taken to).
    """
    device_type, flash = torch.device(device).type, devices.runs_flash_attention(device)
    fits = devices.fused_attention_kernels(dtype, head_dim, flash) if device_type == "cuda" else set()
    if device_type == "cpu":
        return Kernel("cpu_flash", False)
    if "flash" in fits and not masked:
        return Kernel("cudnn" if cudnn_preferred and (cp_algo != "ring" or not gqa) and "cudnn" in fits else "flash", False)
    if "flash" in fits and cp_algo != "ring":
        return Kernel("varlen", False)
    if "efficient" in fits:
        return Kernel("efficient", gqa)
    return Kernel("math", gqa) if cp_algo == "ring" else Kernel("sdpa", False)


def uses_varlen(device: str | torch.device, dtype: torch.dtype, head_dim: int) -> bool:
    """Whether a masked attention over the whole sequence runs flash's varlen kernel (choose_kernel)."""
    return choose_kernel(device, dtype, False, "alltoall", masked=True, head_dim=head_dim).name == "varlen"


def sequence_mask(docs: Documents | None, window: int, rows: int, length: int, dtype: torch.dtype,
                  device: torch.device, head_dim: int) -> torch.Tensor | Packing | None:
    """What the whole-sequence paths attend with, for a micro-batch of `rows` sequences of
    `length`: the varlen kernel's `Packing` (uses_varlen), else the additive bias in `dtype`
    (masks.sequence_bias); None where causality alone masks."""
    if docs is None and not hides_keys(window, length):
        return None
    if uses_varlen(device, dtype, head_dim):
        return sequence_packing(docs, window, rows, length, device)
    return sequence_bias(docs, window, length, dtype, device)


def local_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                    docs: Documents | torch.Tensor | Packing | None = None, window: int = 0) -> torch.Tensor:
    """Causal attention over a whole sequence held by this rank, within documents if `docs` and
    the sliding `window` (0: none).

    q: [b, s, heads, d]; k, v: [b, s, kv_heads, d] (grouped-query when kv_heads < heads); docs:
    the sequence's mask as `sequence_mask` makes it (shared by the layers: the window is in it), a
    bias [b or 1, 1, s, s] or a `Packing`, or its `Documents` (or None) to make it here.
    Returns [b, s, heads, d]."""
    mask = docs if isinstance(docs, (torch.Tensor, Packing)) else \
        sequence_mask(docs, window, q.shape[0], q.shape[1], q.dtype, q.device, q.shape[-1])
    if isinstance(mask, Packing):  # eager: the segments change every micro-batch (no recompile)
        return run_eagerly(varlen_attention, q, k, v, mask)
    q, k, v = (t.transpose(1, 2) for t in (q, k, v))
    groups = q.shape[1] // k.shape[1]
    if choose_kernel(q.device, q.dtype, groups > 1, "alltoall", masked=mask is not None, head_dim=q.shape[-1]).expand_kv:
        k, v = _repeat_kv(k, groups), _repeat_kv(v, groups)
    out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=mask is None,
                                         enable_gqa=k.shape[1] != q.shape[1])
    return out.transpose(1, 2)


def attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, topo, cp_algo: str = "ring",
              replay: RingReplay | None = None, docs: Documents | torch.Tensor | None = None,
              window: int = 0) -> torch.Tensor:
    """Causal attention of this rank's tokens (shapes as `local_attention`), context parallel
    over topo's cp group with `cp_algo` ("ring" or "alltoall") when cp > 1. `replay`: the
    layer's RingReplay, which a per-op recompute opens. `docs`: document masking's input: the
    whole sequence's `Documents` (not this rank's shard), or for the local and all-to-all paths
    the sequence's bias (masks.sequence_bias, the window in it). `window`: model.sliding_window."""
    if topo.size("cp") == 1:
        return local_attention(q, k, v, docs, window)
    if cp_algo == "ring":
        return run_eagerly(ring_attention, q, k, v, topo, replay, docs, window)
    return alltoall_attention(q, k, v, topo, docs, window)


def ring_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, topo, replay: RingReplay | None = None,
                   docs: Documents | None = None, window: int = 0) -> torch.Tensor:
    """`_RingAttention` on the kernel this device and dtype take (shapes as `attention`), over the
    blocks the masks leave (decided on the host: masks.ring_blocks)."""
    cp, rank = topo.size("cp"), topo.local_rank("cp")
    blocks = ring_blocks(cp, rank, q.shape[1] // 2, window, docs.host if docs is not None else None)
    masks = RingMasks(window, docs, blocks)
    kernel = choose_kernel(q.device, q.dtype, k.shape[2] != q.shape[2], "ring",
                           devices.prefers_cudnn_attention(q.device), masked=any(b and b.masked for b in blocks),
                           head_dim=q.shape[-1])
    out = _RingAttention.apply(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), topo, kernel, replay, masks)
    return out.transpose(1, 2)


# ----------------------------------------------------------------------------- block kernels
# q [b, h, sq, d]; k, v [b, h or kv_heads, sk, d]; lse [b, h, sq] in fp32. A causal block is
# square. Dropout is 0, so the CUDA backwards never read their random-number state. `visible`:
# a mask [b or 1, 1, sq, sk] (bool), for the kernels that take one (choose_kernel).
aten = torch.ops.aten


def _bias(visible, q, kernel: str):
    """`visible` as the additive bias (q's dtype) a fused kernel takes; the memory-efficient one
    wants it over every head, its rows 16-element aligned (as SDPA pads it)."""
    if visible is None:
        return None
    bias = additive_bias(visible, q.dtype)
    if kernel != "efficient":
        return bias
    sk = bias.shape[-1]
    return F.pad(bias, (0, -sk % 16))[..., :sk].expand(q.shape[0], q.shape[1], q.shape[2], sk)


def _block_forward(q, k, v, causal: bool, kernel: str, visible=None):
    """(output, log-sum-exp) of q's rows over one K/V block."""
    q, k, v = q.contiguous(), k.contiguous(), v.contiguous()
    bias = _bias(visible, q, kernel)
    if kernel == "cpu_flash":
        return aten._scaled_dot_product_flash_attention_for_cpu(q, k, v, 0.0, causal, attn_mask=bias)
    if kernel == "flash":
        return aten._scaled_dot_product_flash_attention(q, k, v, 0.0, causal)[:2]
    if kernel == "efficient":  # its log-sum-exp is padded to a multiple of 32 rows
        out, lse = aten._scaled_dot_product_efficient_attention(q, k, v, bias, True, 0.0, causal)[:2]
        return out, lse[..., :q.shape[2]]
    if kernel == "cudnn":  # its log-sum-exp has a trailing unit dimension
        out, lse = aten._scaled_dot_product_cudnn_attention(q, k, v, None, True, 0.0, causal)[:2]
        return out, lse.reshape(q.shape[:3])
    return _math_forward(q, k, v, causal, visible)


def _math_forward(q, k, v, causal: bool, visible=None):
    """In fp32, as its backward's gradients: the ring merges and sums in fp32, so no rounding per block."""
    scores = _scores(q, k, causal, visible)
    lse = scores.logsumexp(-1)
    return torch.exp(scores - lse[..., None]) @ v.float(), lse


def _block_backward(dout, q, k, v, out, lse, causal: bool, kernel: str, visible=None):
    """dq, dk, dv of one block, given the *final* output and log-sum-exp of the rows."""
    dout, q, k, v, out, lse = (t.contiguous() for t in (dout, q, k, v, out, lse))
    sq, sk = q.shape[2], k.shape[2]
    bias = _bias(visible, q, kernel)
    if kernel == "cpu_flash":
        return aten._scaled_dot_product_flash_attention_for_cpu_backward(dout, q, k, v, out, lse, 0.0, causal,
                                                                         attn_mask=bias)
    seed, offset = (torch.empty((), dtype=torch.long, device=q.device) for _ in range(2))
    if kernel == "flash":
        return aten._scaled_dot_product_flash_attention_backward(
            dout, q, k, v, out, lse, None, None, sq, sk, 0.0, causal, seed, offset)
    if kernel == "efficient":
        lse = F.pad(lse, (0, -sq % 32))
        return aten._scaled_dot_product_efficient_attention_backward(
            dout, q, k, v, bias, out, lse, seed, offset, 0.0, [True, True, True, False], causal)[:3]
    if kernel == "cudnn":
        return aten._scaled_dot_product_cudnn_attention_backward(
            dout, q, k, v, out, lse[..., None], seed, offset, None, None, None, sq, sk, 0.0, causal)
    return _math_backward(dout, q, k, v, out, lse, causal, visible)


def _math_backward(dout, q, k, v, out, lse, causal: bool, visible=None):
    scale = q.shape[-1] ** -0.5
    p = torch.exp(_scores(q, k, causal, visible) - lse[..., None])
    dout = dout.float()
    dv = p.transpose(-1, -2) @ dout
    ds = p * (dout @ v.float().transpose(-1, -2) - (dout * out.float()).sum(-1, keepdim=True))
    return (ds @ k.float()) * scale, (ds.transpose(-1, -2) @ q.float()) * scale, dv


def _scores(q, k, causal: bool, visible=None):
    scores = (q.float() @ k.float().transpose(-1, -2)) * q.shape[-1] ** -0.5
    if causal:
        mask = torch.ones(scores.shape[-2:], dtype=torch.bool, device=q.device).triu(1)
        scores = scores.masked_fill(mask, float("-inf"))
    if visible is not None:
        scores = scores.masked_fill(~visible, float("-inf"))
    return scores


# ----------------------------------------------------------------------------- ring

def _ring_steps(masks: RingMasks, cp: int, rank: int, half: int, device: torch.device) -> list:
    """Each ring step's (rows, cols, causal, visible) from its host-decided block (None: skipped),
    `visible` the block's mask on the device where it needs one (masks.block_visibility)."""
    return [None if b is None else (b.rows, b.cols, b.causal and not b.masked,
                                    block_visibility(masks, b, cp, rank, half, device)) for b in masks.blocks]


def _pass_on(tensor: torch.Tensor, topo):
    """Start sending `tensor` to the next CP rank and receiving the previous one's; returns
    (pending, receive buffer)."""
    cp, rank = topo.size("cp"), topo.local_rank("cp")
    recv = torch.empty_like(tensor)
    pending = topo.comm.p2p(sends=[(tensor, topo.global_rank(cp=(rank + 1) % cp))],
                            recvs=[(recv, topo.global_rank(cp=(rank - 1) % cp))], group="cp")
    return pending, recv


def _repeat_kv(x: torch.Tensor, groups: int) -> torch.Tensor:
    return x.repeat_interleave(groups, dim=1) if groups > 1 else x


def _merge(out: torch.Tensor, lse: torch.Tensor, rows: slice, blk_out: torch.Tensor, blk_lse: torch.Tensor):
    """Fold one block's (output, log-sum-exp) of `rows` into the fp32 running `out` and `lse`.
    A row whose block log-sum-exp is -inf saw none of the block's keys (document masking): it
    takes nothing from the block, whose output there is NaN or anything (kernels differ), and
    -inf minus -inf never enters its arithmetic."""
    old, old_out = lse[:, :, rows], out[:, :, rows]
    seen = blk_lse > float("-inf")
    new_lse = torch.where(seen, torch.logaddexp(old, blk_lse), old)
    merged = old_out * (old - new_lse).exp()[..., None] + blk_out.float() * (blk_lse - new_lse).exp()[..., None]
    out[:, :, rows] = torch.where(seen[..., None], merged, old_out)
    lse[:, :, rows] = new_lse


def _expansion(q: torch.Tensor, k: torch.Tensor, kernel: Kernel) -> int:
    """How many times each K/V head is repeated for `kernel` (1: it takes grouped heads)."""
    return q.shape[1] // k.shape[1] if kernel.expand_kv else 1


def _sum_groups(x: torch.Tensor, groups: int) -> torch.Tensor:
    b, h, s, d = x.shape
    return x.view(b, h // groups, groups, s, d).sum(2) if groups > 1 else x


def _ring_forward(q, k, v, topo, kernel: Kernel, masks: RingMasks):
    """The merged (output, fp32 log-sum-exp) of q over every rank's K/V, passed around the ring."""
    cp, rank = topo.size("cp"), topo.local_rank("cp")
    half, groups = q.shape[2] // 2, _expansion(q, k, kernel)
    out = torch.zeros(q.shape, dtype=torch.float32, device=q.device)
    lse = torch.full(q.shape[:3], float("-inf"), device=q.device)
    kv = torch.stack([k, v])  # the block that travels: KV heads only
    for step, block in enumerate(_ring_steps(masks, cp, rank, half, q.device)):
        pending, incoming = _pass_on(kv, topo) if step < cp - 1 else (None, None)
        if block is not None:
            rows, cols, causal, visible = block
            blk_out, blk_lse = _block_forward(q[:, :, rows], _repeat_kv(kv[0][:, :, cols], groups),
                                              _repeat_kv(kv[1][:, :, cols], groups), causal, kernel.name, visible)
            if visible is not None:  # a row that sees no key here: -inf (the CPU kernel says 0)
                blk_lse = blk_lse.masked_fill(~visible.any(-1), float("-inf"))
            _merge(out, lse, rows, blk_out, blk_lse)
        if pending is not None:
            pending.wait()
            kv = incoming
    return out.to(q.dtype), lse


class _RingAttention(torch.autograd.Function):
    """Ring attention over the CP group; q [b, heads, s, d], k/v [b, kv_heads, s, d], where s is
    this rank's two chunks. Its backward is a second ring, not autograd through the first."""

    @staticmethod
    def forward(ctx, q, k, v, topo, kernel: Kernel, replay: RingReplay | None, masks: RingMasks):
        args = (q, k, v, topo, kernel, masks)
        out, lse = replay.run(_ring_forward, *args) if replay is not None else _ring_forward(*args)
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.topo, ctx.kernel, ctx.masks = topo, kernel, masks  # its documents: the batch's, alive anyway
        return out

    @staticmethod
    def backward(ctx, dout):
        q, k, v, out, lse = ctx.saved_tensors
        topo, kernel = ctx.topo, ctx.kernel
        cp, rank = topo.size("cp"), topo.local_rank("cp")
        half, groups = q.shape[2] // 2, _expansion(q, k, kernel)
        dq = torch.zeros(q.shape, dtype=torch.float32, device=q.device)
        kv = torch.stack([k, v])
        dkv_pending = dkv_incoming = None
        for step, block in enumerate(_ring_steps(ctx.masks, cp, rank, half, q.device)):
            kv_pending, kv_incoming = _pass_on(kv, topo) if step < cp - 1 else (None, None)
            # The dK/dV of the block in hand, fp32; the accumulator for it arrives from the
            # previous rank and leaves for the next, reaching the owner after cp passes.
            dkv = torch.zeros(kv.shape, dtype=torch.float32, device=q.device)
            if block is not None:
                rows, cols, causal, visible = block
                dq_b, dk_b, dv_b = _block_backward(dout[:, :, rows], q[:, :, rows],
                                                   _repeat_kv(kv[0][:, :, cols], groups),
                                                   _repeat_kv(kv[1][:, :, cols], groups),
                                                   out[:, :, rows], lse[:, :, rows], causal, kernel.name, visible)
                dq[:, :, rows] += dq_b
                dkv[0][:, :, cols] = _sum_groups(dk_b.float(), groups)
                dkv[1][:, :, cols] = _sum_groups(dv_b.float(), groups)
            if dkv_pending is not None:
                dkv_pending.wait()
                dkv += dkv_incoming
            dkv_pending, dkv_incoming = _pass_on(dkv, topo)
            if kv_pending is not None:
                kv_pending.wait()
                kv = kv_incoming
        dkv_pending.wait()
        return dq.to(q.dtype), dkv_incoming[0].to(k.dtype), dkv_incoming[1].to(v.dtype), None, None, None, None


# ----------------------------------------------------------------------------- all-to-all

def _reshard(x: torch.Tensor, topo, to_heads: bool) -> torch.Tensor:
    """[b, s, H, d] sequence-sharded -> [b, cp·s, H/cp, d] head-sharded (to_heads), or back.
    The gathered sequence is the ranks' shards end to end, in rank order."""
    cp = topo.size("cp")
    if to_heads:
        b, s, h, d = x.shape
        send = x.reshape(b, s, cp, h // cp, d).permute(2, 0, 1, 3, 4).contiguous()
    else:
        b, s, h, d = x.shape[0], x.shape[1] // cp, x.shape[2], x.shape[3]
        send = x.reshape(b, cp, s, h, d).transpose(0, 1).contiguous()
    recv = torch.empty_like(send)
    topo.comm.all_to_all(recv, send, "cp")
    if to_heads:
        return recv.transpose(0, 1).reshape(b, cp * s, h // cp, d)
    return recv.permute(1, 2, 0, 3, 4).reshape(b, s, cp * h, d)


class _AllToAll(torch.autograd.Function):
    """Sequence <-> heads re-shard; the backward is the opposite re-shard."""

    @staticmethod
    def forward(ctx, x, topo, to_heads: bool):
        ctx.topo, ctx.to_heads = topo, to_heads
        return _reshard(x, topo, to_heads)

    @staticmethod
    def backward(ctx, grad):
        return _reshard(grad.contiguous(), ctx.topo, not ctx.to_heads), None, None


def alltoall_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, topo,
                       docs: Documents | torch.Tensor | None = None, window: int = 0) -> torch.Tensor:
    """Ulysses: every rank attends over the whole sequence for heads/cp of its heads. The
    gathered sequence is put in true-position order so the causal kernel (and the masks, `docs`
    and `window` as local_attention takes them) apply, then back."""
    cp = topo.size("cp")
    order = load_balanced_order(q.shape[1] * cp, cp, q.device)  # true position of each gathered token
    natural = torch.argsort(order)
    q = run_eagerly(_AllToAll.apply, q, topo, True)[:, natural]
    k = run_eagerly(_AllToAll.apply, k, topo, True)[:, natural]
    v = run_eagerly(_AllToAll.apply, v, topo, True)[:, natural]
    return run_eagerly(_AllToAll.apply, local_attention(q, k, v, docs, window)[:, order], topo, False)
