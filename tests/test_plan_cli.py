"""`tetrad estimate` and `tetrad plan` as a user runs them: the JSON contract, the exit codes,
hardware files and errors, the written config, and the text the user reads."""

from __future__ import annotations

import json
import re
from pathlib import Path

import numpy as np
import pytest

from tetrad.cli import main
from tetrad.config import load_config
from tetrad.data.shards import shard_name, write_index
from tetrad.plan.hardware import HardwareError, load_cluster, load_gpu
from tetrad.plan.reference import CALIBRATION_MAPE

# docs/design.md's contract for `estimate --json` and each element of `plan --json`.
CONTRACT = ("step_time_s", "tokens_per_s", "model_tflops_per_gpu", "mfu", "hfu", "bubble_fraction", "peak_memory_gib")
MEMORY_PARTS = {"weights", "grads", "optimizer", "activations", "other"}


def _assert_contract(out: dict) -> None:
    for key in CONTRACT:
        assert isinstance(out[key], float) and out[key] >= 0, key
    assert set(out["memory_gib"]) == MEMORY_PARTS
    assert out["peak_memory_gib"] == pytest.approx(sum(out["memory_gib"].values()))
    assert {"tp", "pp", "cp", "dp", "vpp", "schedule", "zero"} <= set(out["parallel"])


