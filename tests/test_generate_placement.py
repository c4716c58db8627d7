"""Where `tetrad generate` runs: --dtype puts the weights, the KV cache and the compute in a low
precision and samples what fp32 samples; --tp N splits the model and its KV cache over N ranks
(real gloo processes) and samples exactly the one-process tokens, greedy and seeded, with its
loss, for a tetrad checkpoint and an HF folder, each model variant, and a chat's turns with their
KV cache, here and under torchrun; a bad --device, --dtype or --tp is one line before any weight
is read."""

from __future__ import annotations

import dataclasses
import io
import os
import re
import select
import subprocess
import sys

import pytest
import torch
import torch.distributed as dist

from conftest import run_ranks, tiny_config
from test_chat_data import _chat_tokenizer
from test_generate import random_model
from test_init_from import Counted, whole
from tetrad.cli import main
from tetrad.data.chat import template_beside
from tetrad.dist.layout import Layout
from tetrad.dist.topology import Topology
from tetrad.model.execution import Execution
from tetrad.model.llama import Transformer
from tetrad.model.sampling import GREEDY, Sampling
from tetrad.model.sharding import init_parameters
from tetrad.sample import _job, chosen_dtype, out_of_memory, sample_on_this_rank
from tetrad.train.generate import (Dialogue, Weights, complete, continuation_loss, found_weights, generate,
                                   load_generator, single_process_model)
from tetrad.train.inference import inference_model
from tetrad.train.init_from import initial_weights

pytestmark = pytest.mark.dist

TINY = ["--model.n_layers=2", "--model.d_model=64", "--model.n_heads=4", "--model.n_kv_heads=2",
        "--model.ffn_hidden=128", "--model.seq_len=32", "--train.global_batch=8", "--train.micro_batch=2"]
PROMPT = "the licence"


def _write_hf(folder, vocab_size: int | None = None) -> None:
    """A tiny Llama folder with a BPE tokenizer (and a chat template beside it), its head scaled
    so that greedy picks lie far apart: no near-tie that rounding could flip. An odd vocabulary
    (301 by default): tp pads it, and the padding's logits must never be drawn."""
    transformers = pytest.importorskip("transformers")
    folder.mkdir()
    tokenizer, _ = _chat_tokenizer(folder)
    config = transformers.LlamaConfig(vocab_size=vocab_size or tokenizer.get_vocab_size() + 1, hidden_size=64,
                                      intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                                      num_key_value_heads=2, max_position_embeddings=256)
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(config).eval()
    with torch.no_grad():
        model.lm_head.weight.mul_(20)
    model.save_pretrained(folder, safe_serialization=True)


@pytest.fixture(scope="module")
def weights(tmp_path_factory):
    """{"tetrad": a run's checkpoint (trained 3 steps, bytes), "hf": an HF folder}."""
    folder = tmp_path_factory.mktemp("placement")
    assert main(["train", *TINY, "--train.steps=3", "--checkpoint.every=3", f"--run.dir={folder / 'run'}"]) == 0
    _write_hf(folder / "hf")
    return {"tetrad": folder / "run", "hf": folder / "hf"}


@pytest.fixture(scope="module")
def saved_at_tp2(tmp_path_factory):
    """A run trained at tp 2: its checkpoint stores each sharded tensor as two chunks."""
    folder = tmp_path_factory.mktemp("tp2")
    assert main(["train", *TINY, "--parallel.tp=2", "--train.steps=3", "--checkpoint.every=3", f"--run.dir={folder}"]) == 0
    return folder


def _loss_line(err: str) -> float:
    return float(re.search(r"their loss under the model (\S+) ", err)[1])


