"""Checkpoints: exact resume after a kill, resharding across layouts, atomic saves, integrity."""

import hashlib
import json
import math
import os
import pickle
import random
import signal
from pathlib import Path

import pytest
import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import FileSystemWriter

from conftest import grad_norms, run_ranks, tiny_config, train_layout
from tetrad.dist import autotune
from tetrad.launch import RankFailure
from tetrad.train.checkpoint import CheckpointError, Checkpointer, SafeReader, resolve
from tetrad.train.trainer import Trainer

pytestmark = pytest.mark.dist

STEPS = 6


def metrics_losses(run_dir) -> list[float]:
    return [json.loads(line)["loss"] for line in (Path(run_dir) / "metrics.jsonl").read_text().splitlines()]


def _train_until_killed(cfg, rank: int, step: int):
    """Train, but SIGKILL `rank` when it reaches `step` (patched in this forked rank only)."""
    original = Trainer.train_step

    def train_step(self, s):
        if s == step and self.topo.rank == rank:
            os.kill(os.getpid(), signal.SIGKILL)
        return original(self, s)

    Trainer.train_step = train_step
    Trainer(cfg, torch.device("cpu")).fit()


def _train_crashing_in_save(cfg, rank: int, step: int):
    """Train, but SIGKILL `rank` in the middle of writing checkpoint `step`."""
    original = FileSystemWriter.write_data

    def write_data(self, plan, planner):
        if f"step_{step:08d}" in str(self.path) and torch.distributed.get_rank() == rank:
            os.kill(os.getpid(), signal.SIGKILL)
        return original(self, plan, planner)

    FileSystemWriter.write_data = write_data
    Trainer(cfg, torch.device("cpu")).fit()


# More than one parallel dimension, and ZeRO-1 so that the optimizer state to restore is sharded.
KILL_LAYOUTS = [{"dp": 2, "tp": 2, "zero": 1}, {"dp": 2, "pp": 2, "tp": 2}]


def uninterrupted(layout) -> list[float]:
    """Per-step losses of a run that is never killed (it saves every step: saving must not change them)."""
    cfg = tiny_config(parallel=layout, train={"steps": STEPS, "micro_batch": 1}, checkpoint={"every": 1})
    return train_layout(cfg)[0]


@pytest.fixture(scope="module")
def reference():
    return uninterrupted(KILL_LAYOUTS[0])


@pytest.mark.parametrize("layout", KILL_LAYOUTS)
def test_killed_rank_resumes_bitwise(layout, reference):
    world = math.prod(layout.get(d, 1) for d in ("dp", "tp", "pp", "cp"))
    step = random.randint(1, STEPS - 1)  # a new step and rank every run; the messages below name them
    rank = random.randrange(world)
    cfg = tiny_config(parallel=layout, train={"steps": STEPS, "micro_batch": 1}, checkpoint={"every": 2})
    with pytest.raises(RankFailure, match=f"rank {rank} died by SIGKILL"):
        run_ranks(_train_until_killed, world, cfg, rank, step)
    resumed, _, history = train_layout(cfg)  # checkpoint.resume = "auto"
    expected = reference if layout == KILL_LAYOUTS[0] else uninterrupted(layout)
    last_saved = step // 2 * 2
    assert history[0]["step"] == last_saved + 1, f"killed at step {step}: resumed from the wrong checkpoint"
    # Same arithmetic in the same order from bitwise-restored state: exact equality, not closeness.
    assert metrics_losses(cfg.run.dir) == expected, f"rank {rank} killed at step {step}"
    assert resumed == expected[last_saved:], f"rank {rank} killed at step {step}"


# State that lives on one rank only: gradient codecs' error feedback (and PowerSGD's warm-started
# Q). It comes back when the layout is the same, even if the resume changes [parallel] keys no
# such state depends on (the timeouts, say after a collective timed out, and the communicators'
# settings). The tp-shared dropout generators (tp > 1 without SP) need none: seeded from the step.
# Under expert parallelism the experts' buckets have a codec of their own, over their group.
MOE = {"n_experts": 4, "experts_per_token": 2, "router_aux_loss": 1.0}
PER_RANK_RUNS = {"int8": ({"dp": 2, "grad_codec": "int8"}, {}), "powersgd": ({"dp": 2, "grad_codec": "powersgd"}, {}),
                 "tp-dropout": ({"tp": 2}, {"dropout": 0.1}),
                 "ep-int8": ({"dp": 4, "ep": 2, "grad_codec": "int8"}, MOE),
                 "ep-powersgd": ({"dp": 4, "ep": 2, "grad_codec": "powersgd"}, MOE)}
