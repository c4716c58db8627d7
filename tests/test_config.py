"""Config loading and validation: every invalid config gets a message naming the fix, before any
process starts."""

import re
import subprocess
import sys
import textwrap

import pytest

from tetrad.config import Config, ConfigError, counted, load_config, split_config_args

ERRORS = [
    ({"parallel": {"dp": 2, "tp": 2}}, 8, "dp*tp*pp*cp = 2*2*1*1 = 4 but the job has 8 ranks; set parallel.dp=4"),
    ({"parallel": {"dp": 2}}, 1, "dp*tp*pp*cp = 2*1*1*1 = 2 but the job has 1 rank; set parallel.dp=1"),
    ({"parallel": {"tp": 3}}, None, "tp=3 does not divide n_heads=4; use tp in [1, 2]"),
    ({"model": {"n_heads": 8, "n_kv_heads": 2}, "parallel": {"tp": 4}}, None,
     "tp=4 does not divide n_kv_heads=2; use tp in [1, 2]"),
    ({"parallel": {"pp": 4, "vpp": 2, "schedule": "interleaved"}}, None,
     "n_layers=4 is fewer than pp*vpp = 4*2 = 8 pipeline stages"),
    ({"parallel": {"cp": 3}}, None, "seq_len=128 is not divisible by 2*cp = 6 (the sequence is cut into 2*cp chunks "
     "for load balance); use cp in [1, 2, 4, 8, 16, 32, 64]"),
    ({"model": {"seq_len": 127}, "parallel": {"cp": 3}}, None, "use cp in [1] or change seq_len"),
    ({"model": {"seq_len": 36}, "parallel": {"cp": 4}}, None, "use cp in [1, 2, 3, 6, 9, 18]"),
    ({"train": {"global_batch": 12, "micro_batch": 4}, "parallel": {"dp": 2}}, None,
     "global_batch=12 is not divisible by micro_batch*dp = 4*2 = 8"),
    ({"parallel": {"tpp": 2}}, None, "unknown key parallel.tpp (did you mean 'parallel.tp'?)"),  # the key as written
    ({"model": {"n_layer": 2}}, None, "unknown key model.n_layer (did you mean 'model.n_layers'?)"),
    ({"train": {"dtype": "BF16"}}, None, "got 'BF16' (str) (did you mean 'bf16'?)"),
    ({"trian": {"steps": 2}}, None, "unknown section [trian] (did you mean 'train'?)"),
    ({"model": {"preset": "lama3-8b"}}, None, "unknown model.preset 'lama3-8b' (did you mean 'llama3-8b'?)"),
    ({"train": {"lr": "fast"}}, None, "train.lr must be a number, got 'fast' (str)"),
    ({"parallel": {"tp": 2.5}}, None, "parallel.tp must be an integer, got 2.5 (float)"),
    ({"parallel": {"sequence_parallel": 1}}, None, "parallel.sequence_parallel must be true or false"),
    ({"model": {"seq_len": 36, "n_kv_heads": 4}, "parallel": {"tp": 4, "cp": 2, "sequence_parallel": True}}, None,
     "sequence_parallel splits each rank's 18 tokens (seq_len/cp) over tp=4"),
    ({"parallel": {"stage_layers": [2, "x"], "pp": 2}}, None, "parallel.stage_layers[1] must be an integer"),
    ({"parallel": {"tp": 2, "sp_regather": True}}, None, "sp_regather gathers sequence parallelism's input"),
    ({"parallel": {"dp": 4, "zero": 3, "hierarchical": True, "ranks_per_node": 2}}, None,
     "got zero=3, grad_codec='none'; use zero<=1 and grad_codec='none', or hierarchical=false"),
    ({"model": {"rope_scaling": {"rope_type": "llama3", "factor": 8.0}}}, None,
     "model.rope_scaling needs exactly rope_type, factor, low_freq_factor, high_freq_factor, "
     "original_max_position_embeddings; missing low_freq_factor, high_freq_factor, original_max_position_embeddings"),
    ({"model": {"rope_scaling": {"rope_type": "dynamic", "factor": 8.0}}}, None,
     "model.rope_scaling.rope_type='dynamic': tetrad has Llama 3.1's 'llama3', 'linear' (Gemma 3's), Phi-3's 'longrope' "
     "and 'yarn' (DeepSeek's, Qwen's) scaling only"),
    ({"model": {"rope_scaling": {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 4.0, "high_freq_factor": 1.0,
                                 "original_max_position_embeddings": 8192}}}, None,
     "model.rope_scaling needs factor >= 1, 0 <= low_freq_factor < high_freq_factor"),
    ({"model": {"pos": "learned", "rope_scaling": {"rope_type": "llama3"}}}, None,
     "model.rope_scaling scales RoPE's frequencies, and model.pos='learned' has none; remove it"),
    ({"model": {"pos": "learned", "max_position_embeddings": 256}}, None,
     "model.pos='learned' has a position embedding of seq_len=128 rows, so it reads no longer sequence than that; "
     "set model.max_position_embeddings=0 (seq_len)"),
    ({"model": {"pos": "learned", "partial_rotary_factor": 0.5}}, None,
     "model.partial_rotary_factor sets the dims RoPE rotates, and model.pos='learned' has none; remove it"),
    # head_dim 32 (the tiny preset's): 0.75 rotates 24 dims, 12 pairs; 0.1 rotates 3
    ({"model": {"partial_rotary_factor": 0.1}}, None,
     "model.partial_rotary_factor=0.1 rotates int(head_dim * partial_rotary_factor) = 3 dims of each head of 32; "
     "RoPE needs an even number, at least 2"),
    ({"model": {"partial_rotary_factor": 1.5}}, None, "model.partial_rotary_factor=1.5 is out of range: it must be "
     "a finite number in (0, 1]"),
    ({"model": {"rope_scaling": {"rope_type": "longrope", "short_factor": [1.0] * 16, "long_factor": [2.0] * 16,
                                 "original_max_position_embeddings": 64}}}, None,
     "model.rope_scaling needs exactly rope_type, short_factor, long_factor, original_max_position_embeddings, "
     "attention_factor; missing attention_factor"),
    ({"model": {"partial_rotary_factor": 0.75, "rope_scaling": {
        "rope_type": "longrope", "short_factor": [1.0] * 16, "long_factor": [2.0] * 12,
        "original_max_position_embeddings": 64, "attention_factor": 1.2}}}, None,
     "model.rope_scaling.short_factor must list a number above 0 for each of the rotary_dim / 2 = 12 rotated pairs "
     "of a head (head_dim 32 * partial_rotary_factor 0.75), got 16 of them"),
    ({"model": {"rope_scaling": {"rope_type": "longrope", "short_factor": [1.0] * 16, "long_factor": [2.0] * 16,
                                 "original_max_position_embeddings": 64, "attention_factor": "big"}}}, None,
     "model.rope_scaling.attention_factor must be a number above 0, got 'big'"),
]