def test_bf16_samples_what_fp32_samples_at_about_its_loss(weights, capsys):
    """bf16 weights, KV cache and compute give fp32's greedy and seeded tokens (the scaled head
    keeps the picks far apart), and a loss within 1% of fp32's for the same tokens: bf16 keeps 8
    significant bits, so each weight, product and activation is off by up to 2^-9 (0.2%) of its
    value, and a two-layer model's logits gather a few of those, partly cancelling (measured:
    0.06%). fp16 too. The loss is a float on every dtype."""
    hf = weights["hf"]
    reference, tokenizer, source = load_generator(hf)
    for dtype in (torch.bfloat16, torch.float16):
        model, _, _ = load_generator(hf, dtype=dtype)
        assert {p.dtype for p in model.parameters()} == {dtype}
        for sampling in (GREEDY, Sampling(temperature=1.0)):
            _, prompt, ours = complete(model, tokenizer, PROMPT, 16, sampling, seed=3, source=source)
            _, _, theirs = complete(reference, tokenizer, PROMPT, 16, sampling, seed=3, source=source)
            assert ours == theirs and len(set(ours)) > 3, (dtype, sampling)
            loss = continuation_loss(model, prompt, ours)
            assert isinstance(loss, float)
            assert loss == pytest.approx(continuation_loss(reference, prompt, ours), rel=1e-2)
    texts = {}
    for dtype in ("fp32", "bf16"):
        assert main(["generate", str(hf), "--prompt", PROMPT, "--max-new-tokens", "12", "--temperature", "0",
                     "--dtype", dtype]) == 0
        out, err = capsys.readouterr()
        texts[dtype] = out, _loss_line(err)
        assert f"; cpu, {dtype})" in err, err
    assert texts["bf16"][0] == texts["fp32"][0]
    assert texts["bf16"][1] == pytest.approx(texts["fp32"][1], rel=1e-2)


@pytest.mark.parametrize("flags, line", [
    (["--prompt", PROMPT, "--device", "tpu"], "--device='tpu' but torch sees no tpu device on this machine; use "
                                              "--device='cpu' or 'auto'"),
    (["--prompt", PROMPT, "--device", "cuda:1"], "--device cuda:1: pass the device type alone (--device cuda), and "
                                                 "pick the GPU with CUDA_VISIBLE_DEVICES; under --tp rank i takes local "
                                                 "device i"),
    (["--prompt", PROMPT, "--dtype", "fp64"], "--dtype 'fp64' is not one of fp32, bf16, fp16; pass one of them"),
    (["--prompt", PROMPT, "--tp", "3"], "--tp: tp=3 does not divide n_heads=4; use --tp in [1, 2]"),
    (["--prompt", PROMPT, "--tp", "0"], "--tp 0: need --tp >= 1"),
])
def test_a_bad_placement_is_one_line(weights, capsys, flags, line):
    assert main(["generate", str(weights["hf"]), *flags]) == 2
    out, err = capsys.readouterr()
    assert (out, err) == ("", f"tetrad generate: {line}\n")


def test_a_conversation_refused_under_torchrun_is_told_a_fix_torchrun_takes(weights, capsys, monkeypatch):
    """Under torchrun --tp is the world size, so `--chat` without --prompt is told to run without
    torchrun (before: '--tp 1 to converse', which torchrun then refuses as not its world size)."""
    monkeypatch.setenv("RANK", "0")
    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.delenv("TORCHELASTIC_ERROR_FILE", raising=False)
    assert main(["generate", str(weights["hf"]), "--chat"]) == 2
    assert capsys.readouterr() == ("", "tetrad generate: a conversation on stdin runs without torchrun (tetrad "
                                       "generate --tp 2 starts its ranks itself); pass --prompt for one message under "
                                       "torchrun, or run it without torchrun to converse\n")


SAMPLINGS = {"greedy": ["--temperature", "0"], "seeded": ["--temperature", "1", "--top-p", "0.95", "--seed", "5"]}