NEW_TIMEOUTS = {"collective_timeout_s": 90.0, "startup_timeout_s": 300.0, "comm_options": {"dp": {"max_ctas": 8}}}


@pytest.mark.parametrize("name, resumed_with", [(name, {}) for name in PER_RANK_RUNS] + [("int8", NEW_TIMEOUTS)],
                         ids=[*PER_RANK_RUNS, "int8-new-timeouts"])
def test_per_rank_state_resumes_bitwise(name, resumed_with):
    layout, model = PER_RANK_RUNS[name]
    train = {"steps": STEPS, "micro_batch": 1}
    expected = train_layout(tiny_config(parallel=layout, model=model, train=train, checkpoint={"every": 1}))[0]
    cfg = tiny_config(parallel=layout, model=model, train=train, checkpoint={"every": 2})
    with pytest.raises(RankFailure):
        run_ranks(_train_until_killed, cfg.parallel.world_size, cfg, 1, 3)
    resumed = train_layout(tiny_config(parallel={**layout, **resumed_with}, model=model, train=train,
                                       checkpoint={"every": 2}, run={"dir": cfg.run.dir}))[0]
    assert resumed == expected[2:]


def _dropout_masks(cfg) -> list[bytes]:
    """Train (resuming if a checkpoint is there); the tp-shared dropout masks this rank drew, in order."""
    from tetrad.model.layers import ResidualDropout
    masks, draw = [], ResidualDropout._shared_mask_dropout

    def recording(module, x):
        state = module.generator.get_state()
        masks.append((torch.rand(x.shape, generator=module.generator) >= module.p).numpy().tobytes())
        module.generator.set_state(state)  # the draw itself is the module's
        return draw(module, x)
    ResidualDropout._shared_mask_dropout = recording  # this forked rank's class only
    Trainer(cfg, torch.device("cpu")).fit()
    return masks


def test_tp_dropout_after_a_resume_in_another_layout_draws_fresh_masks(tmp_path):
    """The tp-shared dropout generators' state is per rank, so a resume under another layout
    cannot restore it: the masks after it must still be new ones. They restarted from the
    generators' construction seeds: rank 0 drew at step 3 exactly the masks of step 1."""
    common = {"model": {"dropout": 0.1}, "train": {"micro_batch": 1}, "run": {"dir": str(tmp_path)}}
    before = run_ranks(_dropout_masks, 2, tiny_config(parallel={"tp": 2}, checkpoint={"every": 2},
                                                       **{**common, "train": {"micro_batch": 1, "steps": 2}}))
    after = run_ranks(_dropout_masks, 4, tiny_config(parallel={"tp": 2, "dp": 2},
                                                      **{**common, "train": {"micro_batch": 1, "steps": 4}}))
    assert before[0] == before[1] and after[0] == after[1] and after[2] == after[3]  # shared over tp
    assert len(before[0]) == 2 * 8 * 4 and len(after[0]) == 2 * 4 * 4  # steps x micro-batches x dropouts
    drawn = set(before[0])
    repeated = sum(mask in drawn for mask in after[0] + after[2])
    assert len(drawn) == len(before[0]) and repeated == 0


def _restored_codec_buckets(cfg):
    """Train (resuming if a checkpoint is there); the buckets whose codec state the resume restored."""
    trainer = Trainer(cfg, torch.device("cpu"))
    restored = []
    load = trainer.grads.load_state_dict

    def spy(state):
        load(state)
        restored.extend(sorted(getattr(trainer.grads.codec, "residual", {})))
    trainer.grads.load_state_dict = spy
    trainer.fit()
    return restored