@pytest.mark.parametrize("overrides,world,message", ERRORS)
def test_invalid_config_names_the_fix(overrides, world, message):
    with pytest.raises(ConfigError) as err:
        load_config(overrides=overrides, world_size=world)
    assert message in str(err.value)


def test_preset_then_user_keys_then_overrides(tmp_path):
    path = tmp_path / "run.toml"
    path.write_text(textwrap.dedent("""
        [model]
        preset = "llama3-8b"
        n_layers = 2
        [parallel]
        tp = 2
    """))
    cfg = load_config(path, ["--parallel.tp=4", "--train.lr=1e-4", "--parallel.schedule=gpipe"])
    assert (cfg.model.d_model, cfg.model.n_layers, cfg.model.vocab_size) == (4096, 2, 128256)
    assert cfg.parallel.tp == 4 and cfg.train.lr == 1e-4 and cfg.parallel.schedule == "gpipe"


def test_resolved_config_round_trips(tmp_path):
    cfg = load_config(overrides=["--parallel.dp=2", "--model.preset=tiny-gpt"])
    path = tmp_path / "resolved.toml"
    path.write_text(cfg.to_toml())
    assert load_config(path) == cfg
    assert isinstance(cfg, Config)


def test_counts_are_said_in_the_singular_for_one():
    """The one rule every command's count follows (before: "1 steps", "1 file(s) ... are")."""
    assert [counted(n, "step") for n in (0, 1, 2, 1124)] == ["0 steps", "1 step", "2 steps", "1,124 steps"]
    assert (counted(1, "process", "processes"), counted(3, "process", "processes")) == ("1 process", "3 processes")


def test_bad_override_syntax():
    with pytest.raises(ConfigError, match="--section.key=value"):
        load_config(overrides=["--tp=2"])


