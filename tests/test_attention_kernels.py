"""Attention kernel dispatch: which kernel runs for every (device, dtype, GQA, cp_algo), the
numerics of the block-merge path the CPU uses against plain SDPA, and the CUDA kernels' calls
checked for arguments and shapes on the meta device (no GPU here)."""

import pytest
import torch
import torch.nn.functional as F

from conftest import assert_all_within, run_ranks
from tetrad.device import DTYPES
from tetrad.model import attention as attn

# (device, dtype, gqa, cp_algo, cudnn_preferred) -> (kernel, expand_kv). On CUDA every case is a
# fused kernel; fp32 GQA repeats K/V heads because SDPA's memory-efficient kernel rejects them.
EXPECTED = {}
for _dtype in DTYPES:
    for _gqa in (False, True):
        for _algo in ("ring", "alltoall"):
            EXPECTED["cpu", _dtype, _gqa, _algo, False] = ("cpu_flash", False)
            for _cudnn in (False, True):
                half = _dtype != "fp32"
                name = ("cudnn" if _cudnn and (_algo != "ring" or not _gqa) else "flash") if half else "efficient"
                EXPECTED["cuda", _dtype, _gqa, _algo, _cudnn] = (name, _gqa and not half)


@pytest.mark.parametrize("case", sorted(EXPECTED), ids=lambda c: "-".join(map(str, c)))
def test_dispatch_table(case):
    device, dtype, gqa, algo, cudnn = case
    kernel = attn.choose_kernel(device, DTYPES[dtype], gqa, algo, cudnn)
    assert (kernel.name, kernel.expand_kv) == EXPECTED[case]
    assert device != "cuda" or kernel.name in ("flash", "efficient", "cudnn")  # never the math path on CUDA


def test_other_accelerators_keep_a_log_sum_exp_kernel():
    assert attn.choose_kernel("xpu", torch.float32, True, "ring") == attn.Kernel("math", True)
    assert attn.choose_kernel("xpu", torch.bfloat16, True, "alltoall") == attn.Kernel("sdpa", False)


# head_dim -> the ring's CUDA kernel for (bf16, bf16 where cuDNN is preferred, fp32, bf16 with a
# document mask): the fused ops the ring calls directly refuse what SDPA would pad or avoid.
HEAD_DIMS = {64: ("flash", "cudnn", "efficient", "efficient"), 128: ("flash", "cudnn", "efficient", "efficient"),
             256: ("flash", "flash", "efficient", "efficient"),  # cuDNN: up to 128 on every GPU
             200: ("efficient", "efficient", "efficient", "efficient"),  # flash's backward on sm86/89/120
             288: ("efficient", "efficient", "efficient", "efficient"),  # flash: up to 256
             100: ("math", "math", "efficient", "math"),  # not a multiple of 8; of 4 (fp32's alignment)
             50: ("math", "math", "math", "math")}


@pytest.mark.parametrize("head_dim", sorted(HEAD_DIMS))
def test_head_dims_a_fused_kernel_refuses_go_to_the_next_down_to_math(head_dim):
    """Ring attention on CUDA calls the flash, cuDNN and memory-efficient ops directly, which
    reject head dims SDPA's one call pads or falls back from; choose_kernel passes those to the
    next kernel that takes them, down to the math path (K/V repeated for GQA), so ring cp runs
    any head_dim. One SDPA call then lets torch choose (no K/V repeated for a kernel it won't run)."""
    for gqa in (False, True):
        got = (attn.choose_kernel("cuda", torch.bfloat16, False, "ring", head_dim=head_dim).name,
               attn.choose_kernel("cuda", torch.bfloat16, False, "ring", True, head_dim=head_dim).name,
               attn.choose_kernel("cuda", torch.float32, gqa, "ring", head_dim=head_dim).name,
               attn.choose_kernel("cuda", torch.bfloat16, gqa, "ring", masked=True, head_dim=head_dim).name)
        assert got == HEAD_DIMS[head_dim]
        math = attn.choose_kernel("cuda", torch.float32, gqa, "ring", head_dim=head_dim).name == "math"
        assert attn.choose_kernel("cuda", torch.float32, gqa, "alltoall", head_dim=head_dim) == \
            (attn.Kernel("sdpa", False) if math else attn.Kernel("efficient", gqa))
        assert attn.choose_kernel("cpu", torch.bfloat16, gqa, "ring", head_dim=head_dim).name == "cpu_flash"
    assert attn.choose_kernel("cuda", torch.bfloat16, True, "ring", head_dim=head_dim).expand_kv == \
        (HEAD_DIMS[head_dim][0] in ("efficient", "math"))