@pytest.mark.parametrize("which", ["tetrad", "hf"])
def test_tp2_samples_the_one_process_tokens_and_loss(weights, capsys, which):
    """Each rank of two holds half the heads, the MLP, the vocabulary and the KV cache; both
    return the one-process token ids, greedy and seeded, and its loss to fp32's rounding (the
    row-parallel sums add in another order); the command prints rank 0's text once."""
    for name, flags in SAMPLINGS.items():
        job = _job([str(weights[which]), "--prompt", PROMPT, "--max-new-tokens", "12", *flags])
        text, prompt, new, loss = sample_on_this_rank(job)
        assert len(new) >= 4 and len(set(new)) > 2, (name, new)
        for rank in run_ranks(sample_on_this_rank, 2, dataclasses.replace(job, tp=2)):
            assert rank[:3] == (text, prompt, new), name
            assert rank[3] == pytest.approx(loss, rel=1e-5, abs=1e-6), name
    argv = ["generate", str(weights[which]), "--prompt", PROMPT, "--max-new-tokens", "12", *SAMPLINGS["seeded"]]
    assert main(argv) == 0
    one = capsys.readouterr()
    assert main([*argv, "--tp", "2"]) == 0
    two = capsys.readouterr()
    assert two.out == one.out and two.out.startswith(PROMPT)
    assert _loss_line(two.err) == pytest.approx(_loss_line(one.err), abs=1e-4) and "; cpu, fp32, tp 2)" in two.err


def _two_turns(found: Weights) -> tuple:
    """Two greedy chat turns, the second reusing the first's KV cache, on this rank (tp: the job's ranks)."""
    tp = dist.get_world_size() if dist.is_initialized() else 1
    model = inference_model(found.model, found.reader(), Topology(Layout(tp=tp), torch.device("cpu")))
    dialogue = Dialogue(model, found.tokenizer, template_beside(found.source), "You answer briefly.", found.source)
    turns = [dialogue.answer(q, 6, GREEDY) for q in ("Name a colour.", "And another?")]
    return turns, dialogue.cache.reused, dialogue.cache.prompted


def test_a_chat_under_tp2_answers_as_one_process_with_its_kv_cache(weights, capsys):
    """A chat's second turn reuses the first's KV cache (each rank its heads' share) and answers
    as one process does; `--chat --prompt` under --tp 2 prints the one-process answer."""
    hf = weights["hf"]
    found = found_weights(hf)
    alone = _two_turns(found)
    assert alone[1] > 0  # the second turn read the first's tokens from the cache
    assert run_ranks(_two_turns, 2, found) == [alone, alone]
    argv = ["generate", str(hf), "--chat", "--system", "You answer briefly.", "--prompt", "Name a colour.",
            "--temperature", "0", "--max-new-tokens", "6"]
    assert main(argv) == 0
    one = capsys.readouterr().out
    assert main([*argv, "--tp", "2"]) == 0
    assert capsys.readouterr().out == one == alone[0][0][0] + "\n"


def test_a_conversation_on_stdin_under_tp2_answers_as_one_process(weights, tmp_path):
    """`--chat` without --prompt under --tp 2 was refused (run_local's ranks have no stdin): this
    process reads stdin and passes each line to tp rank 0, which shares it with the other rank and
    prints the answers; both turns answer as one process does, the second from the first's KV cache."""
    found = found_weights(weights["hf"])
    alone = _two_turns(found)
    assert all(text for text, _, _ in alone[0]) and alone[1] > 0
    argv = [sys.executable, "-m", "tetrad", "generate", str(weights["hf"]), "--chat", "--system", "You answer briefly.",
            "--temperature", "0", "--max-new-tokens", "6"]
    env = {**os.environ, "TMPDIR": str(tmp_path), "OMP_NUM_THREADS": "1"}
    runs = [subprocess.run([*argv, "--tp", tp], input="Name a colour.\nAnd another?\n", capture_output=True, text=True,
                           timeout=120, env=env) for tp in ("1", "2")]
    for out in runs:
        assert (out.returncode, out.stdout) == (0, "".join(text + "\n" for text, _, _ in alone[0])), out.stderr
        assert out.stderr == (f"tetrad generate: answered 2 messages; the KV cache held {alone[1]} of their "
                              f"{alone[2]} prompt tokens\n"), out.stderr