def test_cli_rejects_invalid_config_without_starting_a_process(tmp_path):
    """Nor loading torch (1.3 s, and 1.5 s more of its checkpoint stack and torch._dynamo): a
    one-line refusal comes back at once."""
    # Any rank would write RUN_DIR/config.toml first; its absence shows no rank ran.
    run_dir = tmp_path / "run"
    script = textwrap.dedent(f"""
        import sys
        from tetrad.cli import main
        code = main(["train", "--parallel.tp=3", "--run.dir={run_dir}"])
        assert main(["check", "--parallel.tp=3", "--run.dir={run_dir}"]) == code
        heavy = ["torch", "torch.distributed.checkpoint", "torch._dynamo"]
        print("loaded by the refusal:", [m for m in heavy if m in sys.modules])
        sys.exit(code)""")
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120)
    assert out.returncode == 2
    assert out.stderr == "tetrad: config error: tp=3 does not divide n_heads=4; use tp in [1, 2]\n" * 2, out.stderr
    assert "training" not in out.stdout and not run_dir.exists()
    assert out.stdout == "loaded by the refusal: []\n"  # tetrad train's and tetrad check's


@pytest.mark.parametrize("schedule", ["1f1b", "gpipe"])
def test_fewer_micro_batches_than_stages_is_legal_and_exact(schedule):
    """Issue 19 flagged pp with fewer micro-batches than stages: legal for gpipe, 1f1b and zb (the
    bubble grows; interleaved is refused, test_pipeline), and it trains the one-process model."""
    from conftest import assert_parity, tiny_config, train_layout

    train = {"global_batch": 1, "micro_batch": 1, "steps": 3}  # m = 1 < pp = 2
    pipelined = train_layout(tiny_config(parallel={"pp": 2, "schedule": schedule}, train=train))
    assert_parity(pipelined, train_layout(tiny_config(train=train)))


# Mistakes a user migrating from Megatron-LM or torchtitan makes on `tetrad train`'s command line
# or in its TOML file: (arguments, file text or None, a part of the one-line message that names
# the fix). Each once gave a message that did not name the fix (or named the wrong one).
MIGRATION_MISTAKES = [
    (["--parallel.tensor_model_parallel_size=2"], None, "unknown key parallel.tensor_model_parallel_size "
                                                        "(did you mean 'parallel.tp'?)"),
    (["--train.learning_rate=3e-4"], None, "(did you mean 'train.lr'?)"),
    (["--train.seq_len=256"], None, "unknown key train.seq_len (did you mean 'model.seq_len'?)"),
    (["--parallel.micro_batch=2"], None, "(did you mean 'train.micro_batch'?)"),
    ([], "[optimizer]\nlr = 1e-3\n", "unknown section [optimizer] (did you mean 'train'?)"),
    ([], "steps = 2\n[parallel]\ntp = 2\n", "steps = 2 is outside any table; put it under [train]"),
    (["--parallel.pp=2", "--parallel.stage_layers=2,2"], None,
     "parallel.stage_layers must be a list of integers, got '2,2' (str); write it as [2,2]"),
    ([], "[parallel]\ndp = -1\n", "tetrad does not infer a size from -1"),
    (["--train.steps=0"], None, "train.steps=0 is out of range: it must be an integer in [1, 2147483648)"),
    (["--model.d_model=100"], None, "use a d_model that is a multiple of 2*n_heads = 8, or model.pos='learned'"),
    (["--model.preset=meta-llama/Llama-3.1-8B"], None, "checkpoint.init_from"),
    (["--parallel.tp", "2"], None, "write --parallel.tp=2"),
    (["CONFIG.toml", "--parallel.tp", "2"], "[train]\nsteps = 2\n", "write --parallel.tp=2"),
    (["--config", "CONFIG.toml"], "[train]\nsteps = 2\n", "give CONFIG as a plain argument"),
    (["-c", "CONFIG.toml"], "[train]\nsteps = 2\n", "give CONFIG as a plain argument"),
    (["--job.config_file=CONFIG.toml"], "[train]\nsteps = 2\n", "give CONFIG as a plain argument"),
    (["-parallel.tp=2"], None, "write --parallel.tp=2"),
    (["--steps=2"], None, "write --train.steps=2"),
    (["--tensor-model-parallel-size", "2", "--micro-batch-size", "1"], None, "write --parallel.tp=2"),
    (["--micro-batch-size=1"], None, "write --train.micro_batch=1"),
    (["--bf16"], None, "write --train.dtype=bf16"),
    (["--bf16=true"], None, "write --train.dtype=bf16"),
    (["--sequence-parallel"], None, "write --parallel.sequence_parallel=true"),
    (["--use-distributed-optimizer"], None, "write --parallel.zero=1"),
    (["--moe-router-enable-expert-bias"], None, "write --model.router_bias_update_rate=0.001"),
    (["--recompute-activations"], None, "write --train.recompute=selective"),
    (["--multi-latent-attention"], None, "write --model.kv_lora_rank=512"),
    (["--qk-pos-emb-head-dim=64"], None, "write --model.qk_rope_head_dim=64"),
    ([], "[model]\nqk_head_dim = 128\n", "unknown key model.qk_head_dim (did you mean 'model.qk_nope_head_dim'?)"),
    (["--save=ckpt"], None, "write --checkpoint.dir=ckpt"),
    ([], "[model]\nflavor = \"8B\"\n", "unknown key model.flavor (did you mean 'model.preset'?)"),
    ([], "[activation_checkpoint]\nmode = \"full\"\n", "unknown section [activation_checkpoint] (did you mean 'train'?)"),
    ([], "[train]\nmode = \"full\"\n", "unknown key train.mode (did you mean 'train.recompute'?)"),
    (["--train.compile", "CONFIG.toml"], "[train]\nsteps = 2\n", "write --train.compile=true"),
    (["--parallel.pp=2", "--parallel.stage_layers=[2,", "2]"], None,
     "the shell cut --parallel.stage_layers=[2, 2] at a space; quote the whole override"),
    (["--parallel.stage_layers=[2,2", "--parallel.pp=2"], None,
     "parallel.stage_layers must be a list of integers, got '[2,2' (str)"),
    (["--train.lr=.0003"], None, "train.lr must be a number, got '.0003' (str); write it as 0.0003"),
    (["CONFIG"], "[train]\nsteps = 2\n", "config file CONFIG does not exist (did you mean CONFIG.toml?)"),
    (["."], None, "config file . is a folder; give a TOML file"),
    (["train.steps=10"], None, "'train.steps=10' is neither a config file nor an override (overrides start with two "
                                "dashes); write --train.steps=10"),
    (["CONFIG.toml", "parallel.tp=2"], "[train]\nsteps = 2\n", "write --parallel.tp=2"),
    (["steps=10"], None, "write --train.steps=10"),
    (["CONFIG.yaml"], "train:\n  steps: 2\n", "tetrad's config is TOML, not YAML"),
]


