"""Where `tetrad generate` runs: --dtype puts the weights, the KV cache and the compute in a low
precision and samples what fp32 samples; --tp N splits the model and its KV cache over N ranks
(real gloo processes) and samples exactly the one-process tokens, greedy and seeded, with its
loss, for a tetrad checkpoint and an HF folder, each model variant, and a chat's turns with their
KV cache, here and under torchrun; a bad --device, --dtype or --tp is one line before any weight
is read."""

from __future__ import annotations

import dataclasses
import os
import re
import subprocess
import sys

import pytest
import torch
import torch.distributed as dist

from conftest import run_ranks
from test_chat_data import _chat_tokenizer
from test_generate import random_model
from tetrad.cli import main
from tetrad.data.chat import template_beside
from tetrad.dist.layout import Layout
from tetrad.dist.topology import Topology
from tetrad.model.sampling import GREEDY, Sampling
from tetrad.sample import _job, sample_on_this_rank
from tetrad.train.generate import (Dialogue, Weights, complete, continuation_loss, found_weights, generate,
                                   load_generator)
from tetrad.train.inference import inference_model

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
    (["--chat", "--tp", "2"], "a conversation on stdin runs on one process; pass --prompt for one message under "
                              "--tp 2, or --tp 1 to converse"),
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
    assert capsys.readouterr() == ("", "tetrad generate: a conversation on stdin runs on one process; pass --prompt "
                                       "for one message under --tp 2, or run it without torchrun to converse\n")


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