def test_a_tp2_conversation_forks_its_cpu_ranks_while_stdin_waits_for_the_next_line(weights, tmp_path):
    """A person types as the ranks start: the thread reading stdin was blocked in its readline when
    run_local forked them, and each forked rank, which closes its copy of sys.stdin first thing,
    waited forever for the buffer's lock that the blocked read held in the copy: the command hung
    before its first answer (input piped whole was read to its end before the fork, and passed).
    Here the first line comes at once and the next only after the first answer."""
    found = found_weights(weights["hf"])
    first = _two_turns(found)[0][0][0]
    argv = [sys.executable, "-m", "tetrad", "generate", str(weights["hf"]), "--chat", "--system", "You answer briefly.",
            "--temperature", "0", "--max-new-tokens", "6", "--tp", "2"]
    env = {**os.environ, "TMPDIR": str(tmp_path), "OMP_NUM_THREADS": "1"}
    proc = subprocess.Popen(argv, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            env=env)
    try:
        proc.stdin.write("Name a colour.\n")
        proc.stdin.flush()
        answered, _, _ = select.select([proc.stdout], [], [], 60)
        assert answered, "no answer 60 s after the first line: the ranks hung as they started"
        assert proc.stdout.readline() == first + "\n"
        out, err = proc.communicate(timeout=60)  # the input's end
    finally:
        proc.kill()
        proc.wait()
    assert (proc.returncode, out) == (0, ""), err
    assert err.startswith("tetrad generate: answered 1 message;"), err


def test_stdin_that_is_not_utf8_ends_a_tp2_conversation_as_it_ends_one_process(weights, tmp_path):
    """The thread that reads stdin for tp rank 0 died on bytes that are not UTF-8 and put nothing
    on the queue: rank 0 waited for a line forever, the other rank in the line's broadcast for the
    group's timeout (600 s). Now rank 0 raises what reading raised, as one process does: that one
    line and exit 2, at once."""
    argv = [sys.executable, "-m", "tetrad", "generate", str(weights["hf"]), "--chat", "--temperature", "0",
            "--max-new-tokens", "4"]
    env = {**os.environ, "TMPDIR": str(tmp_path), "OMP_NUM_THREADS": "1", "PYTHONIOENCODING": "utf-8:strict"}
    runs = []
    for tp in ("1", "2"):
        try:
            runs.append(subprocess.run([*argv, "--tp", tp], input=b"Name a colour.\n\xff\n", capture_output=True,
                                       timeout=60, env=env))
        except subprocess.TimeoutExpired:
            pytest.fail(f"--tp {tp} still waited for a line 60 s after stdin's bad byte")
    assert runs[0].returncode == 2 and runs[0].stderr.count(b"\n") == 1, runs[0].stderr
    assert runs[0].stderr == (b"tetrad generate: stdin is not utf-8 text (byte 0xff: invalid start byte); convert the "
                              b"input to utf-8 first, e.g. `iconv -f latin1 -t utf-8 FILE | tetrad generate ...` "
                              b"(after -f, the encoding it is in)\n"), runs[0].stderr
    assert (runs[1].returncode, runs[1].stdout, runs[1].stderr) == (2, runs[0].stdout, runs[0].stderr), runs[1].stderr