@pytest.mark.parametrize("saved, resumed", [
    ({"dp": 2, "pp": 2, "grad_codec": "int8", "grad_bucket_mb": 0.1},  # buckets hold other layers after
     {"dp": 2, "pp": 2, "vpp": 2, "schedule": "interleaved", "grad_codec": "int8", "grad_bucket_mb": 0.1}),
    # No tp-shared dropout generator any more and no codec: what this case checks is that the
    # resume runs at all (it raised KeyError when generators were restored by position).
    ({"tp": 2}, {"tp": 2, "sequence_parallel": True}),
], ids=["int8-vpp", "dropout-sp"])
def test_per_rank_state_of_another_layout_is_left_out(saved, resumed, tmp_path):
    common = {"model": {"n_layers": 4, "dropout": 0.1}, "checkpoint": {"every": 1}, "run": {"dir": str(tmp_path)}}
    train_layout(tiny_config(parallel=saved, train={"steps": 2, "micro_batch": 1}, **common))
    cfg = tiny_config(parallel=resumed, train={"steps": 3, "micro_batch": 1}, **common)
    assert run_ranks(_restored_codec_buckets, cfg.parallel.world_size, cfg) == [[]] * cfg.parallel.world_size


def _train_measuring(cfg, bucket_mb: float, hierarchical_faster: bool = False, kill: tuple[int, int] | None = None):
    """Train (resuming if a checkpoint is there) with autotune's measurements replaced, in this
    forked rank only: buckets of `bucket_mb` are best, hierarchical reduction is faster or not;
    `kill`: (rank, step) as _train_until_killed. Returns the losses, what was measured (nothing
    when the resume reused the checkpoint's choices), the bucket sizes and whether hierarchical."""
    measured = []

    def measure_buckets(group, grad_bytes):
        measured.append(bucket_mb)
        return bucket_mb, {bucket_mb: 1.0}

    def measure_hierarchical(flat_group, intra_group, inter_group, nbytes):
        measured.append(hierarchical_faster)
        return (2.0, 1.0) if hierarchical_faster else (1.0, 2.0)
    autotune.choose_bucket_mb, autotune.choose_hierarchical = measure_buckets, measure_hierarchical
    if kill:
        _train_until_killed(cfg, *kill)
    trainer = Trainer(cfg, torch.device("cpu"))
    losses = [r["loss"] for r in trainer.fit()]
    return losses, measured, [b.padded for b in trainer.grads.buckets], trainer.grads.sync.hierarchical


# "auto" buckets and hierarchical reduction: what the measurement chose is part of the run. Each
# resume below would measure 0.05 MiB buckets where the saved run measured 0.1 (other buckets: a
# lossy codec's per-bucket state would be dropped, and the sums grouped otherwise) and, where it is
# possible (no codec, two nodes), find hierarchical reduction faster where the saved run found flat.
AUTO = {"grad_bucket_mb": "auto", "hierarchical": "auto"}
AUTO_RUNS = {"int8": {"dp": 2, "grad_codec": "int8", **AUTO}, "powersgd": {"dp": 2, "grad_codec": "powersgd", **AUTO},
             "hierarchical": {"dp": 4, "ranks_per_node": 2, **AUTO}}


@pytest.mark.parametrize("name", AUTO_RUNS)
def test_same_layout_resume_reuses_what_auto_measured(name, capfd):
    layout, train = AUTO_RUNS[name], {"steps": STEPS, "micro_batch": 1}
    world = layout["dp"]
    expected, _, buckets, hierarchical = run_ranks(
        _train_measuring, world, tiny_config(parallel=layout, train=train, checkpoint={"every": 1}), 0.1)[0]
    cfg = tiny_config(parallel=layout, train=train, checkpoint={"every": 2})
    with pytest.raises(RankFailure):
        run_ranks(_train_measuring, world, cfg, 0.1, False, (1, 3))
    capfd.readouterr()
    resumed = run_ranks(_train_measuring, world, cfg, 0.05, True)
    assert [measured for _, measured, _, _ in resumed] == [[]] * world  # not measured again, on any rank
    log = capfd.readouterr().err
    assert "grad_bucket_mb=auto -> 0.1 MiB, as chosen by the run that saved step_00000002" in log
    assert "hierarchical=auto -> flat, as chosen by the run that saved step_00000002" in log
    assert resumed[0][2:] == (buckets, hierarchical)
    assert resumed[0][0] == expected[2:]


def test_resume_in_another_layout_measures_again(tmp_path):
    """ZeRO-1 here: the saved run's buckets need not suit another layout, which measures its own."""
    common = {"train": {"steps": 3, "micro_batch": 1}, "checkpoint": {"every": 1}, "run": {"dir": str(tmp_path)}}
    run_ranks(_train_measuring, 2, tiny_config(parallel=AUTO_RUNS["int8"], **common), 0.1)
    layout = {**AUTO_RUNS["int8"], "zero": 1}
    resumed = run_ranks(_train_measuring, 2, tiny_config(parallel=layout, **{**common, "train": {"steps": 4}}), 0.05)
    fresh = run_ranks(_train_measuring, 2, tiny_config(parallel=layout, train={"steps": 1}), 0.05)
    assert [measured for _, measured, _, _ in resumed] == [[0.05], [0.05]]
    assert resumed[0][2] == fresh[0][2]


