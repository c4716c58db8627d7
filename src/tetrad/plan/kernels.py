"""Which kernel runs a tetrad run's masked attention (documents, a sliding window), for the time
(layer.py) and memory (memory.py) models: the runtime's own choice (model/attention.py
choose_kernel, through `uses_varlen`), asked here rather than written again. Asking loads torch
(1.7 s of a `tetrad estimate`), so it is imported where a model has masked attention alone."""

from __future__ import annotations

from tetrad.config import Config
from tetrad.model.flops import hides_keys, layer_windows


def masked_attention(cfg: Config, is_cpu: bool = False) -> str | None:
    """None where causality alone masks; else "ring" (ring cp's per-block kernels), "varlen"
    (flash's varlen kernel over the whole sequence: no bias, the causal band's tiles; CUDA, 16-bit,
    a head dim flash takes) or "square" (an additive bias, the whole square computed: the
    memory-efficient kernel in fp32 or at other head dims, the CPU's kernel on a CPU)."""
    m, p, t = cfg.model, cfg.parallel, cfg.train
    # A layer's window is sliding_window or none: only then are the layers worth reading (the
    # planner asks this of every candidate layout, and a 126-layer model's list is slow to build).
    if not t.document_mask and not (hides_keys(m.sliding_window, m.seq_len)
                                    and any(hides_keys(w, m.seq_len) for w in layer_windows(m))):
        return None
    if p.cp > 1 and p.cp_algo == "ring":
        return "ring"
    import torch
    from tetrad.device import DTYPES
    from tetrad.model.attention import uses_varlen
    dtype = DTYPES.get(t.dtype, torch.bfloat16)  # fp8 (the planner's alone): 16-bit activations
    return "varlen" if uses_varlen("cpu" if is_cpu else "cuda", dtype, m.head_dim) else "square"