def test_under_torchrun_each_process_is_a_rank_and_rank_0_prints(weights, capsys, tmp_path):
    """`torchrun --nproc-per-node 2 -m tetrad generate ...`: --tp defaults to the world size, the
    text is the one-process text, printed once; a --tp the job does not have is one line, once,
    and torchrun's summary gives it as the root cause (before: 'To enable traceback see ...')."""
    argv = [str(weights["hf"]), "--prompt", PROMPT, "--max-new-tokens", "8", *SAMPLINGS["seeded"]]
    assert main(["generate", *argv]) == 0
    one = capsys.readouterr().out
    torchrun = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2", "-m", "tetrad",
                "generate", *argv]
    env = {**os.environ, "TMPDIR": str(tmp_path), "OMP_NUM_THREADS": "1"}
    out = subprocess.run(torchrun, capture_output=True, text=True, timeout=120, env=env)
    assert (out.returncode, out.stdout) == (0, one), out.stderr[-2000:]
    assert out.stderr.count("tetrad generate: ") == 1 and "; cpu, fp32, tp 2)" in out.stderr, out.stderr
    out = subprocess.run([*torchrun, "--tp", "1"], capture_output=True, text=True, timeout=120, env=env)
    line = "tetrad generate: --tp 1 but torchrun started 2 processes; pass --tp 2, or start 1 process"
    assert out.returncode != 0 and out.stdout == "", out.stderr
    assert len(re.findall(f"^{re.escape(line)}$", out.stderr, re.MULTILINE)) == 1, out.stderr
    root_cause = out.stderr.partition("Root Cause (first observed failure):")[2]
    assert f"traceback : {line}\n" in root_cause and "To enable traceback" not in out.stderr, out.stderr


MODELS = {"llama": {}, "gpt": {"preset": "tiny-gpt", "n_layers": 2, "d_model": 64, "n_heads": 4, "n_kv_heads": 4,
                               "ffn_hidden": 128, "seq_len": 32},  # learned positions, LayerNorm, GELU, tied head
          "window": {"sliding_window": 5}, "biases and qk-norm": {"qkv_bias": True, "qk_norm": True},
          "gemma3": {"norm": "gemma_rmsnorm", "mlp": "geglu", "scale_embeddings": True, "sandwich_norm": True,
                     "qk_norm": True, "head_dim": 24, "query_pre_attn_scalar": 20.0, "sliding_window": 5,
                     "layer_types": ["sliding_attention", "full_attention"], "rope_local_base_freq": 100.0,
                     "rope_scaling": {"rope_type": "linear", "factor": 8.0}, "tie_embeddings": True}}


def _decoded(cfg, state: dict, sampling: Sampling) -> tuple:
    """Twelve tokens after a prompt, the logits they were drawn from and their loss, on this rank."""
    tp = dist.get_world_size() if dist.is_initialized() else 1
    model = inference_model(cfg, state.__getitem__, Topology(Layout(tp=tp), torch.device("cpu")))
    prompt = list(range(40, 52))
    new, logits = generate(model, prompt, 12, sampling, seed=3, keep_logits=True)
    return new, torch.stack(logits), continuation_loss(model, prompt, new)


@pytest.mark.parametrize("model", MODELS.values(), ids=MODELS.keys())
def test_tp2_decodes_each_model_variant_as_one_process(model):
    """The variants' own tp-split weights (q/k/v biases split by head, qk-norm's replicated, the
    tied head vocabulary-parallel, learned positions replicated) decode to the one-process
    tokens, greedy and seeded, from the same logits; and the whole vocabulary's."""
    net = random_model(**model)
    state = {name: p.detach().clone() for name, p in net.named_parameters()}
    for name in state:
        if name.endswith(("wq.bias", "wk.bias", "wv.bias", "norm.weight")):  # not 0 or 1
            state[name] += 0.3 * torch.randn(state[name].shape, generator=torch.Generator().manual_seed(len(name)))
    for sampling in (GREEDY, Sampling(temperature=1.0)):
        new, logits, loss = _decoded(net.cfg, state, sampling)
        assert logits.shape[-1] == net.cfg.vocab_size
        for got, got_logits, got_loss in run_ranks(_decoded, 2, net.cfg, state, sampling):
            assert got == new
            torch.testing.assert_close(got_logits, logits, rtol=1e-5, atol=1e-5)
            assert got_loss == pytest.approx(loss, rel=1e-5)


def test_the_logits_kept_for_each_token_are_the_vocabularys_alone():
    """generate keeps each step's logits; the first step's were a view of the prompt's logits at
    every position (prompt x vocabulary floats, gigabytes for a long prompt and a large vocabulary
    on a GPU), kept alive with it."""
    net = random_model()
    _, logits = generate(net, list(range(30)), 2, GREEDY, keep_logits=True)
    assert [lg.untyped_storage().nbytes() for lg in logits] == [net.cfg.vocab_size * 4] * 2


