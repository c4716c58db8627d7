"""The planner under train.offload_optimizer and checkpoint.async_save: what moves from the GPU to
host memory (parallel/data/optimizer.py, Checkpointer._saved_state), what the step pays for it,
and that the plan offloads where nothing fits without it."""

from __future__ import annotations

import dataclasses
import json

import pytest
import torch
from torch.distributed.tensor import DTensor

from conftest import run_ranks, tiny_config
from tetrad.config import load_config
from tetrad.plan.cli import estimate_command, plan_command
from tetrad.plan.cost import HOST_ADAM_BYTES, HOST_ADAM_EFFICIENCY, OFFLOAD_DEVICE_BYTES, estimate
from tetrad.plan.hardware import GPUS, Cluster, load_cluster
from tetrad.plan.links import LINK_EFFICIENCY
from tetrad.plan.buckets import rank_buckets
from tetrad.plan.memory import host_memory_by_rank, rank_model_states, rank_params, state_bytes_per_param
from tetrad.train.trainer import Trainer
from tetrad.plan.search import plan

LLAMA_8B_DP8 = ["--model.preset=llama3-8b", "--parallel.dp=8", "--train.global_batch=8", "--train.micro_batch=1",
                "--train.recompute=full"]


def _cfg(*overrides: str):
    return load_config(overrides=list(overrides), runtime=False)


def _with(cfg, section: str, **keys):
    return dataclasses.replace(cfg, **{section: dataclasses.replace(getattr(cfg, section), **keys)})


def _updated(est) -> float:
    """Parameters the rank's optimizer updates, from the device optimizer state it has without offload."""
    return est.memory.optimizer / state_bytes_per_param(est.cfg.train.dtype)[2]


@pytest.mark.parametrize("dtype", ["bf16", "fp32"])
@pytest.mark.parametrize("zero", [0, 1, 3])
def test_offload_moves_the_optimizer_states_to_host_memory(dtype, zero):
    cluster = load_cluster("dgx-h100")
    kept = estimate(_cfg(*LLAMA_8B_DP8, f"--train.dtype={dtype}", f"--parallel.zero={zero}"), cluster)
    moved = estimate(_with(kept.cfg, "train", offload_optimizer=True), cluster)
    assert moved.memory.optimizer == 0 and kept.memory.optimizer > 0
    for part in ("weights", "grads", "activations", "other"):  # the device keeps weights and gradient buckets
        assert getattr(moved.memory, part) == getattr(kept.memory, part), part
    assert moved.peak_memory_gib == pytest.approx(kept.peak_memory_gib - kept.memory.optimizer / 2**30)
    # On the host: fp32 masters and both moments (fp32 training gets separate masters too), and a
    # buffer for the updated range's fp32 gradient.
    updated = _updated(kept)
    assert moved.host_memory.optimizer == pytest.approx(12 * updated)
    assert moved.host_memory.grads == pytest.approx(4 * updated)
    assert moved.host_memory.checkpoint == 0 and kept.host_memory.total == 0


def test_offload_adds_the_host_copies_and_cpu_adamw_to_the_step():
    cluster = load_cluster("dgx-h100")
    kept = estimate(_cfg(*LLAMA_8B_DP8, "--parallel.zero=1"), cluster)
    moved = estimate(_with(kept.cfg, "train", offload_optimizer=True), cluster)
    for part, seconds in kept.breakdown.items():
        if part != "optimizer":
            assert moved.breakdown[part] == seconds, part
    updated, gpu = _updated(kept), cluster.gpu
    # fp32 gradient down, fp32 weights up, over the GPU's PCIe link (64 GB/s a direction on an H100).
    assert moved.breakdown["host_copies"] == pytest.approx(8 * updated / (64e9 * LINK_EFFICIENCY))
    # AdamW over the host's DRAM, which the node's 8 ranks share, and the device's reads of the gradient.
    host_adam = updated * HOST_ADAM_BYTES * 8 / (gpu.host_memory_gbps * 1e9 * HOST_ADAM_EFFICIENCY)
    device = updated * OFFLOAD_DEVICE_BYTES / gpu.hbm_bytes_per_s
    assert moved.breakdown["optimizer"] == pytest.approx(host_adam + device)
    added = moved.breakdown["host_copies"] + moved.breakdown["optimizer"] - kept.breakdown["optimizer"]
    assert moved.step_time_s == pytest.approx(kept.step_time_s + added) and added > 0


