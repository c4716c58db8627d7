"""The model `tetrad generate` samples: on a device, in a dtype, whole or split over tensor-parallel
ranks; and the two collectives tensor-parallel decoding adds to the model's own.

The model is built on the meta device (no memory) in its dtype, then given memory on the device,
and each parameter is filled with this rank's shard of one logical tensor at a time, read from the
checkpoint or HF folder and converted on the copy: the host holds one tensor at a time, never
an fp32 model. A tp rank reads only its rows or columns of each tensor (init_from.stored_weights: the
slice an HF folder's safetensors file holds, or the chunks of a tetrad checkpoint that overlap it;
DCP reads a stored chunk whole, so a checkpoint saved at tp 1 is read whole and narrowed). Under
tp each rank holds its heads (their share of the KV cache too), its slice of the MLP and
of the vocabulary: its logits are its slice, gathered whole on every rank (`full_logits`); every
rank then draws from the same logits, and takes tp rank 0's token (`agreed_token`), so that all
feed the same one, however their draws might differ (a kernel that rounds otherwise on one GPU).
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from tetrad.config import ModelConfig
from tetrad.dist.topology import Topology
from tetrad.model.llama import Transformer
from tetrad.model.moe import set_expert_biases
from tetrad.model.sharding import local_part, set_spec, spec_of


def inference_model(model_cfg: ModelConfig, weights: Callable[[str], torch.Tensor], topo: Topology,
                    dtype: torch.dtype = torch.float32, biases: dict[str, torch.Tensor] | None = None) -> Transformer:
    """This rank's model (topo's tp shard) in `dtype` on topo.device, its parameters read one by
    one through `weights(name)`: the logical tensor (on the CPU, in any dtype), or a handle to it
    (init_from.stored_weights') with its `shape`, of which `handle[box]` reads that part alone;
    its MoE layers' expert biases `biases` (init_from.stored_expert_biases': fp32), else zero."""
    with torch.device("meta"):
        model = Transformer(model_cfg, topo)
    specs = {name: spec_of(p) for name, p in model.named_parameters()}
    model.to(dtype)
    model.to_empty(device=topo.device)  # makes new Parameter objects: re-attach their specs
    with torch.no_grad():
        for name, p in model.named_parameters():
            set_spec(p, *specs[name])
            p.copy_(local_part(name, p, weights(name)))
    set_expert_biases(model, biases or {})
    return model.eval()


def full_logits(model: Transformer, local: torch.Tensor) -> torch.Tensor:
    """The logits [..., vocab_size] of the whole vocabulary, fp32, from this rank's slice of the
    padded vocabulary (the model's output, [..., local vocabulary]: one token's, or a batch's);
    gathered over tp, so the same on every rank."""
    local, topo = local.float(), model.topo
    if topo.tp_size == 1:
        return local[..., :model.cfg.vocab_size]
    gathered = local.new_empty(topo.tp_size * local.shape[0], *local.shape[1:])  # the ranks' along dim 0
    topo.comm.all_gather(gathered, local.contiguous(), "tp")
    return gathered.view(topo.tp_size, *local.shape).movedim(0, -2).flatten(-2)[..., :model.cfg.vocab_size]


def agreed_token(token: int, topo: Topology) -> int:
    """Tensor-parallel rank 0's `token`, on every rank of its tp group."""
    return agreed_tokens([token], topo)[0]


def agreed_tokens(tokens: list[int], topo: Topology) -> list[int]:
    """Tensor-parallel rank 0's `tokens` (a batch's, one a row), on every rank of its tp group."""
    if topo.tp_size == 1:
        return tokens
    sent = torch.tensor(tokens, device=topo.device)
    topo.comm.broadcast(sent, 0, "tp")
    return sent.tolist()


def agreed_line(line: str | None, topo: Topology) -> str:
    """Tensor-parallel rank 0's `line` (a conversation's next user message, read there alone: the
    other ranks pass None), on every rank of its tp group: its length, then its UTF-8 bytes."""
    if topo.tp_size == 1:
        return line
    data = line.encode() if topo.tp_rank == 0 else b""
    size = torch.tensor([len(data)], device=topo.device)
    topo.comm.broadcast(size, 0, "tp")
    if not int(size):
        return ""
    sent = torch.tensor(list(data), dtype=torch.uint8, device=topo.device) if topo.tp_rank == 0 else \
        torch.empty(int(size), dtype=torch.uint8, device=topo.device)
    topo.comm.broadcast(sent, 0, "tp")
    return bytes(sent.cpu().tolist()).decode()