def _tail_under(layout: dict, sequence_parallel: bool) -> str:
    """The error a tail=1 forward meets on this rank of `layout`, with or without sequence parallelism."""
    topo = Topology(Layout(**layout), torch.device("cpu"))
    cfg = tiny_config().model
    model = Transformer(cfg, topo, execution=Execution(sequence_parallel=sequence_parallel))
    init_parameters(model, seed=1)
    ids = torch.arange(8).view(1, 8)
    try:
        model(ids, torch.arange(8), tail=1)
    except ValueError as e:
        return str(e)
    finally:
        topo.close()
    return "ran"


@pytest.mark.parametrize("layout, sequence_parallel", [({"cp": 2}, False), ({"tp": 2}, True)], ids=["cp", "sp"])
def test_tail_is_refused_where_a_rank_holds_a_shard_of_the_sequence(layout, sequence_parallel):
    """tail=k reads the last k positions; under cp or sp a rank's positions are a shard of the
    sequence, whose tail is not the sequence's: refused on every rank, not silently wrong."""
    line = ("tail=1 takes the sequence's last positions, and under sequence or context parallelism this rank "
            "holds a shard of it; run the model with neither")
    assert run_ranks(_tail_under, 2, layout, sequence_parallel) == [line, line]
    assert run_ranks(_tail_under, 2, {"tp": 2}, False) == ["ran", "ran"]  # tp without sp holds the whole sequence


PRE_AMPERE = "bf16 needs compute capability 8.0 (Ampere) or newer; GPU 0 has 7.0"


@pytest.mark.parametrize("device_type, flag, problem, chosen", [
    ("cpu", None, None, "fp32"), ("cuda", None, None, "bf16"),
    ("cuda", None, PRE_AMPERE, "fp16"),  # the default the device cannot run: fp16, said in a note
    ("cuda", "bf16", PRE_AMPERE, "bf16"),  # the user's own flag: kept, for _placement's check to refuse
    ("cuda", "fp32", None, "fp32"), ("cpu", "bf16", None, "bf16")])
def test_the_default_dtype_is_fp16_where_the_device_has_no_bf16(device_type, flag, problem, chosen):
    """On a GPU before Ampere the default bf16 was refused naming `--dtype bf16`, a flag the user
    never passed; unasked, fp16 runs there instead and a note says why."""
    dtype, note = chosen_dtype(device_type, flag, problem)
    assert dtype == chosen
    if chosen == "fp16":
        assert note == ("tetrad generate: note: fp16, as this cuda device cannot multiply bf16 matrices "
                        f"({PRE_AMPERE}); --dtype fp32 for fp32's range")
    else:
        assert note is None


def _reads_and_tokens(found: Weights) -> tuple[dict[str, int], list[int]]:
    """Elements read of each tensor to build this rank's model, and its greedy tokens after PROMPT."""
    tp = dist.get_world_size() if dist.is_initialized() else 1
    reads, reader = {}, found.reader()
    model = inference_model(found.model, lambda name: Counted(reader(name), name, reads),
                            Topology(Layout(tp=tp), torch.device("cpu")))
    _, _, new = complete(model, found.tokenizer, PROMPT, 10, GREEDY, source=found.source)
    return reads, new