def test_crash_during_save_keeps_previous_checkpoint(reference):
    cfg = tiny_config(parallel=KILL_LAYOUTS[0], train={"steps": STEPS, "micro_batch": 1},
                      checkpoint={"every": 1, "keep": 2})
    root = Path(cfg.run.dir) / "checkpoints"
    with pytest.raises(RankFailure, match="rank 1 died by SIGKILL"):
        run_ranks(_train_crashing_in_save, 4, cfg, 1, 3)
    assert (root / "latest").read_text().strip() == "step_00000002"
    assert not (root / "step_00000003").exists() and (root / "step_00000003.partial").exists()
    with pytest.raises(CheckpointError, match="interrupted save"):
        resolve(root / "step_00000003.partial")
    train_layout(cfg)  # resumes from step 2
    assert metrics_losses(cfg.run.dir) == reference
    assert sorted(p.name for p in root.iterdir()) == ["latest", "step_00000005", "step_00000006"]  # keep = 2


RESHARD_CASES = [
    ({"dp": 2, "tp": 2}, {}),
    ({"dp": 2, "tp": 2}, {"dp": 4}),
    ({"dp": 2, "tp": 2}, {"cp": 2, "dp": 2}),
    # ZeRO state is stored in the logical space too: any stage loads under any other.
    ({"dp": 2, "zero": 1}, {}),
    ({"dp": 2, "zero": 1}, {"dp": 4, "zero": 3}),
    ({"dp": 4, "zero": 3}, {"dp": 2, "tp": 2, "zero": 1}),
    # Hybrid ZeRO (zero_shard): replicas' shards stored once, read back in any layout.
    ({"dp": 4, "zero": 3, "zero_shard": 2}, {"dp": 2, "zero": 1}),
    ({"dp": 4, "zero": 2}, {"dp": 4, "zero": 1, "zero_shard": 2}),
    ({"dp": 2, "tp": 2, "pp": 2}, {}),
    ({"dp": 2, "tp": 2, "pp": 2}, {"dp": 4, "pp": 2}),
    # Tied embeddings over two stages: both hold "embed.weight" (the last as its head), one tensor stored.
    ({"dp": 2, "pp": 2, "zero": 1, "tie": True}, {}),
    ({"pp": 2, "tie": True}, {"dp": 2, "pp": 2, "zero": 2, "tie": True}),
    # Multi-token prediction: the last stage's embedding copy and its depths, named as one process's.
    ({"pp": 2, "mtp": 1}, {"mtp": 1}),
]