def test_plan_offloads_where_only_offload_fits():
    """Llama-3-8B on one H100: 18 bytes a parameter of model states (144 GB) do not fit in 80 GB,
    the 6 left on the GPU with the optimizer offloaded do."""
    base = _cfg("--model.preset=llama3-8b", "--train.global_batch=8", "--train.dtype=bf16")
    one_gpu = Cluster(GPUS["H100-SXM"], 1, 1)
    one = plan(base, one_gpu, top=3)
    assert one.ranked and all(e.fits and e.cfg.train.offload_optimizer for e in one.ranked)
    assert not estimate(_with(one.ranked[0].cfg, "train", offload_optimizer=False), one_gpu).fits
    eight = plan(base, load_cluster("dgx-h100"), top=3)  # fits sharded: offload only costs time there
    assert eight.ranked[0].fits and not any(e.cfg.train.offload_optimizer for e in eight.ranked)


def test_plan_command_writes_offload_unless_the_user_set_it_or_ram_is_short(tmp_path, capsys):
    one = tmp_path / "one.toml"
    one.write_text('[cluster]\ngpu = "H100-SXM"\ngpus_per_node = 1\n')
    args = ["--model", "llama3-8b", "--cluster", str(one), "--global-batch", "8", "--top", "1"]
    assert plan_command([*args, "--out", str(tmp_path / "best.toml")]) == 0
    assert "offload_optimizer = true" in (tmp_path / "best.toml").read_text()
    assert plan_command([*args, "--train.offload_optimizer=false"]) == 1  # as the user set it
    assert "NO LAYOUT FITS" in capsys.readouterr().out
    one.write_text('[cluster]\ngpu = "H100-SXM"\ngpus_per_node = 1\nhost_memory_gib = 64\n')
    assert plan_command(args) == 1  # offloaded, the 8B model's 16 bytes a parameter exceed 64 GiB of RAM
    assert "fits on its GPUs but needs host memory 120 GiB a node > 64 GiB of RAM" in capsys.readouterr().out


def test_async_save_stages_the_checkpointed_state_in_host_memory():
    cluster = load_cluster("dgx-h100")
    base = _cfg(*LLAMA_8B_DP8, "--parallel.zero=1", "--checkpoint.every=100")
    plain = estimate(base, cluster)
    staged = estimate(_with(base, "checkpoint", async_save=True), cluster)
    updated = _updated(plain)
    assert staged.host_memory.checkpoint == pytest.approx(12 * updated)  # fp32 masters and both moments
    assert staged.memory == plain.memory and plain.host_memory.total == 0
    both = estimate(_with(staged.cfg, "train", offload_optimizer=True), cluster)
    assert both.host_memory.total == pytest.approx((12 + 4 + 12) * updated)
    never = estimate(_with(staged.cfg, "checkpoint", every=0), cluster)  # no checkpoint, nothing staged
    assert never.host_memory.total == 0
    int8 = estimate(_with(staged.cfg, "parallel", grad_codec="int8"), cluster)  # its error feedback is saved too
    assert int8.host_memory.checkpoint == pytest.approx(12 * updated + plain.memory.grads)


def test_host_ram_decides_the_node_fit_where_the_cluster_knows_it(tmp_path, capsys):
    small = tmp_path / "small.toml"
    small.write_text('[cluster]\ngpu = "H100-SXM"\ngpus_per_node = 8\nhost_memory_gib = 512\n')
    args = [*LLAMA_8B_DP8, "--train.offload_optimizer=true", "--json"]  # ZeRO-0: every rank offloads all
    found = {}
    for cluster in ("dgx-h100", str(small), "h100x64"):
        code = estimate_command([*args, "--cluster", cluster])
        found[cluster] = code, json.loads(capsys.readouterr().out)
    code, dgx = found["dgx-h100"]
    assert dgx["node_host_memory_gib"] == pytest.approx(8 * dgx["peak_host_memory_gib"]) and dgx["node_ram_gib"] == 2048
    assert dgx["node_host_memory_gib"] > 512 and dgx["host_fits"] is True and code == 0
    code, tight = found[str(small)]
    assert tight["host_fits"] is False and tight["fits"] is False and code == 1
    assert tight["peak_memory_gib"] <= tight["usable_memory_gib"]  # the GPU alone would fit
    code, unknown = found["h100x64"]
    assert unknown["host_fits"] is None and unknown["node_ram_gib"] is None and code == 0
    assert estimate_command([*LLAMA_8B_DP8, "--train.offload_optimizer=true", "--cluster", str(small)]) == 1
    gpu, host = capsys.readouterr().out.split("host memory per rank")
    assert "usable (79.6 GiB) -> fits" in gpu and "DOES NOT FIT" in host and "to fit the host" in host