@pytest.mark.parametrize("which", ["tetrad", "tetrad saved at tp 2", "hf"])
def test_each_tp_rank_reads_only_its_part_of_each_tensor(weights, saved_at_tp2, which):
    """Every rank read every whole tensor and cut its shard from it (tp x the reads, and the
    largest tensor whole on each rank); now a rank asks for its rows or columns alone, the
    replicated norms whole, the padded vocabulary's zero rows read by none, and samples the
    one-process tokens (the HF folder's 301-token vocabulary pads to 302). A part read is that
    part of the whole tensor, across a tp 2 checkpoint's two chunks too."""
    path = saved_at_tp2 if which == "tetrad saved at tp 2" else weights[which.split()[0]]
    found, stored = found_weights(path), initial_weights(str(path))
    shapes = {name: p.numel() for name, p in single_process_model(found.model, found.reader()).named_parameters()}
    for name in shapes:
        tensor = whole(stored(name))
        box = (slice(1, tensor.shape[0] - 1), *(slice(0, n) for n in tensor.shape[1:]))
        assert torch.equal(found.reader()(name)[box], tensor[box]), name
    alone, tokens = _reads_and_tokens(found)
    assert alone == shapes and len(tokens) >= 4
    ranks = run_ranks(_reads_and_tokens, 2, found)
    assert [new for _, new in ranks] == [tokens, tokens]
    for name, numel in shapes.items():
        per_rank = [reads[name] for reads, _ in ranks]
        replicated = name.endswith("norm.weight")
        assert per_rank == [numel, numel] if replicated else sum(per_rank) == numel, (name, per_rank)
    sharded = sum(n for name, n in shapes.items() if not name.endswith("norm.weight"))
    assert all(sum(reads.values()) - (sum(shapes.values()) - sharded) == pytest.approx(sharded / 2, rel=0.01)
               for reads, _ in ranks)


OOM = ("CUDA out of memory. Tried to allocate 2.00 GiB. GPU 0 has a total capacity of 15.77 GiB of which 1.12 GiB "
       "is free. Of the allocated memory 13.90 GiB is allocated by PyTorch")


def _refused(*args, **kwargs):
    raise torch.OutOfMemoryError(OOM)  # what CUDA's caching allocator raises when a block does not fit


@pytest.mark.parametrize("stage, target, flags", [
    ("filling the model", "inference_model", ["--tp", "1"]),
    ("filling the model", "inference_model", ["--tp", "2"]),  # on each rank, rank 0's line printed
    ("decoding", "complete", ["--dtype", "bf16"]),
    ("decoding", "converse", ["--chat"])])
def test_running_out_of_device_memory_is_one_line_naming_what_to_change(weights, capsys, monkeypatch, stage, target,
                                                                        flags):
    """An allocation the device refuses (torch.OutOfMemoryError) while the model is filled or a
    sample decoded was a traceback with no hint; now one line names what torch tried to allocate
    and the flags that need less: more --tp, bf16 weights, fewer tokens for the KV cache."""
    monkeypatch.setattr(f"tetrad.sample.{target}", _refused)
    monkeypatch.setattr("sys.stdin", io.StringIO("Name a colour.\n"))
    argv = ["generate", str(weights["hf"]), *(["--prompt", PROMPT] if target != "converse" else []), *flags]
    assert main(argv) == 2
    out, err = capsys.readouterr()
    tp = 2 if "2" in flags else 1
    dtype = "bf16" if "bf16" in flags else "fp32"
    # tp 2 is the most its 4 heads and 2 KV heads take: no --tp is suggested there (--tp 4 was, refused)
    fixes = (["--tp 2 to split the model and its KV cache over 2 GPUs"] if tp == 1 else []) + \
        (["--dtype bf16 for half the memory"] if dtype == "fp32" else []) + \
        (["a shorter --max-new-tokens or prompt (the KV cache is allocated for both)"] if stage == "decoding" else [])
    assert (out, err) == ("", f"tetrad generate: cpu out of memory while {stage} (tried to allocate 2.00 GiB) at "
                              f"{dtype}, tp {tp}; pass {', or '.join(fixes)}\n")


