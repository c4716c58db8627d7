"""`tetrad eval`: a checkpoint's validation loss, as training's validation computes it, in any
layout; and an HF model's on data it never saw, as transformers computes it."""

from __future__ import annotations

import json

import pytest
import torch
import torch.nn.functional as F

from conftest import run_ranks, tiny_config
from tetrad.cli import main
from tetrad.evaluate import eval_config
from tetrad.train.batches import split_batches
from tetrad.train.trainer import Trainer

pytestmark = pytest.mark.dist

TINY = ["--model.n_layers=2", "--model.d_model=64", "--model.n_heads=4", "--model.n_kv_heads=2",
        "--model.ffn_hidden=128", "--model.seq_len=32", "--train.global_batch=8", "--train.micro_batch=2"]


def _evaluated(capsys, *argv) -> dict:
    capsys.readouterr()
    assert main(["eval", *argv, "--json"]) == 0
    return json.loads(capsys.readouterr().out.strip().splitlines()[-1])


def test_a_runs_checkpoint_evaluates_to_its_last_val_loss_in_any_layout(tmp_path, capsys):
    """The run's own config (its held-out tenth) is the default: the one-process evaluation is the
    val_loss its last step logged, and tp2 x pp2 and ZeRO-3 over dp2 give the same loss."""
    run = tmp_path / "run"
    assert main(["train", *TINY, "--train.steps=3", "--train.eval_every=3", "--data.val_fraction=0.1",
                 "--checkpoint.every=3", f"--run.dir={run}"]) == 0
    logged = json.loads((run / "metrics.jsonl").read_text().splitlines()[-1])["val_loss"]
    files = {f: f.stat().st_mtime_ns for f in run.rglob("*")}
    assert _evaluated(capsys, str(run))["val_loss"] == pytest.approx(logged, rel=1e-6)
    for layout in (["--parallel.tp=2", "--parallel.pp=2"], ["--parallel.dp=2", "--parallel.zero=3"]):
        assert _evaluated(capsys, str(run), *layout)["val_loss"] == pytest.approx(logged, rel=1e-5), layout
    capsys.readouterr()
    assert main(["eval", str(run)]) == 0
    out = capsys.readouterr().out
    assert out.startswith("tetrad eval: val_loss ") and f"of {run} on the last 0.1 of licenses" in out, out
    assert {f: f.stat().st_mtime_ns for f in run.rglob("*")} == files  # nothing written, nothing touched


def test_a_hugging_face_model_evaluates_on_the_whole_source_as_transformers_computes(tmp_path, capsys):
    """With nothing held out, the whole data.source is the evaluation set: the loss is
    transformers' mean token cross-entropy over the same windows."""
    transformers = pytest.importorskip("transformers")
    hf = tmp_path / "hf"
    config = transformers.LlamaConfig(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=1,
                                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=32)
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(config).eval()
    model.save_pretrained(hf, safe_serialization=True)
    flags = ["--model.seq_len=32", "--train.global_batch=4", "--train.micro_batch=2", "--train.eval_steps=2"]
    got = _evaluated(capsys, str(hf), *flags)
    cfg = eval_config(None, flags, hf, str(tmp_path / "unused"))
    _, val = split_batches(cfg)
    total, tokens = 0.0, 0
    with torch.no_grad():
        for i in range(val.eval_batches(cfg.train.eval_steps)):
            inputs, labels = val.global_batch_at(i)
            logits = model(inputs).logits
            total += float(F.cross_entropy(logits.flatten(0, 1), labels.flatten(), reduction="sum"))
            tokens += labels.numel()
    assert got["val_loss"] == pytest.approx(total / tokens, rel=1e-5)
    assert got["perplexity"] == pytest.approx(torch.tensor(total / tokens).exp().item(), rel=1e-5)