@pytest.mark.parametrize("source,target", RESHARD_CASES)
def test_reshard_and_continue(source, target):
    # vocab 251 is padded to 252 under tp=2: the checkpoint must hold the unpadded logical tensors.
    # One sequence per micro-batch: dp=4 x pp=2 still has the 2 micro-batches a pipeline needs.
    tie, mtp = source.get("tie", False), source.get("mtp", 0)
    source, target = ({k: v for k, v in d.items() if k not in ("tie", "mtp")} for d in (source, target))
    model, train = {"vocab_size": 251, "tie_embeddings": tie, "mtp_layers": mtp}, {"steps": STEPS, "micro_batch": 1}
    src = tiny_config(parallel=source, model=model, train=train, checkpoint={"every": 3})
    ref_losses, ref_state, ref_history = train_layout(src)
    saved = Path(src.run.dir) / "checkpoints"

    # Loading the final checkpoint under the target layout gives the saved parameters bitwise.
    tgt = tiny_config(parallel=target, model=model, train=train, checkpoint={"resume": str(saved / "step_00000006")})
    _, loaded, _ = train_layout(tgt)
    assert loaded.keys() == ref_state.keys()
    assert all(torch.equal(loaded[k], ref_state[k]) for k in ref_state)

    # Continuing from step 3 under the target layout follows the uninterrupted run. fp32; the only
    # difference is the order of the tp / dp sums (~1e-7 relative per step, as in test_dp).
    tgt = tiny_config(parallel=target, model=model, train=train, checkpoint={"resume": str(saved / "step_00000003")})
    losses, state, history = train_layout(tgt)
    torch.testing.assert_close(torch.tensor(losses), torch.tensor(ref_losses[3:]), rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(grad_norms(history), grad_norms(ref_history)[3:], rtol=1e-4, atol=0)
    for name in ref_state:
        torch.testing.assert_close(state[name], ref_state[name], rtol=1e-4, atol=1e-5, msg=name)


def read_logical(path: Path) -> dict[str, torch.Tensor]:
    """Every logical tensor of a checkpoint but the per-rank RNG states, read in this process."""
    metadata = SafeReader(path).read_metadata()
    state = {k: torch.empty(m.size, dtype=m.properties.dtype) for k, m in metadata.state_dict_metadata.items()
             if not k.startswith("rng.")}
    dcp.load(state, storage_reader=SafeReader(path), no_dist=True)
    return state


def _load_and_save(cfg, path: Path, root: Path):
    trainer = Trainer(cfg, torch.device("cpu"))
    ckpt = Checkpointer(cfg, trainer.topo, root)
    params, stateful = dict(trainer.model.named_parameters()), trainer.job_state()  # as Trainer.fit
    ckpt.save(ckpt.load(path, params, trainer.optimizer, stateful), params, trainer.optimizer, stateful)


@pytest.mark.parametrize("source,target", [({"dp": 2, "tp": 2, "zero": 1}, {"dp": 4, "zero": 3}),
                                           ({"dp": 4, "zero": 3}, {}),
                                           ({"dp": 2, "zero": 2}, {"dp": 2, "tp": 2}),
                                           ({"dp": 2, "tp": 2, "pp": 2, "zero": 1}, {"dp": 2, "zero": 3})])
def test_state_survives_resharding_bitwise(source, target, tmp_path):
    """Load under another layout (and ZeRO stage), save again: every stored tensor, the optimizer
    state included, is bitwise the one saved, so nothing was lost or moved in between."""
    model, train = {"vocab_size": 251}, {"steps": 2, "micro_batch": 1}
    src = tiny_config(parallel=source, model=model, train=train, checkpoint={"every": 2})
    train_layout(src)
    saved = Path(src.run.dir) / "checkpoints" / "step_00000002"
    tgt = tiny_config(parallel=target, model=model, train=train)
    run_ranks(_load_and_save, tgt.parallel.world_size, tgt, saved, tmp_path)
    before, after = read_logical(saved), read_logical(tmp_path / "step_00000002")
    assert sorted(before) == sorted(after)
    assert {k.rsplit(".", 1)[1] for k in before if k.startswith("optim.")} == {"step", "exp_avg", "exp_avg_sq"}
    assert [k for k in before if not torch.equal(before[k], after[k])] == []


# ------------------------------------------------------------------------------ integrity (one process)
@pytest.fixture()
def saved_checkpoint():
    """A 2-step single-process run checkpointed at step 2, trained in this process (no ranks)."""
    cfg = tiny_config(train={"steps": 2}, checkpoint={"every": 2})
    Trainer(cfg, torch.device("cpu")).fit()
    return cfg, Path(cfg.run.dir) / "checkpoints" / "step_00000002"


def assert_refused(cfg, path, message):
    """Loading `path` raises CheckpointError matching `message` and leaves the model untouched."""
    trainer = Trainer(cfg, torch.device("cpu"))
    before = {k: v.clone() for k, v in trainer.model.state_dict().items()}
    params = dict(trainer.model.named_parameters())
    with pytest.raises(CheckpointError, match=message):
        Checkpointer(cfg, trainer.topo, path.parent).load(path, params, trainer.optimizer)
    assert all(torch.equal(before[k], v) for k, v in trainer.model.state_dict().items())


def _hashes(path):
    return {p.name: hashlib.sha256(p.read_bytes()).hexdigest() for p in path.iterdir()}


@pytest.mark.parametrize("damage,message", [
    ("truncate", r"__0_0\.distcp: \d+ bytes, \d+ when written \(truncated\?\)"),
    ("flip", r"__0_0\.distcp: SHA-256 differs .* \(corrupt\)"),
    ("manifest", r"tetrad\.json cannot be read"),
])
def test_damaged_checkpoint_is_refused(saved_checkpoint, damage, message):
    cfg, path = saved_checkpoint
    shard = path / "__0_0.distcp"
    data = shard.read_bytes()
    if damage == "truncate":
        shard.write_bytes(data[: len(data) // 2])
    elif damage == "flip":
        shard.write_bytes(data[:100] + bytes([data[100] ^ 1]) + data[101:])
    else:
        (path / "tetrad.json").write_text('{"format": 1, "st')
    hashes = _hashes(path)
    assert_refused(cfg, path, message)
    assert _hashes(path) == hashes  # nothing was rewritten


def test_wrong_model_shape_is_refused(saved_checkpoint):
    cfg, path = saved_checkpoint
    other = tiny_config(model={"d_model": 32, "ffn_hidden": 64})
    assert_refused(other, path, r"tetrad\.json was written for a different model:\n"
                                r"  model\.d_model = 64 in the checkpoint, 32 here\n"
                                r"  model\.ffn_hidden = 128 in the checkpoint, 64 here")


def test_a_checkpoint_from_before_a_model_key_reads_as_a_model_without_it():
    """Manifests written before model.qkv_bias, head_dim and qk_norm existed lack them: such a
    checkpoint is a model without those features (head_dim d_model / n_heads), accepted as one
    and refused, by name, for a model with them."""
    from dataclasses import asdict
    from tetrad.train.checkpoint.store import check_model
    cfg = tiny_config()
    old = {k: v for k, v in asdict(cfg.model).items() if k not in ("qkv_bias", "head_dim", "qk_norm")}
    check_model({"model": old}, cfg.model, Path("ckpt"))
    qwen3 = tiny_config(model={"qk_norm": True, "head_dim": 24}).model
    with pytest.raises(CheckpointError, match=r"model\.head_dim = 16 in the checkpoint, 24 here\n"
                                              r"  model\.qk_norm = False in the checkpoint, True here"):
        check_model({"model": old}, qwen3, Path("ckpt"))


def test_seq_len_is_a_shape_key_for_learned_positions_only():
    """A learned position embedding has a row per position: another seq_len is another shape,
    refused before the ranks load; under RoPE it is not."""
    from dataclasses import asdict
    from tetrad.train.checkpoint.store import check_model
    for pos, refused in (("learned", True), ("rope", False)):
        saved = {"model": asdict(tiny_config(model={"pos": pos}).model)}
        longer = tiny_config(model={"pos": pos, "seq_len": 64}).model
        if refused:
            with pytest.raises(CheckpointError, match=r"model\.seq_len = 32 in the checkpoint, 64 here"):
                check_model(saved, longer, Path("ckpt"))
        else:
            check_model(saved, longer, Path("ckpt"))


def test_a_new_run_never_mixes_its_checkpoints_with_an_earlier_runs(saved_checkpoint):
    """resume='never' in a folder an earlier run saved into would write steps beside (or over) the
    earlier run's: refused before anything is written, naming the way out."""
    cfg, path = saved_checkpoint
    again = tiny_config(run={"dir": cfg.run.dir}, checkpoint={"resume": "never", "every": 1})
    trainer = Trainer(again, torch.device("cpu"))
    hashes = _hashes(path)
    with pytest.raises(CheckpointError, match=rf"already holds {path.name} from an earlier run.*new checkpoint\.dir"):
        trainer.fit()
    assert _hashes(path) == hashes


def test_metadata_pickle_cannot_run_code(saved_checkpoint):
    """Even with a matching manifest (an attacker can rewrite it), .metadata admits no foreign class."""
    cfg, path = saved_checkpoint

    class Evil:
        def __reduce__(self):
            return (os.system, ("echo pwned",))

    (path / ".metadata").write_bytes(pickle.dumps(Evil()))
    manifest = json.loads((path / "tetrad.json").read_text())
    data = (path / ".metadata").read_bytes()
    manifest["files"][".metadata"] = {"bytes": len(data), "sha256": hashlib.sha256(data).hexdigest()}
    (path / "tetrad.json").write_text(json.dumps(manifest))
    assert_refused(cfg, path, r"\.metadata cannot be read: .*system is not allowed")


class Scaler:
    """Stands in for the loss scaler: a state of numbers and tensors."""

    def __init__(self, scale: float):
        self.scale, self.growth_tracker, self.found_inf = scale, 0, torch.zeros(3)

    def state_dict(self):
        return {"scale": self.scale, "growth_tracker": self.growth_tracker, "found_inf": self.found_inf}

    def load_state_dict(self, state):
        self.scale, self.growth_tracker, self.found_inf = state["scale"], state["growth_tracker"], state["found_inf"]


def test_stateful_objects_are_saved_and_restored(tmp_path):
    cfg = tiny_config(train={"steps": 2})
    trainer = Trainer(cfg, torch.device("cpu"))
    params = dict(trainer.model.named_parameters())
    saved = Scaler(2.0**16 / 3)
    saved.growth_tracker, saved.found_inf = 7, torch.tensor([1.0, 0.0, 2.0])
    ckpt = Checkpointer(cfg, trainer.topo, tmp_path)
    path = ckpt.save(2, params, trainer.optimizer, {"scaler": saved})
    restored = Scaler(1.0)
    assert ckpt.load(path, params, trainer.optimizer, {"scaler": restored}) == 2
    assert (restored.scale, restored.growth_tracker) == (saved.scale, 7)  # float64: the scale comes back exact
    assert type(restored.growth_tracker) is int and torch.equal(restored.found_inf, saved.found_inf)


def _round_trip_beside_a_mesh_of_another_device(cfg, root):
    """Save, scramble, load with the topology's mesh on another device type than the state, as an
    accelerator mesh is beside optimizer state offloaded to the host (issue 15 item 4). "meta"
    stands in for the accelerator: a DTensor built on it from host tensors holds copies, so a load
    into them would leave the caller's buffers as they were."""
    from torch.distributed.device_mesh import DeviceMesh

    trainer = Trainer(cfg, torch.device("cpu"))
    trainer.train_step(0)  # the optimizer state exists
    mesh = trainer.topo.mesh
    trainer.topo.mesh = DeviceMesh("meta", mesh.mesh, mesh_dim_names=mesh.mesh_dim_names, _init_backend=False)
    params, optimizer = dict(trainer.model.named_parameters()), trainer.optimizer
    ckpt = Checkpointer(cfg, trainer.topo, root)
    ckpt.save(1, params, optimizer)

    def snapshot():
        state = {f"{i}.{k}": t.clone() for i, s in enumerate(optimizer.state.values()) for k, t in s.items()}
        return {**{name: p.detach().clone() for name, p in params.items()}, **state}
    saved = snapshot()
    with torch.no_grad():
        for p in params.values():
            p.normal_()
        for s in optimizer.state.values():
            for t in s.values():
                t.fill_(7)
    ckpt.load(root / "step_00000001", params, optimizer)
    loaded = snapshot()
    return saved.keys() == loaded.keys() and all(torch.equal(saved[k], loaded[k]) for k in saved)


def test_host_state_beside_an_accelerator_mesh_round_trips_bitwise(tmp_path):
    cfg = tiny_config(parallel={"dp": 2, "zero": 1}, train={"micro_batch": 1})
    assert run_ranks(_round_trip_beside_a_mesh_of_another_device, 2, cfg, tmp_path) == [True, True]


def _fit_reading(cfg):
    """fit(), recording the first sample each step reads; (history, those sample numbers)."""
    trainer = Trainer(cfg, torch.device("cpu"))
    read = []
    microbatches = trainer.batches.microbatches

    def recording(step, *args):
        read.append(trainer.batches.first_sample(step))
        return microbatches(step, *args)
    trainer.batches.microbatches = recording
    return trainer.fit(), read


def test_a_resume_under_another_global_batch_continues_at_the_next_unread_sample(tmp_path):
    # 2 steps of 8 samples read samples 0-15; resumed with global_batch 16, step 3 starts at sample
    # 16 (not 2 x 16 = 32: that would skip 16 samples of the epoch), step 4 at 32; a second resume
    # keeps counting from the saved position.
    run = {"dir": str(tmp_path)}
    [(_, read)] = run_ranks(_fit_reading, 1, tiny_config(train={"steps": 2}, checkpoint={"every": 2}, run=run))
    assert read == [0, 8]
    bigger = tiny_config(train={"steps": 4, "global_batch": 16}, checkpoint={"every": 1}, run=run)
    [(history, read)] = run_ranks(_fit_reading, 1, bigger)
    assert [r["step"] for r in history] == [3, 4] and read == [16, 32]
    smaller = tiny_config(train={"steps": 5, "global_batch": 4}, checkpoint={"every": 1}, run=run)
    [(_, read)] = run_ranks(_fit_reading, 1, smaller)
    assert read == [48]