def test_out_of_memory_exits_non_zero_without_a_traceback(weights, tmp_path):
    """The command as a user runs it (a process of its own), the model's build refused by the allocator."""
    script = ("import sys, torch, tetrad.sample as sample\n"
              "def refused(*args, **kwargs):\n"
              f"    raise torch.OutOfMemoryError({OOM!r})\n"
              "sample.inference_model = refused\n"
              "from tetrad.cli import main\n"
              "sys.exit(main(sys.argv[1:]))\n")
    out = subprocess.run([sys.executable, "-c", script, "generate", str(weights["hf"]), "--prompt", PROMPT],
                         capture_output=True, text=True, timeout=120, env={**os.environ, "TMPDIR": str(tmp_path)})
    assert out.returncode == 2 and out.stdout == "", out.stderr
    assert "Traceback" not in out.stderr and out.stderr.count("\n") == 1, out.stderr
    assert out.stderr.startswith("tetrad generate: cpu out of memory while filling the model (tried to allocate "
                                 "2.00 GiB) at fp32, tp 1; pass --tp 2"), out.stderr


def test_out_of_memory_on_one_rank_ends_every_rank_at_once(weights, tmp_path):
    """Rank 1 runs out of memory filling the model (another process on its GPU) while rank 0 goes
    on into the decoding's logits all-gather, which on NCCL waits for rank 1 until the group's
    timeout (600 s): rank 1 returned its line and left, rank 0 waited, and the command hung. Now
    the refusal ends every rank at once: one line, exit 2. Rank 0 waits as NCCL's collective
    would, on a key nobody sets (gloo's all-gather would fail as soon as rank 1 left)."""
    script = ("import datetime, os, sys, torch, torch.distributed as dist, tetrad.sample as sample\n"
              "filled = sample.inference_model\n"
              "def one_refused(*args, **kwargs):\n"
              "    if os.environ['RANK'] == '1':\n"
              f"        raise torch.OutOfMemoryError({OOM!r})\n"
              "    return filled(*args, **kwargs)\n"
              "def waits(*args, **kwargs):\n"
              f"    dist.FileStore({str(tmp_path / 'never')!r}, 1).wait(['never'], datetime.timedelta(seconds=600))\n"
              "sample.inference_model, sample.complete = one_refused, waits\n"
              "from tetrad.cli import main\n"
              "sys.exit(main(sys.argv[1:]))\n")
    argv = ["generate", str(weights["hf"]), "--prompt", PROMPT, "--tp", "2"]
    try:
        out = subprocess.run([sys.executable, "-c", script, *argv], capture_output=True, text=True, timeout=60,
                             env={**os.environ, "TMPDIR": str(tmp_path)})
    except subprocess.TimeoutExpired:
        pytest.fail("rank 0 still waited in its collective 60 s after rank 1 refused")
    assert out.returncode == 2 and out.stdout == "", out.stderr
    assert out.stderr == ("tetrad generate: cpu out of memory while filling the model (tried to allocate 2.00 GiB) "
                          "at fp32, tp 2; pass --dtype bf16 for half the memory\n"), out.stderr


@pytest.mark.parametrize("device_type, tp, dtype, line", [
    ("cpu", 1, "fp32", "pass --tp 2 to split the model and its KV cache over 2 GPUs, or --dtype bf16 for half the "
                       "memory"),
    ("cuda", 1, "fp32", "pass --dtype bf16 for half the memory"),  # this machine has no second GPU (none at all)
    ("cpu", 2, "bf16", "no larger --tp fits the model's heads or this machine's devices: free memory on the device, "
                       "or use one with more")])
def test_out_of_memory_suggests_only_a_tp_the_model_and_machine_take(weights, device_type, tp, dtype, line):
    """--tp 2N was suggested whatever the model's heads (4 and 2 KV heads here: tp 4 is refused) or
    the GPUs this machine has; now the next tp `tetrad generate` would run, or none, and with
    nothing left to suggest the line still says what to change."""
    if device_type == "cuda" and torch.accelerator.device_count() > 1:
        pytest.skip("a machine with two GPUs takes --tp 2")
    job = dataclasses.replace(_job([str(weights["hf"]), "--prompt", PROMPT, "--tp", str(tp), "--dtype", dtype]),
                              device_type=device_type)
    assert out_of_memory(job, "filling the model", torch.OutOfMemoryError(OOM)) == \
        f"{device_type} out of memory while filling the model (tried to allocate 2.00 GiB) at {dtype}, tp {tp}; {line}"