def test_offload_is_refused_where_it_cannot_be_costed(capsys):
    assert estimate_command(["--train.offload_optimizer=true", "--cluster", "cpu"]) == 2
    assert "CPUs" in capsys.readouterr().err
    assert estimate_command([*LLAMA_8B_DP8, "--train.offload_optimizer=true", "--cluster", "mi300x-8"]) == 2
    assert "host_memory_gbps" in capsys.readouterr().err


def _bytes(tensors) -> int:
    """Bytes of the distinct storages behind `tensors` (a DTensor's: its local shards')."""
    storages = {}
    for t in tensors:
        for local in t._local_tensor.local_shards() if isinstance(t, DTensor) else [t]:
            storages[local.untyped_storage().data_ptr()] = local.untyped_storage().nbytes()
    return sum(storages.values())


def _host_state(cfg) -> tuple[int, int, int]:
    """What rank 0 keeps in host memory after training `cfg` (on CPU, the path an accelerator run
    takes): masters and AdamW's moments, the owned gradient's buffers, and what an async save stages."""
    trainer = Trainer(cfg, torch.device("cpu"))
    trainer.fit()
    weights, optimizer = trainer.grads.weights, trainer.optimizer
    moments = [v for state in optimizer.state.values() for v in state.values() if v.ndim]
    local = {"grads": trainer.grads}
    staged = trainer.checkpointer._saved_state(dict(trainer.model.named_parameters()), optimizer, {}, local, copy=True)
    return (_bytes(weights.masters + moments), _bytes(weights._host_grads.values()),
            _bytes(v for k, v in staged.items() if k.startswith(("model.", "optim.", "local."))))


@pytest.mark.parametrize("dtype, zero", [("bf16", 1), ("fp32", 0), ("bf16", 3)])
def test_host_memory_is_what_the_runtime_keeps_there(dtype, zero):
    """The planner's host bytes against the tensors a 2-rank run holds: offloaded masters and
    moments and gradient buffers to the byte (padded buckets), and the checkpoint staging copy
    (unpadded values and moments, int8's error feedback of whole padded buckets) but for a few
    bytes a bucket."""
    codec = {"grad_codec": "int8"} if zero <= 1 else {}  # int8 pads each bucket to 512 elements here
    cfg = tiny_config(parallel={"dp": 2, "zero": zero, "grad_bucket_mb": 0.002, **codec},
                      train={"dtype": dtype, "offload_optimizer": True},
                      checkpoint={"async_save": True, "every": 100})
    optimizer, grads, staged = run_ranks(_host_state, 2, cfg)[0]
    host = host_memory_by_rank(cfg)[0]
    assert optimizer == host.optimizer
    assert grads == host.grads
    assert staged == pytest.approx(host.checkpoint, rel=1e-3)  # and the codec's signatures, the step counts


HOST_TINY_BUCKETS = [({"dp": 2, "pp": 2, "zero": 1, "grad_codec": "int8"}, "bf16"),
                     ({"dp": 2, "pp": 2, "zero": 0, "grad_codec": "int8"}, "fp32"),
                     ({"dp": 3, "zero": 3}, "bf16")]


@pytest.mark.parametrize("parallel, dtype", HOST_TINY_BUCKETS)
def test_host_memory_counts_the_padded_buckets_as_the_device_states_do(parallel, dtype):
    """With buckets so small that padding matters (int8's is a tenth of them; 3 ranks divide no
    bucket), the offloaded optimizer state is rank_model_states' optimizer bytes (padded masters,
    unpadded moments), the gradient buffers the padded masters' size, and the async save stages
    the unpadded values and moments plus int8's error feedback of the padded buckets. Before,
    host memory split the unpadded parameters evenly over the shards."""
    cfg = tiny_config(parallel={**parallel, "grad_bucket_mb": 0.002},
                      train={"dtype": dtype, "offload_optimizer": True, "micro_batch": 1, "global_batch": 6},
                      checkpoint={"async_save": True, "every": 100})
    hosts, states, params, buckets = host_memory_by_rank(cfg), rank_model_states(cfg), rank_params(cfg), rank_buckets(cfg)
    shards, codec = (parallel["dp"] if parallel["zero"] else 1), "grad_codec" in parallel
    for host, (_, _, optimizer), n, b in zip(hosts, states, params, buckets, strict=True):
        assert host.optimizer == optimizer
        assert host.grads == 4 * b.padded / shards
        owned = b.first_shard if parallel["zero"] else n  # the parameters' elements the rank updates
        assert host.checkpoint == 12 * owned + (4 * b.padded if codec else 0)  # staged unpadded; int8's feedback padded