def test_weights_that_are_not_there_are_refused_in_one_line(tmp_path, capsys):
    assert main(["eval", str(tmp_path / "nothing")]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "does not exist; name a tetrad checkpoint or run folder, or an HF model folder" in err


def test_an_evaluation_needs_no_room_for_a_checkpoint(tmp_path, capsys, monkeypatch):
    """Nothing is written, so a disk without room for the model's checkpoint (a small /tmp under a
    large model) is no reason to refuse; before, eval refused with 'choose another run.dir', a
    key it sets itself."""
    import shutil
    run = tmp_path / "run"
    assert main(["train", *TINY, "--train.steps=1", "--data.val_fraction=0.1", "--checkpoint.every=1",
                 f"--run.dir={run}"]) == 0
    monkeypatch.setattr(shutil, "disk_usage", lambda path: shutil._ntuple_diskusage(2**40, 2**40, 0))
    assert _evaluated(capsys, str(run))["val_loss"] > 0


def test_a_flag_for_a_key_eval_sets_itself_is_refused_in_one_line(tmp_path, capsys):
    """--checkpoint.init_from beside WEIGHTS, or --run.dir where nothing is written, would be
    dropped without a word (before: the run's checkpoint evaluated, exit 0)."""
    run = tmp_path / "run"
    assert main(["train", *TINY, "--train.steps=1", "--data.val_fraction=0.1", "--checkpoint.every=1",
                 f"--run.dir={run}"]) == 0
    for flag, key in ((f"--checkpoint.init_from={tmp_path / 'other'}", "checkpoint.init_from"),
                      (f"--run.dir={tmp_path / 'out'}", "run.dir")):
        capsys.readouterr()
        assert main(["eval", str(run), flag]) == 2, flag
        err = capsys.readouterr().err
        assert err.count("\n") == 1 and f"tetrad eval sets {key} itself" in err and f"remove --{key}" in err, err


def test_a_refusal_names_the_weights_as_the_user_gave_them(tmp_path, capsys):
    """The checks of the starting weights speak of checkpoint.init_from, which eval sets itself:
    their refusal names WEIGHTS instead (before: "checkpoint.init_from='...' holds a model of
    another shape", a key the user never wrote)."""
    run = tmp_path / "run"
    assert main(["train", *TINY, "--train.steps=1", "--checkpoint.every=1", f"--run.dir={run}"]) == 0
    capsys.readouterr()
    assert main(["eval", str(run), "--model.d_model=32"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "checkpoint.init_from" not in err, err
    assert f"{str(run)!r} (WEIGHTS) holds a model of another shape (d_model=64 there, 32 here)" in err, err


def _built_for(trains: bool, cfg) -> tuple[float, dict[str, int], int]:
    trainer = Trainer(cfg, torch.device("cpu"), trains=trains)
    try:
        loss = trainer.evaluate()["val_loss"]
        held = trainer.grads.model_state_bytes(trainer.optimizer)
        with trainer.grads.gathered():  # a freed ZeRO-3 parameter reads as empty
            return loss, held, sum(p.numel() for p in trainer.params)
    finally:
        trainer.grads.close()
        trainer.topo.close()


@pytest.mark.parametrize("dtype,parallel", [("fp32", {}), ("bf16", {}), ("bf16", {"dp": 2, "zero": 3}),
                                            ("bf16", {"tp": 2, "pp": 2})])
def test_an_evaluation_holds_the_weights_alone(dtype, parallel):
    """eval builds the Trainer forward-only: the weights in the model dtype, laid out as training
    lays them out (ZeRO-3: this rank's shard), and no fp32 masters, gradient buffers or optimizer
    (before: fp32 ZeRO-0 held a gradient buffer as large as the weights, bf16 fp32 masters twice
    their size), with the loss of the training build."""
    cfg = tiny_config(train={"dtype": dtype, "eval_steps": 2}, data={"val_fraction": 0.1}, parallel=parallel)
    trained, frozen = (run_ranks(_built_for, cfg.parallel.world_size, trains, cfg) for trains in (True, False))
    size = 2 if dtype == "bf16" else 4
    for (train_loss, _, _), (loss, held, numel) in zip(trained, frozen):
        assert loss == train_loss
        assert held["grads"] == held["optimizer"] == 0, held
        shards = parallel.get("dp", 1) if parallel.get("zero") == 3 else 1
        assert held["params"] == pytest.approx(size * numel / shards, rel=0.05), (held, numel)


def _fit_loss(trainer: Trainer) -> float:
    """A script's own work for launch.train: it trains."""
    return trainer.fit()[-1]["loss"]


def test_a_scripts_own_work_gets_a_training_build_by_default():
    """launch.train builds a training Trainer unless the caller says forward_only: a script's own
    `work` that trains trains as `fit` does (before: any work but Trainer.fit was built
    forward-only, and fit failed on the missing optimizer in every rank)."""
    from tetrad import launch
    loss = launch.train(tiny_config(train={"steps": 1}, parallel={"dp": 2}), work=_fit_loss)
    assert loss == launch.train(tiny_config(train={"steps": 1}, parallel={"dp": 2}))[-1]["loss"]


def _own_evaluation(trainer: Trainer) -> tuple[bool, float]:
    """A script's own work: whether its Trainer has an optimizer, and the validation loss."""
    return trainer.optimizer is not None, trainer.evaluate()["val_loss"]


def test_the_caller_says_forward_only_whatever_the_work():
    """launch.train's `forward_only` decides the build, not which function `work` is (before, the
    identity `work is Trainer.evaluate` did: a script's own evaluation got a training build, an
    optimizer and fp32 masters it never used): the loss is the same either way."""
    from tetrad import launch
    cfg = tiny_config(train={"steps": 1}, parallel={"dp": 2}, data={"val_fraction": 0.1})
    assert launch.train(cfg, work=_own_evaluation, forward_only=True)[0] is False
    trained, loss = launch.train(cfg, work=_own_evaluation)
    assert trained is True and launch.train(cfg, work=_own_evaluation, forward_only=True)[1] == pytest.approx(loss)


def test_nccls_dumps_of_a_failed_evaluation_outlive_the_command(tmp_path, capsys, monkeypatch):
    """The flight recorder's dumps (NCCL's, which this CPU stands in for by writing one as the ranks
    start, then failing) go to a folder that outlives `tetrad eval`, and the failure names it and
    how to read it (before: the eval's temporary run folder, deleted as the command ended)."""
    from tetrad import launch
    run = tmp_path / "run"
    assert main(["train", *TINY, "--train.steps=1", "--checkpoint.every=1", f"--run.dir={run}"]) == 0
    told = []

    def hang_dumped(device_type, trace_dir):
        told.append(trace_dir)
        trace_dir.mkdir(parents=True, exist_ok=True)
        (trace_dir / "rank_0").write_text("dump")
        raise launch.RankFailure("rank 1 died by SIGABRT (no Python traceback: a crash or a kill).")
    monkeypatch.setattr(launch, "diagnose_nccl", hang_dumped)
    monkeypatch.setattr("tempfile.tempdir", str(tmp_path / "tmp"))
    (tmp_path / "tmp").mkdir()
    capsys.readouterr()
    assert main(["eval", str(run)]) == 1
    err = capsys.readouterr().err
    assert (told[0] / "rank_0").read_text() == "dump"
    assert f"fr_trace {told[0]}`" in err, err


def test_an_evaluation_that_dumped_nothing_leaves_no_folder(tmp_path, capsys, monkeypatch):
    """The dump folder, made as on NCCL (diagnose_nccl for cuda), is removed where no rank wrote to
    it: a successful evaluation leaves nothing behind."""
    from tetrad import launch
    run = tmp_path / "run"
    assert main(["train", *TINY, "--train.steps=1", "--checkpoint.every=1", f"--run.dir={run}"]) == 0
    for key in ("TORCH_NCCL_ASYNC_ERROR_HANDLING", "TORCH_NCCL_TRACE_BUFFER_SIZE", "TORCH_NCCL_DUMP_ON_TIMEOUT",
                "TORCH_NCCL_DEBUG_INFO_TEMP_FILE"):
        monkeypatch.setenv(key, "")  # recorded as unset before the test, so undone however diagnose_nccl sets it
        monkeypatch.delenv(key)  # (a delenv of an unset key records nothing: the setting leaked into later tests)
    told = []
    diagnose = launch.diagnose_nccl
    monkeypatch.setattr(launch, "diagnose_nccl", lambda _, trace_dir: told.append(diagnose("cuda", trace_dir)))
    (tmp_path / "tmp").mkdir()
    monkeypatch.setattr("tempfile.tempdir", str(tmp_path / "tmp"))
    _evaluated(capsys, str(run))
    assert told and not list((tmp_path / "tmp").iterdir())


def test_a_failed_evaluation_names_no_other_evaluations_dumps(tmp_path, capsys, monkeypatch):
    """An earlier evaluation's dumps (here in the folder the pid would have named: pids recur, as
    torchrun's default run id "none" and a reused job id do) are not this failure's: it names no
    folder where it dumped nothing, and leaves the earlier dumps alone."""
    import os
    from tetrad import launch
    run = tmp_path / "run"
    assert main(["train", *TINY, "--train.steps=1", "--checkpoint.every=1", f"--run.dir={run}"]) == 0
    earlier = tmp_path / "tmp" / f"tetrad-eval-nccl-{os.getpid()}"
    earlier.mkdir(parents=True)
    (earlier / "rank_0").write_text("an earlier evaluation's dump")

    def failed(device_type, trace_dir):
        raise launch.RankFailure("rank 1 died by SIGABRT (no Python traceback: a crash or a kill).")
    monkeypatch.setattr(launch, "diagnose_nccl", failed)
    monkeypatch.setattr("tempfile.tempdir", str(tmp_path / "tmp"))
    capsys.readouterr()
    assert main(["eval", str(run)]) == 1
    assert "fr_trace" not in capsys.readouterr().err
    assert [p.name for p in (tmp_path / "tmp").iterdir()] == [earlier.name] and (earlier / "rank_0").exists()


_TRACE_DIR = "import os; from tetrad.evaluate import trace_dir; os.write(1, f\"{trace_dir()}\\n\".encode())"  # one write


def test_torchrun_evaluations_on_one_node_dump_apart_and_a_jobs_ranks_together(tmp_path):
    """Under torchrun the ranks of one job on a node share the dump folder (their agent is their
    parent), and two jobs with one run id (torchrun's default "none", or a job id several
    evaluations reuse) do not (before: tetrad-eval-nccl-RUNID for both)."""
    import os
    import subprocess
    import sys
    env = {**os.environ, "TORCHELASTIC_RUN_ID": "none", "RANK": "0", "WORLD_SIZE": "2", "TMPDIR": str(tmp_path)}
    rank = f"{sys.executable} -c '{_TRACE_DIR}'"
    outs = [subprocess.run(["sh", "-c", f"{rank} & {rank}; wait"], env=env, capture_output=True, text=True)
            for _ in range(2)]
    jobs = [out.stdout.split() for out in outs]
    assert all(len(ranks) == 2 and len(set(ranks)) == 1 for ranks in jobs), (jobs, [out.stderr for out in outs])
    assert jobs[0][0] != jobs[1][0] and all(path.startswith(str(tmp_path)) for path, _ in jobs), jobs
