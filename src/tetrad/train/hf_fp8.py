"""Block-quantized fp8 weights in a Hugging Face folder, dequantized as they are read: DeepSeek-V3's
release (V3, V3.1, R1) stores most Linear weights as float8_e4m3fn with an fp32 inverse scale per
block of rows x columns, `<name>_scale_inv` [ceil(out / rows), ceil(in / columns)], its config.json
`quantization_config` {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic",
"weight_block_size": [128, 128]}. A weight is w.float() * its block's scale (one rounding, in fp32),
what DeepSeek's fp8_cast_bf16.py computes before it rounds to bf16, so fine-tuning needs no
dequantized copy on disk. A part of a weight (a tp rank's rows or columns) is dequantized from the
scales of the blocks it touches alone (`dequantize`'s `first`). Other quantizations are refused.
"""

from __future__ import annotations

from pathlib import Path

import torch

from tetrad.config import ConfigError

SCALE = "_scale_inv"  # the inverse scales of weight `k` are tensor k + SCALE
TAKEN = "quant_method 'fp8' with fmt 'e4m3', activation_scheme 'dynamic' and a weight_block_size [rows, columns]"


def fp8_block(hf: dict, source: Path) -> tuple[int, int] | None:
    """The block (rows, columns) config.json's quantization_config scales by, or None for weights
    that are not quantized; any quantization tetrad cannot dequantize is refused in one line."""
    q = hf.get("quantization_config")
    if not q:
        return None
    refuse = f"{source}: quantization_config {{}}; tetrad dequantizes {TAKEN} (DeepSeek-V3's fp8 release)"
    if q.get("quant_method") != "fp8":
        raise ConfigError(refuse.format(f"quant_method {q.get('quant_method')!r}") + ", or bf16, fp16 or fp32 weights")
    if q.get("fmt", "e4m3") != "e4m3":
        raise ConfigError(refuse.format(f"fmt {q['fmt']!r}"))
    if q.get("activation_scheme", "dynamic") != "dynamic":  # static: activation scales, for fp8 inference alone
        raise ConfigError(refuse.format(f"activation_scheme {q['activation_scheme']!r}"))
    if q.get("scale_fmt", "float") != "float":  # transformers' ue8m0: scales as exponents alone
        raise ConfigError(refuse.format(f"scale_fmt {q['scale_fmt']!r}"))
    block = q.get("weight_block_size")
    if not (isinstance(block, list) and len(block) == 2 and all(type(b) is int and b > 0 for b in block)):
        raise ConfigError(refuse.format(f"weight_block_size {block!r}"))
    return block[0], block[1]


def dequantize(w: torch.Tensor, scale_inv: torch.Tensor, block: tuple[int, int],
               first: tuple[int, int] = (0, 0)) -> torch.Tensor:
    """fp32 weights of fp8 `w`, a part of a weight whose first element is at (row, column) `first`
    of it, `scale_inv` the scales of the blocks that part touches (`scale_rows`): each block's scale
    repeated over its elements, cropped to the part (the weight's last blocks may be partial)."""
    rows, cols = block
    top, left = first[0] % rows, first[1] % cols
    scales = scale_inv.float().repeat_interleave(rows, 0).repeat_interleave(cols, 1)
    return w.float() * scales[top:top + w.shape[0], left:left + w.shape[1]]


def scale_box(start: int, stop: int, size: int) -> slice:
    """The blocks of `size` that elements [start, stop) of a dimension touch."""
    return slice(start // size, -(-stop // size))


def read_part(f, scales, key: str, rows: slice, cols: slice, block: tuple[int, int]) -> torch.Tensor:
    """Rows x columns of quantized tensor `key` of safetensors file `f` (safe_open's), dequantized
    with the scales of the blocks they touch alone, read from `scales` (the file holding key + SCALE)."""
    part = f.get_slice(key)[rows, cols]
    box = scale_box(rows.start, rows.stop, block[0]), scale_box(cols.start, cols.stop, block[1])
    return dequantize(part, scales.get_slice(key + SCALE)[box], block, (rows.start, cols.start))


def dequantized(weights: dict[str, torch.Tensor], block: tuple[int, int] | None,
                dtype: torch.dtype) -> dict[str, torch.Tensor]:
    """A folder's tensors, every quantized one dequantized to `dtype` (its scales dropped), one at a time."""
    if block is None:
        return weights
    for key in [k for k in weights if k + SCALE in weights]:
        weights[key] = dequantize(weights[key], weights.pop(key + SCALE), block).to(dtype)
    return weights


def unscaled(source, key: str) -> str:
    """Why fp8 tensor `key` cannot be read: no inverse scale beside it (its values alone mean nothing)."""
    return f"{source}: {key} is stored in fp8 with no {key + SCALE} beside it; a complete fp8 release has one"