@pytest.mark.parametrize("argv,text,message", MIGRATION_MISTAKES, ids=[" ".join(a) or t.split("\n")[0]
                                                                       for a, t, _ in MIGRATION_MISTAKES])
def test_migration_mistake_names_the_fix(argv, text, message, tmp_path, monkeypatch):
    """The argument split and the loading `tetrad train` does before any process starts."""
    monkeypatch.chdir(tmp_path)
    if text is not None:
        name = next((a for a in argv if a.startswith("CONFIG.")), "CONFIG.toml")
        (tmp_path / name).write_text(text)
        argv = argv if "CONFIG" in " ".join(argv) else [name, *argv]
    with pytest.raises(ConfigError) as err:
        path, overrides = split_config_args(argv)
        load_config(path, overrides)
    assert message in str(err.value) and "\n" not in str(err.value)


def test_help_after_a_config_prints_the_usage(capsys):
    from tetrad.cli import main
    assert main(["train", "configs/demo.toml", "--help"]) == 0
    assert "usage: tetrad train [CONFIG]" in capsys.readouterr().out


def test_train_help_lists_every_key_with_its_default(capsys):
    """A Megatron-LM or torchtitan user's first question, what tp and the micro-batch are called
    here, is answered by --help (before, two lines and no key)."""
    from tetrad.cli import main
    assert main(["train", "--help"]) == 0
    out = capsys.readouterr().out
    for section, values in Config().to_dict().items():
        line = next(line for line in out.splitlines() if line.startswith(f"  [{section}] "))
        listed = out[out.index(line):].split("\n  [")[0]
        assert all(re.search(rf"(^|[ ,]){key}=", listed) for key in values), (section, listed)
    assert "micro_batch=4" in out and max(len(line) for line in out.splitlines()) <= 100