def test_estimate_json_contract(capsys):
    assert main(["estimate", "--cluster", "dgx-h100", "--model.preset=llama3-8b", "--parallel.tp=8",
                 "--parallel.sequence_parallel=true", "--train.global_batch=8", "--train.micro_batch=1",
                 "--train.dtype=bf16", "--train.recompute=selective", "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    _assert_contract(out)
    for key in ("fits", "time_s", "compute_s", "exposed_comm_s", "bubble_s"):
        assert key in out, key
    assert sum(out["time_s"].values()) == pytest.approx(out["step_time_s"])
    assert 0 < out["mfu"] < out["hfu"] < 1 and out["fits"] and out["parallel"]["tp"] == 8


def test_layout_that_does_not_fit_is_reported_with_its_breakdown(capsys):
    args = ["estimate", "--cluster", "dgx-h100", "--model.preset=llama3-70b", "--train.global_batch=8",
            "--train.micro_batch=1", "--train.dtype=bf16"]
    assert main(args) == 1
    text = capsys.readouterr().out
    assert "DOES NOT FIT" in text
    for part in ("weights", "grads", "optimizer", "activations", "other"):
        assert part in text
    assert main(args + ["--json"]) == 1
    out = json.loads(capsys.readouterr().out)
    assert out["fits"] is False and out["memory_gib"]["optimizer"] > 80 and out["step_time_s"] > 0


def test_unknown_gpu_and_cluster_list_the_known_ones(tmp_path, capsys):
    with pytest.raises(HardwareError, match="known: A100-80GB-SXM, H100-SXM, H100-96GB-500W, H200, B200, MI300X"):
        load_gpu("H900")
    with pytest.raises(HardwareError, match="dgx-h100"):
        load_cluster("no-such-cluster")
    bad = tmp_path / "bad.toml"
    bad.write_text('[cluster]\ngpu = "H900"\n')
    assert main(["estimate", "--cluster", str(bad)]) == 2
    assert "known: A100-80GB-SXM" in capsys.readouterr().err
    assert main(["plan", "--cluster", str(bad)]) == 2
    assert "known: A100-80GB-SXM" in capsys.readouterr().err
    bad.write_text('[cluster]\ngpu = "H100-SXM"\nnode = 4\n')
    with pytest.raises(HardwareError, match="unknown \\[cluster\\] keys \\['node'\\]"):
        load_cluster(str(bad))


def test_cluster_files_and_measured_profiles(tmp_path):
    root = Path(__file__).resolve().parents[1]
    for path in sorted((root / "configs" / "clusters").glob("*.toml")):
        assert load_cluster(str(path)).world >= 1, path
    (tmp_path / "hw.json").write_text(json.dumps({
        "name": "lab-gpu", "base": "H100-SXM", "peak_tflops": {"bf16": 700.0}, "memory_gbps": 3000,
        "links": {"intra_node": {"alpha_s": 4e-6, "beta_gbps": 380},
                  "inter_node": {"alpha_s": 2e-5, "beta_gbps": 40}}}))
    (tmp_path / "c.toml").write_text('[cluster]\ngpu = "hw.json"\ngpus_per_node = 4\nnodes = 2\ninter_node_gbps = 20\n')
    c = load_cluster(str(tmp_path / "c.toml"))
    g = c.gpu
    assert (c.world, g.name, g.peak_tflops["bf16"], g.gemm_efficiency) == (8, "lab-gpu", 700.0, 1.0)
    assert (g.intra_gbps, g.intra_alpha_s, g.inter_gbps, g.hbm_gib) == (380, 4e-6, 20, load_gpu("H100-SXM").hbm_gib)


def test_plan_writes_a_runnable_config(tmp_path, capsys):
    out = tmp_path / "best.toml"
    assert main(["plan", "--model", "llama3-8b", "--cluster", "dgx-h100", "--global-batch", "16", "--dtype", "bf16",
                 "--top", "3", "--json", "--out", str(out)]) == 0
    ranked = json.loads(capsys.readouterr().out)
    assert isinstance(ranked, list)
    for r in ranked:
        _assert_contract(r)
    times = [r["step_time_s"] for r in ranked]
    assert len(ranked) == 3 and times == sorted(times) and all(r["fits"] for r in ranked)
    best = load_config(out)  # validates for the runtime, as `tetrad train` would
    assert best.parallel.world_size == 8 and best.parallel.dp == ranked[0]["parallel"]["dp"]


def test_plan_states_its_spread_and_the_layouts_it_cannot_order(capsys):
    assert main(["plan", "--model", "llama3-8b", "--cluster", "dgx-h100", "--global-batch", "16", "--dtype", "bf16",
                 "--top", "4"]) == 0
    text = capsys.readouterr().out
    assert f"+- {100 * CALIBRATION_MAPE:.1f}%" in text
    rows = [line.split() for line in text.splitlines() if line.startswith("  #") and "[" in line]
    assert [r[0] for r in rows] == ["#1", "#2", "#3", "#4"]
    times = [float(r[1]) for r in rows]
    close = [f"#{i + 1}" for i, t in enumerate(times[1:], 1) if t * (1 - CALIBRATION_MAPE) <= times[0] * (1 + CALIBRATION_MAPE)]
    verdict = f"{', '.join(close)} within that spread of #1" if close else "#1 is ahead of the others"
    assert verdict in text


def test_plan_with_nothing_fitting_says_why_and_fails(capsys, tmp_path):
    args = ["plan", "--model", "llama3-405b", "--cluster", "dgx-h100", "--global-batch", "8", "--top", "2"]
    assert main(args + ["--write", str(tmp_path / "x.toml")]) == 1
    text = capsys.readouterr().out
    assert "NO LAYOUT FITS" in text and "why the best wins" not in text
    assert "no layout fits in memory: the closest layout needs" in text
    assert "the model states alone do not fit even sharded over the 8 GPUs" in text
    assert not (tmp_path / "x.toml").exists()
    assert main(args + ["--json"]) == 1
    out = capsys.readouterr()
    assert all(not r["fits"] for r in json.loads(out.out)) and "no layout fits in memory" in out.err


def test_plan_names_what_does_not_fit_and_shows_a_tiny_models_memory(capsys):
    """The no-fit line blames what is largest on top of the states (here the buffers, `other`, not
    the activations it used to blame; without optimizer offload, which would fit); a tiny model's
    GiB/GPU is not printed as 0.0."""
    assert main(["plan", "--model", "llama3-405b", "--cluster", "h100x1024", "--gpus", "96", "--global-batch", "96",
                 "--top", "1", "--train.offload_optimizer=false"]) == 1
    text = capsys.readouterr().out
    parts = re.search(r"activations (\d+\.\d), other (\d+\.\d)\); the buffers on top of them \(`other`", text)
    assert parts and float(parts[2]) > float(parts[1]), text[-600:]
    assert main(["plan", "--model", "tiny", "--cluster", "dgx-h100", "--global-batch", "16", "--top", "1"]) == 0
    row = next(line for line in capsys.readouterr().out.splitlines() if line.startswith("tp="))
    assert re.search(r"  0\.00\d+  ", row), row


def test_plan_defaults_to_bf16_unless_the_config_says(tmp_path, capsys):
    args = ["plan", "--model", "llama3-8b", "--cluster", "dgx-h100", "--global-batch", "16", "--top", "1", "--json"]
    assert main(args) == 0
    assert json.loads(capsys.readouterr().out)[0]["train"]["dtype"] == "bf16"
    cfg = tmp_path / "fp32.toml"
    cfg.write_text('[model]\npreset = "llama3-8b"\nn_layers = 4\n[train]\ndtype = "fp32"\n')
    assert main(["plan", str(cfg), "--cluster", "dgx-h100", "--global-batch", "16", "--top", "1", "--json"]) == 0
    assert json.loads(capsys.readouterr().out)[0]["train"]["dtype"] == "fp32"


def test_plan_write_sizes_the_training_to_the_model(tmp_path, capsys):
    from tetrad.model.flops import parameter_count
    from tetrad.plan.recipe import GPT3_LEARNING_RATES, learning_rate

    assert [learning_rate(n) for n, _ in GPT3_LEARNING_RATES] == pytest.approx([lr for _, lr in GPT3_LEARNING_RATES])
    out = tmp_path / "best.toml"
    args = ["plan", "--model", "llama3-8b", "--cluster", "dgx-h100", "--global-batch", "16", "--top", "1",
            "--write", str(out)]
    assert main(args) == 0
    written, printed = out.read_text(), capsys.readouterr().out
    cfg = load_config(out)
    params = parameter_count(cfg.model)
    assert cfg.train.lr == pytest.approx(1.1e-4)  # between GPT-3's 6.7B (1.2e-4) and 13B (1.0e-4)
    assert cfg.train.steps == -(-20 * params // (16 * 8192))  # 20 tokens per parameter
    assert cfg.data.source == "data/tokens" and cfg.train.dtype == "bf16"
    step_time = float(re.search(r"# Written by tetrad plan: ([\d.e+-]+) s per step", written).group(1))
    assert cfg.checkpoint.every == pytest.approx(1800 / step_time, rel=0.01)  # every ~30 minutes, not never
    for stated in ("train.lr = 0.00011: GPT-3's learning rate", "train.steps = ", "train.warmup = ", "data.source = ",
                   "checkpoint.every = "):
        assert f"#   {stated}" in written and stated in printed
    assert main(args + ["--train.lr=2e-4", "--data.source=licenses"]) == 0  # what the user set stays
    cfg = load_config(out)
    assert cfg.train.lr == 2e-4 and cfg.data.source == "licenses" and "train.lr =" not in out.read_text()


def test_plan_table_columns_line_up(capsys):
    assert main(["plan", "--model", "llama3-70b", "--cluster", "h100x1024", "--global-batch", "1024", "--top", "6"]) == 0
    lines = capsys.readouterr().out.splitlines()
    start = next(i for i, line in enumerate(lines) if line.startswith("layout "))
    rows = lines[start:start + 7]
    assert len({len(r) for r in rows}) == 1  # every row as wide as the header
    # Where each cell ends (a non-space followed by two spaces or the line's end): after the
    # left-aligned layout, the seven right-aligned columns end where their headers do.
    ends = [[m.start() for m in re.finditer(r"(?<=\S)(?:  |$)", r)][1:] for r in rows]
    assert all(len(e) == 7 and e == ends[0] for e in ends), rows
    assert len({len(r.split("  ")[0]) for r in rows}) > 1  # layouts of several widths, so the check bites


def test_plan_refuses_counts_it_cannot_use(capsys):
    """Zero, negative or too many: a clear error (exit 2), not a traceback, an empty table, or a
    plan for GPUs the cluster does not have or a batch the user did not ask for."""
    args = ["plan", "--model", "tiny", "--cluster", "dgx-h100", "--global-batch", "8"]
    for flag, value in (("--top", "0"), ("--gpus", "0"), ("--gpus", "-8")):
        with pytest.raises(SystemExit) as exit_:
            main(args + [flag, value])
        assert exit_.value.code == 2 and "expected a whole number >= 1" in capsys.readouterr().err
    assert main(args + ["--gpus", "16"]) == 2
    assert "--gpus 16 is more than the cluster's 8 GPUs" in capsys.readouterr().err
    for flag, key in (("--global-batch", "train.global_batch"), ("--seq-len", "model.seq_len")):
        assert main(args + [flag, "0"]) == 2
        assert f"{key}=0 is out of range" in capsys.readouterr().err


def test_plan_with_no_legal_layout_says_which_batch_or_gpus_would_have_one(capsys):
    """tiny (2 KV-head groups, 4 layers, 128 tokens) on 16384 GPUs leaves dp >= 32: a global
    batch of 8 splits in no layout. The user reads why and two fixes, and both work."""
    args = ["plan", "--model", "tiny", "--cluster", "h100x16384", "--top", "1", "--json"]
    assert main(args + ["--global-batch", "8"]) == 2
    out = capsys.readouterr()
    assert out.out == ""
    assert "no legal layout: the global batch (8) must be a multiple of" in out.err
    assert "dp >= 32 (tp <= 2, pp <= 4, cp <= 64" in out.err and "use --global-batch 32 or --gpus 4096" in out.err
    assert main(args + ["--global-batch", "32"]) == 0
    assert main(args + ["--global-batch", "8", "--gpus", "4096"]) == 0


def test_plan_that_needs_more_gpus_says_how_many(capsys):
    """The model states alone: 405B parameters x 18 bytes need 88 H100s (11 nodes) fully sharded,
    a lower bound, and x 6 with the optimizer offloaded, 32; on 88 GPUs without offload (which
    would fit) no layout's share is that even, which the user reads too."""
    err = []
    for gpus in ("8", "88"):
        assert main(["plan", "--model", "llama3-405b", "--cluster", "h100x1024", "--gpus", gpus, "--global-batch", "88",
                     "--top", "1", "--json", "--train.offload_optimizer=false"]) == 1
        err.append(capsys.readouterr().err)
    assert "do not fit even sharded over the 8 GPUs: they need at least 88 of these GPUs" in err[0]
    assert "32 with train.offload_optimizer" in err[0]
    assert "do not fit in any layout's share of the 88 GPUs: use more GPUs" in err[1]


def test_plan_text_shows_a_tiny_models_step_time(capsys):
    """A tiny model's step is tens of microseconds: the table and the spread show it to three
    significant digits, not as 0.000."""
    args = ["plan", "--model", "tiny", "--cluster", "dgx-h100", "--global-batch", "8", "--top", "3"]
    assert main(args + ["--json"]) == 0
    times = [r["step_time_s"] for r in json.loads(capsys.readouterr().out)]
    assert main(args) == 0
    rows = [line.split() for line in capsys.readouterr().out.splitlines() if line.startswith("  #") and "[" in line]
    assert times[0] < 1e-3
    assert [float(r[1]) for r in rows] == pytest.approx(times, rel=5e-3)


def test_estimate_shows_a_cpus_model_tflops_not_zero(capsys):
    """On the built-in cpu cluster a rank does a few hundredths of a TFLOP/s: shown to four
    significant digits, not as 0.0 beside a non-zero MFU."""
    args = ["estimate", "--cluster", "cpu"]
    assert main(args + ["--json"]) == 0
    tflops = json.loads(capsys.readouterr().out)["model_tflops_per_gpu"]
    assert main(args) == 0
    shown = re.search(r"model TFLOP/s per GPU (\S+)", capsys.readouterr().out).group(1)
    assert tflops < 0.1 and float(shown) == pytest.approx(tflops, rel=1e-3), shown


def test_estimate_and_plan_cost_the_model_the_data_and_init_from_decide(tmp_path, capsys):
    """`tetrad train` takes the vocabulary from a shard folder's index and the shape from
    checkpoint.init_from's weights; estimate and plan cost that model, not the preset's (before,
    fine-tuning a Llama-3-8B folder was estimated as the 4-layer tiny preset)."""
    llama = tmp_path / "llama"
    llama.mkdir()
    (llama / "config.json").write_text(json.dumps({
        "architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 4096, "intermediate_size": 14336,
        "num_hidden_layers": 32, "num_attention_heads": 32, "num_key_value_heads": 8, "vocab_size": 128256,
        "rope_theta": 500000.0, "rms_norm_eps": 1e-5, "max_position_embeddings": 8192, "tie_word_embeddings": False}))
    shape = ["--cluster", "dgx-h100", "--model.seq_len=8192", "--parallel.tp=8", "--train.global_batch=8",
             "--train.micro_batch=1", "--train.dtype=bf16", "--json"]

    def memory(*args):
        assert main([*args, *shape]) in (0, 1)
        out = json.loads(capsys.readouterr().out)
        return (out[0] if isinstance(out, list) else out)["memory_gib"]["weights"]

    preset = memory("estimate", "--model.preset=llama3-8b")
    assert memory("estimate", f"--checkpoint.init_from={llama}") == pytest.approx(preset)
    assert memory("plan", f"--checkpoint.init_from={llama}", "--top", "1") > preset / 10  # all 8 GPUs hold it
    for command in ("estimate", "plan"):  # a typo in the path was the tiny preset's estimate
        assert main([command, f"--checkpoint.init_from={tmp_path / 'lama'}", "--cluster", "dgx-h100"]) == 2
        err = capsys.readouterr().err
        assert err.count("\n") == 1 and f"checkpoint.init_from='{tmp_path / 'lama'}' does not exist" in err, err
    data = tmp_path / "data"
    data.mkdir()
    np.zeros(64, dtype=np.uint16).tofile(data / shard_name(0))
    write_index(data, [{"file": shard_name(0), "tokens": 64, "documents": 1}], 100_000, 0)
    vocab = memory("estimate", "--model.preset=llama3-8b", "--model.vocab_size=100000")
    assert vocab < preset and memory("estimate", "--model.preset=llama3-8b", f"--data.source={data}") == pytest.approx(vocab)


def test_plan_write_runs_in_a_folder_of_the_layouts_own(tmp_path, capsys):
    """The written config does not write into the run folder of the config it was planned from
    (before: run.dir and checkpoint.dir were kept, and `tetrad train best.toml` wrote its metrics
    and checkpoints into that run's folder, and resumed its checkpoints): it gets
    RUN_DIR-dpD-tpT-ppP-cpC (a checkpoint.dir inside RUN_DIR with it), a plan of the written config keeps
    that name, and a flag decides."""
    run = tmp_path / "runs" / "mine"
    config = tmp_path / "mine.toml"
    config.write_text(f'[model]\npreset = "llama3-8b"\n[run]\ndir = "{run}"\n[checkpoint]\ndir = "{run}/ckpt"\n')
    out = tmp_path / "best.toml"
    assert main(["plan", str(config), "--cluster", "dgx-h100", "--global-batch", "16", "--top", "1",
                 "--write", str(out)]) == 0
    cfg, printed = load_config(out), capsys.readouterr().out
    p = cfg.parallel
    tag = f"-dp{p.dp}-tp{p.tp}-pp{p.pp}-cp{p.cp}"
    assert (cfg.run.dir, cfg.checkpoint.dir) == (f"{run}{tag}", f"{run}{tag}/ckpt")  # not in the old run's folder
    assert f"run.dir = '{run}{tag}': the layout's own folder, apart from '{run}''s run" in printed
    again = tmp_path / "again.toml"
    assert main(["plan", str(out), "--cluster", "dgx-h100", "--global-batch", "16", "--top", "1",
                 "--write", str(again)]) == 0
    assert load_config(again).run.dir == f"{run}{tag}"  # not ...-dp8-tp1-pp1-cp1-dp8-tp1-pp1-cp1
    assert load_config(again).checkpoint.dir == f"{run}{tag}/ckpt"
    elsewhere = tmp_path / "ckpts" / "mine"
    assert main(["plan", str(config), "--cluster", "dgx-h100", "--global-batch", "16", "--top", "1",
                 "--write", str(again), f"--checkpoint.dir={elsewhere}/"]) == 0
    assert load_config(again).checkpoint.dir == f"{elsewhere}/"  # a flag is the user's word
    config.write_text(f'[model]\npreset = "llama3-8b"\n[run]\ndir = "{run}/"\n[checkpoint]\ndir = "{elsewhere}/"\n')
    assert main(["plan", str(config), "--cluster", "dgx-h100", "--global-batch", "16", "--top", "1",
                 "--write", str(again)]) == 0
    assert (load_config(again).run.dir, load_config(again).checkpoint.dir) == (f"{run}{tag}", f"{elsewhere}{tag}")
    assert main(["plan", str(config), "--cluster", "dgx-h100", "--global-batch", "16", "--top", "1",
                 "--write", str(out), f"--run.dir={tmp_path / 'chosen'}"]) == 0
    assert load_config(out).run.dir == str(tmp_path / "chosen")


def test_estimate_and_plan_load_no_torch_unless_a_mask_asks_the_runtimes_kernel():
    """torch takes ~1.7 s to load, most of a `tetrad estimate`: the planner's commands load it only
    to ask the runtime's attention kernel for a masked model (plan/kernels.py)."""
    import subprocess
    import sys
    commands = {False: [["estimate", "--cluster", "dgx-h100", "--model.preset=llama3-8b", "--json"],
                        ["plan", "--model", "llama3-8b", "--cluster", "dgx-h100", "--global-batch", "64", "--top", "2"]],
                True: [["estimate", "--cluster", "dgx-h100", "--model.preset=llama3-8b", "--model.sliding_window=1024",
                        "--train.dtype=bf16"]]}
    for loads, runs in commands.items():
        for args in runs:
            code = ("import contextlib, io, sys\nfrom tetrad.cli import main\n"
                    f"with contextlib.redirect_stdout(io.StringIO()):\n    rc = main({args!r})\n"
                    "print(rc, 'torch' in sys.modules)")
            rc, loaded = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                                        check=True).stdout.split()
            assert rc in ("0", "1") and loaded == str(loads), (args, rc, loaded)