def _blockwise(q, k, v, dout, kernel):
    """The ring's path on one process: the sequence in two K/V blocks, each row's blocks merged
    by log-sum-exp, then every block's backward from the merged output and log-sum-exp."""
    half, groups = q.shape[2] // 2, attn._expansion(q, k, kernel)
    kx, vx = attn._repeat_kv(k, groups), attn._repeat_kv(v, groups)
    first, second = slice(None, half), slice(half, None)
    blocks = [(first, first, True), (second, first, False), (second, second, True)]  # (rows, cols, causal)
    out = torch.zeros(q.shape, dtype=torch.float32)
    lse = torch.full(q.shape[:3], float("-inf"))
    for rows, cols, causal in blocks:
        attn._merge(out, lse, rows, *attn._block_forward(q[:, :, rows], kx[:, :, cols], vx[:, :, cols],
                                                         causal, kernel.name))
    out = out.to(q.dtype)
    dq, dk, dv = torch.zeros(q.shape), torch.zeros(kx.shape), torch.zeros(vx.shape)
    for rows, cols, causal in blocks:
        g = attn._block_backward(dout[:, :, rows], q[:, :, rows], kx[:, :, cols], vx[:, :, cols],
                                 out[:, :, rows], lse[:, :, rows], causal, kernel.name)
        dq[:, :, rows] += g[0].float()
        dk[:, :, cols] += g[1].float()
        dv[:, :, cols] += g[2].float()
    return out, dq, attn._sum_groups(dk, groups), attn._sum_groups(dv, groups)


def _merge_errors():
    errors = {}
    for dtype_name, dtype in DTYPES.items():
        for kv_heads in (4, 2):
            g = torch.Generator().manual_seed(0)
            q, k, v, dout = (torch.randn(2, n, 16, 8, generator=g).to(dtype) for n in (4, kv_heads, kv_heads, 4))
            ref = [t.clone().requires_grad_() for t in (q, k, v)]
            ref_out = F.scaled_dot_product_attention(*ref, is_causal=True, enable_gqa=kv_heads != 4)
            ref_out.backward(dout)
            expected = [ref_out.detach()] + [t.grad for t in ref]
            for kernel in (attn.choose_kernel("cpu", dtype, kv_heads != 4, "ring"), attn.Kernel("math", True)):
                got = _blockwise(q, k, v, dout, kernel)
                errors[dtype_name, kv_heads, kernel.name] = [
                    float((a.float() - b.float()).abs().max()) for a, b in zip(got, expected)]
    return errors


def test_merge_path_matches_sdpa_forward_and_backward():
    """The CPU ring path (and the math kernel kept for other devices) against one SDPA call:
    fp32 to a few ulps, bf16/fp16 to their rounding of the O(1) outputs and gradients."""
    errors = run_ranks(_merge_errors, 1)[0]  # in a child: see test_cp._in_child
    assert len(errors) == 12
    for (dtype, kv_heads, kernel), errs in errors.items():  # output, dq, dk, dv
        assert_all_within(errs, {"fp32": 2e-6, "bf16": 3e-2, "fp16": 5e-3}[dtype])


def _math_kernel_of_bf16():
    """The math kernel's output and gradients from bf16 inputs, and from the same values in fp32."""
    g = torch.Generator().manual_seed(0)
    q, k, v, dout = (torch.randn(1, 2, 8, 8, generator=g).bfloat16() for _ in range(4))
    wide = [t.float() for t in (q, k, v)]
    out, lse = attn._block_forward(q, k, v, True, "math")
    got = [out, lse, *attn._block_backward(dout, q, k, v, out, lse, True, "math")]
    expected = [*attn._block_forward(*wide, True, "math"),
                *attn._block_backward(dout.float(), *wide, out, lse, True, "math")]
    return got, expected


def test_math_kernel_hands_on_fp32():
    """The math kernel (the ring's where no fused one fits) returns what it computes, fp32: the ring
    merges outputs and sums gradients in fp32, so a bf16 cast here added a rounding per block
    (measured at cp 2: 20-45% more error in its bf16 output and gradients; fused kernels round theirs)."""
    got, expected = run_ranks(_math_kernel_of_bf16, 1)[0]  # in a child: see test_cp._in_child
    for a, b in zip(got, expected):
        torch.testing.assert_close(a, b, rtol=0, atol=0)


# (kernel, dtype, kv heads of 4 query heads, cudnn_preferred): every CUDA kernel the ring uses.
META_CASES = [("flash", torch.bfloat16, 4, False), ("flash", torch.float16, 2, False),
              ("efficient", torch.float32, 4, False), ("efficient", torch.float32, 2, False),
              ("cudnn", torch.bfloat16, 4, True)]


@pytest.mark.parametrize("name,dtype,kv_heads,cudnn", META_CASES, ids=lambda c: str(c))
def test_cuda_kernel_calls_on_meta(name, dtype, kv_heads, cudnn):
    """The CUDA ops' argument lists and result shapes, through torch's meta kernels: the
    log-sum-exp comes back as [b, h, sq] whatever the kernel pads or appends, and the gradients
    have the shapes of the inputs (K/V heads only where the kernel takes grouped heads)."""
    kernel = attn.choose_kernel("cuda", dtype, kv_heads != 4, "ring", cudnn)
    assert kernel.name == name
    q = torch.empty(2, 4, 40, 64, dtype=dtype, device="meta")
    k = v = torch.empty(2, 4 if kernel.expand_kv else kv_heads, 24, 64, dtype=dtype, device="meta")
    out, lse = attn._block_forward(q, k, v, False, name)
    assert out.shape == q.shape and lse.shape == (2, 4, 40) and lse.dtype == torch.float32
    grads = attn._block_backward(torch.empty_like(out), q, k, v, out, lse, False, name)
    assert [tuple(g.shape) for g in grads] == [tuple(q.shape), tuple(k.shape), tuple(v.shape)]