def test_an_unknown_command_is_named_with_the_closest(capsys):
    from tetrad.cli import main
    assert main(["trian", "configs/demo.toml"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("tetrad: unknown command 'trian' (did you mean 'train'?)\n") and "commands:" in err
    assert main([]) == 0 and "commands:" in capsys.readouterr().out


def test_a_reader_that_leaves_ends_the_command_quietly(tmp_path):
    """`tetrad ... | head`: once stdout's reader is gone, the command ends with SIGPIPE's status and
    no traceback, as Unix tools do (it ended in a BrokenPipeError traceback). The pipe's reading
    end is closed before the command starts, so its first line already finds no reader."""
    import os
    (tmp_path / "in.txt").write_text("a few words of text\n" * 50)
    read, write = os.pipe()
    os.close(read)
    try:
        done = subprocess.run([sys.executable, "-m", "tetrad", "data", str(tmp_path / "in.txt"), "--out",
                               str(tmp_path / "out")], stdout=write, stderr=subprocess.PIPE, text=True, timeout=120)
    finally:
        os.close(write)
    assert done.returncode == 128 + 13, done.stderr  # SIGPIPE
    assert "Traceback" not in done.stderr, done.stderr


def test_settings_the_layout_leaves_idle_are_named_as_the_run_starts(tmp_path, capsys):
    """sequence_parallel at tp=1, ZeRO or a gradient codec at dp*cp=1: accepted (a config may be
    shared between layouts) and said, once, before the run (the audit helper found them silent)."""
    from tetrad.cli import main
    idle = ["--parallel.sequence_parallel=true", "--parallel.zero=1", "--parallel.grad_codec=bf16"]
    assert main(["train", "--train.steps=1", f"--run.dir={tmp_path / 'idle'}", *idle]) == 0
    out = capsys.readouterr().out
    for said in ("parallel.sequence_parallel=true does nothing at tp=1", "parallel.zero=1 does nothing at dp*cp=1",
                 "parallel.grad_codec='bf16' does nothing at dp*cp=1"):
        assert out.count(said) == 1, out
    assert main(["train", "--train.steps=1", f"--run.dir={tmp_path / 'busy'}", "--parallel.dp=2",
                 "--parallel.zero=2"]) == 0
    assert "does nothing" not in capsys.readouterr().out


def test_a_context_shorter_than_seq_len_is_named_idle():
    """max_position_embeddings under seq_len: the context is seq_len (ModelConfig.context_length),
    so the key does nothing; said, not silently dropped (nor refused: an imported model trained past
    its context sets it)."""
    from tetrad.config import idle_settings
    said = "model.max_position_embeddings=64 does nothing at seq_len=128"
    assert any(said in note for note in idle_settings(load_config(overrides={"model": {"max_position_embeddings": 64}})))
    for context in (0, 128, 256):
        assert not idle_settings(load_config(overrides={"model": {"max_position_embeddings": context}}))


def test_a_router_left_untrained_is_named():
    """Top-1 with normalized weights (each 1) and no load-balancing loss: nothing trains the router,
    said before the run starts; with either changed, nothing is said."""
    from tetrad.config import idle_settings
    model = {"n_experts": 4, "experts_per_token": 1, "router_aux_loss": 0.0}
    assert any("leaves the router as initialised" in note for note in idle_settings(load_config(overrides={"model": model})))
    for change in ({"router_aux_loss": 0.01}, {"normalize_expert_weights": False}, {"experts_per_token": 2}):
        assert not idle_settings(load_config(overrides={"model": {**model, **change}}))


def test_a_byte_order_mark_is_read(tmp_path):
    path = tmp_path / "bom.toml"
    path.write_bytes(b"\xef\xbb\xbf[train]\nsteps = 2\n")  # as some Windows editors save
    assert load_config(path).train.steps == 2


def test_command_line_forms_users_write_are_accepted():
    """A table key set by its dotted path (as TOML allows in a file), and a number typed for a
    string key (train.profile=4 as the docs write it) taken as the text typed."""
    cfg = load_config(overrides=["--parallel.comm_options.tp.max_ctas=16", "--parallel.comm_options.tp.min_ctas=2",
                                 "--train.profile=4", "--run.wandb_name=2024", '--run.wandb_project="a b"'])
    assert cfg.parallel.comm_options == {"tp": {"max_ctas": 16, "min_ctas": 2}}
    assert (cfg.train.profile, cfg.run.wandb_name, cfg.run.wandb_project) == ("4", "2024", "a b")


def test_a_missing_device_is_a_config_error():
    from tetrad.device import resolve_device_type
    import torch
    if torch.accelerator.is_available():
        pytest.skip("this machine has an accelerator")
    with pytest.raises(ConfigError, match="use train.device='cpu' or 'auto'"):
        resolve_device_type("cuda")
    with pytest.raises(ConfigError, match=r"--device='cuda' but torch sees no cuda device.*use --device='cpu'"):
        resolve_device_type("cuda", "--device")  # tetrad bench's flag, named as the user typed it
