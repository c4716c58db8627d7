"""What the pipeline's ends cost, per micro-batch on one rank: the embedding on the first stage, and
on the last the final norm, the head and its cross-entropy, unfused or fused a chunk of tokens at
a time (`train.loss_chunk_tokens`, model/chunked_loss.py; the bytes it holds: activations.loss_bytes)."""

from __future__ import annotations

from tetrad.config import Config
from tetrad.plan.activations import activation_bytes
from tetrad.plan.hardware import Cluster
from tetrad.plan.layer import gemm_efficiency
from tetrad.plan.links import group_link, ring_time


def end_costs(cfg: Config, cluster: Cluster) -> tuple[tuple[float, float, float], tuple[float, float, float]]:
    """(forward, backward_input, backward_weight) seconds per micro-batch of the embedding (first
    stage) and of the final norm, head and cross-entropy (last stage). Fused in chunks, the head's
    GEMMs run a chunk's rows at a time, and backward makes each chunk's logits and softmax again."""
    m, p, t = cfg.model, cfg.parallel, cfg.train
    gpu = cluster.gpu
    e = activation_bytes(t.dtype)
    hbm = gpu.hbm_bytes_per_s
    tokens = t.micro_batch * m.seq_len // p.cp
    hidden = tokens * m.d_model * e
    tp_alpha, tp_bw = group_link(cluster, 1, p.tp)
    embed_ar = ring_time("all_reduce", hidden, p.tp, tp_alpha, tp_bw)
    # The lookup; backward materialises a dense (vocab/tp x h) gradient (zeroed, scattered into)
    # and adds it to the fp32 gradient buffer.
    table = m.vocab_size / p.tp * m.d_model
    embed = (hidden / hbm + embed_ar, 0.0, (tokens * m.d_model * (e + 4) + table * (2 * e + 12)) / hbm)
    vocab = m.vocab_size / p.tp
    peak = gpu.matmul_peak(t.dtype, t.tf32)
    rows = min(t.loss_chunk_tokens or tokens, tokens)
    logits = 2 * tokens * m.d_model * vocab / (peak * gemm_efficiency(gpu, rows, m.d_model, vocab))
    ce = tokens * vocab * (3 * e + 8) / hbm  # read logits (max, sum-exp, target), fp32 softmax out, grad
    norm = 4 * hidden / hbm
    ce_ar = 3 * ring_time("all_reduce", tokens * 4, p.tp, tp_alpha, tp_bw)  # max, sum-exp, target logit
    input_grad_ar = ring_time("all_reduce", hidden, p.tp, tp_alpha, tp_bw)
    again = logits + ce / 2 if t.loss_chunk_tokens else 0.0  # the fused loss's backward: each chunk's logits again
    # ... and over several chunks a 16-bit weight's gradient summed in fp32: each later chunk's part
    # written and read, the sum read and written (12 bytes an element), then cast once (6)
    chunks = -(-tokens // rows)
    summed = (12 * (chunks - 1) + 6) * vocab * m.d_model / hbm if e < 4 and chunks > 1 else 0.0
    head = (logits + ce / 2 + norm + ce_ar, logits + ce / 2 + 2 * norm + input_grad_ar + again, logits + summed)
    return embed, head
