"""The model `tetrad generate` samples: on a device, in a dtype, whole or split over tensor-parallel
ranks; and the two collectives tensor-parallel decoding adds to the model's own.

The model is built on the meta device (no memory) in its dtype, then given memory on the device,
and each parameter is filled with this rank's shard of one logical tensor at a time, read from the
checkpoint or HF folder and converted on the copy (sharding.init_parameters, as training's
init_from fills its ranks): the host holds one logical tensor at a time, never an fp32 model.
Under tp each rank holds its heads (their share of the KV cache too), its slice of the MLP and
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
from tetrad.model.sharding import init_parameters, set_spec, spec_of


def inference_model(model_cfg: ModelConfig, weights: Callable[[str], torch.Tensor], topo: Topology,
                    dtype: torch.dtype = torch.float32) -> Transformer:
    """This rank's model (topo's tp shard) in `dtype` on topo.device, its parameters read one by
    one through `weights(name)` (the logical tensor, on the CPU, in any dtype)."""
    with torch.device("meta"):
        model = Transformer(model_cfg, topo)
    specs = {name: spec_of(p) for name, p in model.named_parameters()}
    model.to(dtype)
    model.to_empty(device=topo.device)  # makes new Parameter objects: re-attach their specs
    for name, p in model.named_parameters():
        set_spec(p, *specs[name])
    init_parameters(model, seed=0, weights=weights)
    return model.eval()


def full_logits(model: Transformer, local: torch.Tensor) -> torch.Tensor:
    """The logits [vocab_size] of the whole vocabulary, fp32, from this rank's slice of the padded
    vocabulary (the model's output); gathered over tp, so the same on every rank."""
    local, topo = local.float(), model.topo
    if topo.tp_size == 1:
        return local[:model.cfg.vocab_size]
    gathered = local.new_empty(topo.tp_size * local.shape[0])
    topo.comm.all_gather(gathered, local.contiguous(), "tp")
    return gathered[:model.cfg.vocab_size]


def agreed_token(token: int, topo: Topology) -> int:
    """Tensor-parallel rank 0's `token`, on every rank of its tp group."""
    if topo.tp_size == 1:
        return token
    sent = torch.tensor([token], device=topo.device)
    topo.comm.broadcast(sent, 0, "tp")
    return int(sent)
