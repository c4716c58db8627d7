"""No host syncs inside a training step's forward and backward (tests/host_reads.py): on a GPU
each read of a tensor's value from the host waits for the device, and one per layer or per
micro-batch leaves the device idle while the host catches up. The step reads its results once,
after the backward (the loss and gradient norm, train/trainer.py); nothing before that may."""

import numpy as np
import pytest
import torch

from conftest import doc_shards, run_ranks, tiny_config
from host_reads import HostReads
from tetrad.train.trainer import Trainer

LAYOUTS = {  # name -> (parallel, train, model), every one under document masking
    "dp2-zero3-selective": ({"dp": 2, "zero": 3}, {"recompute": "selective"}, {}),
    "tp2-sp": ({"tp": 2, "sequence_parallel": True}, {}, {}),
    "cp2-ring-selective-op": ({"cp": 2, "cp_algo": "ring"}, {"recompute": "selective-op"}, {}),
    "cp2-alltoall": ({"cp": 2, "cp_algo": "alltoall"}, {}, {}),
    "cp2-ring-window": ({"cp": 2, "cp_algo": "ring"}, {}, {"sliding_window": 5}),  # which blocks: host-decided
    "pp2-1f1b": ({"pp": 2, "schedule": "1f1b"}, {}, {}),
    "pp2-zb": ({"pp": 2, "schedule": "zb"}, {}, {}),
    "pp2-vpp2-interleaved-full": ({"pp": 2, "vpp": 2, "schedule": "interleaved"}, {"recompute": "full"},
                                  {"n_layers": 4}),
    # Positions reset at document starts: each micro-batch's, cut on the host like the ids.
    "cp2-ring-reset": ({"cp": 2, "cp_algo": "ring"}, {"reset_positions": True}, {}),
    "tp2-sp-reset-learned": ({"tp": 2, "sequence_parallel": True}, {"reset_positions": True}, {"pos": "learned"}),
    # Gemma 3: the scaled embedding, a mask and a RoPE per kind of layer
    "cp2-ring-gemma3": ({"cp": 2, "cp_algo": "ring"}, {}, {
        "norm": "gemma_rmsnorm", "mlp": "geglu", "scale_embeddings": True, "sandwich_norm": True, "qk_norm": True,
        "query_pre_attn_scalar": 20.0, "sliding_window": 5, "layer_types": ["sliding_attention", "full_attention"],
        "rope_local_base_freq": 100.0, "rope_scaling": {"rope_type": "linear", "factor": 8.0}}),
    "tp2-sp-gemma3": ({"tp": 2, "sequence_parallel": True}, {}, {
        "norm": "gemma_rmsnorm", "mlp": "geglu", "scale_embeddings": True, "sandwich_norm": True, "qk_norm": True,
        "sliding_window": 5, "layer_types": ["sliding_attention", "full_attention"], "rope_local_base_freq": 100.0}),
    # Multi-token prediction: the depths' counted targets and the injected gradient, on the last stage
    "cp2-ring-mtp": ({"cp": 2, "cp_algo": "ring"}, {}, {"mtp_layers": 2}),
    "pp2-zb-mtp": ({"pp": 2, "schedule": "zb"}, {}, {"mtp_layers": 1}),
    # The head's loss fused in chunks (model/chunked_loss.py): its spans cut on the host, from shapes
    "tp2-sp-chunked-loss": ({"tp": 2, "sequence_parallel": True}, {"loss_chunk_tokens": 24}, {"mtp_layers": 1}),
}


class _CountingTrainer(Trainer):
    """The Trainer, with the reads each step's pipeline run makes (forward and backward of every
    micro-batch) recorded in `reads`. The micro-batches are cut beforehand, as forward_backward
    does: that is host work on host tensors (the data), which the double cannot tell apart."""

    def forward_backward(self, microbatches, loss_tokens: int, grad_scale: float = 1.0) -> torch.Tensor:
        local = self._sequence_shards(microbatches, self.cfg.model.mtp_layers)
        self.pipeline = self.pipelines(len(microbatches))
        with HostReads() as counted:
            loss = self.pipeline.run(local, grad_scale / loss_tokens)
        self.reads = getattr(self, "reads", []) + counted.reads
        return loss


def _reads(parallel: dict, train: dict, model: dict) -> list[str]:
    cfg = tiny_config(parallel=parallel, model=model, data={"source": doc_shards()},
                      train={"document_mask": True, "steps": 2, **train})
    trainer = _CountingTrainer(cfg, torch.device("cpu"))
    trainer.fit()
    return trainer.reads


@pytest.mark.dist
@pytest.mark.parametrize("name", LAYOUTS)
def test_a_step_reads_nothing_from_the_device_before_its_results(name):
    """Before Documents kept the ids on the host, the ring read which of its blocks a document
    mask leaves empty from the device: one sync per layer, forward and backward (4 per micro-batch
    on this model), and every pipeline transfer read its peer's rank from a tensor."""
    for reads in run_ranks(_reads, 2, *LAYOUTS[name]):
        assert reads == [], reads


def test_the_double_counts_every_read_that_waits_for_a_gpu():
    """Each of these waits on a GPU; a double that missed one would pass a path that syncs."""
    t = torch.arange(6.0)
    mask = t > 2
    reads = {"item": lambda: t[0].item(), "if": lambda: 1 if t.any() else 0, "cpu": t.cpu, "to": lambda: t.to("cpu"),
             "asarray": lambda: np.asarray(t), "print": lambda: str(t), "nonzero": t.nonzero,
             "mask": lambda: t[mask], "masked_select": lambda: t.masked_select(mask), "unique": t.unique,
             "equal": lambda: torch.equal(t, t), "allclose": lambda: torch.allclose(t, t)}
    for name, read in reads.items():
        with HostReads() as counted:
            read()
        assert counted.reads, name
    with HostReads() as counted:  # device work alone: slicing, gathering, a change of dtype
        t[1:3], t[torch.tensor([1, 2])], t.to(torch.float64), t.masked_fill(mask, 0)
    assert counted.reads == []
