"""Shared helpers for tests: real multi-process gloo runs through tetrad's own launcher."""

from __future__ import annotations

import ctypes
import math
import multiprocessing.util
import os
import signal
import tempfile
from functools import lru_cache
from pathlib import Path

import numpy as np
import pytest
import torch

from tetrad import launch
from tetrad.config import load_config
from tetrad.data.shards import TOKENIZER, mask_name, shard_name, write_index
from tetrad.data.tokenizer import byte_tokenizer
from tetrad.data.sources import CORPORA
from tetrad.model.sharding import gather_full, set_spec, spec_of
from tetrad.train.trainer import Trainer

# Short process-group timeouts turn a mismatched collective into a fast failure; the deadline
# ends a hung test instead of blocking the suite.
PG_TIMEOUT_S = 60
DEADLINE_S = 300

# What pytest sets for each test, and what torch's inductor sets at its first compile in a process
# (its default cache folder, exported for its compile workers), whichever test compiles first.
SET_BY_OTHERS = {"PYTEST_CURRENT_TEST", "TORCHINDUCTOR_CACHE_DIR"}


@pytest.fixture(autouse=True)
def environment_unchanged():
    """A test leaves os.environ as it found it: a setting leaked into the process reaches every
    later test and the ranks they start (an NCCL setting once made torch warn on later commands'
    stderr, failing tests that read it, only in the full suite's order)."""
    before = dict(os.environ)
    yield
    changed = sorted(k for k in before.keys() | os.environ.keys()
                     if before.get(k) != os.environ.get(k) and k not in SET_BY_OTHERS)
    assert not changed, f"the test changed the environment: {changed}"


# Tiny shapes: the whole suite must stay within minutes on 2 cores (docs/design.md, Testing).
TINY = {"model": {"n_layers": 2, "d_model": 64, "n_heads": 4, "n_kv_heads": 2, "ffn_hidden": 128,
                  "seq_len": 32},
        "train": {"steps": 5, "global_batch": 8, "micro_batch": 2, "warmup": 2, "lr": 1e-2}}


def run_ranks(fn, world_size: int, *args, timeout_s: float = DEADLINE_S, spawn: bool = False):
    """Run fn(*args) on `world_size` forked (or spawned) gloo ranks and return every rank's result."""
    return launch.run_local(fn, world_size, args, timeout_s=timeout_s, pg_timeout_s=PG_TIMEOUT_S, spawn=spawn)


def fix_mmap_threshold(nbytes: int = 128 << 10) -> None:
    """Fix glibc's mmap threshold (its default, 128 KiB) in this rank: the dynamic threshold keeps
    freed multi-MiB blocks in the heap, so the resident set would count memory already freed. Set
    in the rank, not as MALLOC_MMAP_THRESHOLD_: the fork server that starts spawned CPU ranks read
    its environment once."""
    M_MMAP_THRESHOLD = -3  # glibc's mallopt parameter
    ctypes.CDLL(None).mallopt(M_MMAP_THRESHOLD, nbytes)


DOC_EOS = 0  # byte 0 never occurs in the built-in corpus


@lru_cache(maxsize=None)
def doc_shards() -> str:
    """A shard folder (vocabulary 256, EOS 0) of the built-in corpus cut into documents of 4 to
    24 bytes: a 32-token window holds a few."""
    text = np.frombuffer(CORPORA["licenses"].read_bytes()[:40_000], dtype=np.uint8)
    rng = np.random.default_rng(0)
    cuts = np.cumsum(rng.integers(4, 25, size=len(text) // 4))
    docs = np.split(text, cuts[cuts < len(text)])
    tokens = np.concatenate([np.append(d, DOC_EOS) for d in docs]).astype(np.uint16)
    folder = Path(tempfile.mkdtemp(prefix="tetrad-doc-shards-"))
    tokens.tofile(folder / shard_name(0))
    write_index(folder, [{"file": shard_name(0), "tokens": len(tokens), "documents": len(docs)}], 256, DOC_EOS)
    return str(folder)


@lru_cache(maxsize=None)
def sft_shards() -> str:
    """A supervised fine-tuning shard folder (vocabulary 256, EOS 0, loss masks) of the built-in
    corpus cut into examples: a prompt of 3 to 16 bytes the loss leaves out, then a response of 1
    to 12 bytes and its EOS the loss counts; two shards, so a pack may cross a shard boundary. A
    32-token window holds one to a few whole examples: its count of counted labels varies."""
    text = np.frombuffer(CORPORA["licenses"].read_bytes()[40_000:60_000], dtype=np.uint8)
    rng = np.random.default_rng(1)
    shards, start = [[], []], 0
    while start < len(text) - 30:
        prompt, response = rng.integers(3, 17), rng.integers(1, 13)
        tokens = np.append(text[start:start + prompt + response], DOC_EOS).astype(np.uint16)
        mask = np.r_[np.zeros(prompt), np.ones(response + 1)].astype(np.uint8)
        shards[start * 2 // len(text)].append((tokens, mask))
        start += prompt + response
    folder = Path(tempfile.mkdtemp(prefix="tetrad-sft-shards-"))
    entries = []
    for i, examples in enumerate(shards):
        np.concatenate([t for t, _ in examples]).tofile(folder / shard_name(i))
        np.concatenate([m for _, m in examples]).tofile(folder / mask_name(shard_name(i)))
        entries.append({"file": shard_name(i), "tokens": sum(len(t) for t, _ in examples), "documents": len(examples)})
    write_index(folder, entries, 256, DOC_EOS, loss_mask=True)
    byte_tokenizer().save(str(folder / TOKENIZER))  # as `tetrad data` leaves one: generate and export decode
    return str(folder)


def tiny_config(**sections):
    """The TINY test config with per-section overrides, e.g. tiny_config(parallel={"dp": 2})."""
    merged = {name: dict(values) for name, values in TINY.items()}
    for name, values in sections.items():
        merged.setdefault(name, {}).update(values)
    merged.setdefault("run", {}).setdefault("dir", tempfile.mkdtemp(prefix="tetrad-test-run-"))
    return load_config(overrides=merged)


def _train_rank(cfg, transport=None, trainer_class=Trainer):
    trainer = trainer_class(cfg, torch.device("cpu"))
    if transport is not None:
        trainer.topo.comm.transport = transport()
    history = trainer.fit()
    return [r["loss"] for r in history], trainer.full_state(), history


def train_layout(cfg, transport=None, timeout_s: float = DEADLINE_S, trainer_class=Trainer):
    """Train `cfg` on dp*tp*pp*cp ranks; return (per-step losses, merged logical parameters, rank-0 history).
    `transport`: a factory, called on every rank, of the point-to-point transport its comm posts
    through (e.g. tests/nccl_semantics.py); torch.distributed's own when None. `trainer_class`:
    Trainer or a test's subclass of it."""
    results = run_ranks(_train_rank, cfg.parallel.world_size, cfg, transport, trainer_class, timeout_s=timeout_s)
    state = {}
    for _, rank_state, _ in results:
        state.update(rank_state)
    return results[0][0], state, results[0][2]


def _fit_rank(cfg):
    trainer = Trainer(cfg, torch.device("cpu"))
    return dict(trainer.topo.coords), trainer.fit()


def rank_histories(cfg, timeout_s: float = DEADLINE_S) -> list[tuple[dict, list[dict]]]:
    """Train `cfg` on its ranks; every rank's (coordinates {"dp", "tp", "pp", "cp"}, history):
    what the planner's per-rank figures are compared with (memory_bytes, comm_bytes)."""
    return run_ranks(_fit_rank, cfg.parallel.world_size, cfg, timeout_s=timeout_s)


def grad_norms(history) -> torch.Tensor:
    """Per-step global gradient norms before clipping (every rank reports the same number)."""
    return torch.tensor([r["grad_norm"] for r in history], dtype=torch.float64)


def assert_parity(got, ref, atol=1e-5, loss_atol=1e-6):
    """`got` and `ref` are train_layout results. fp32 parallel runs differ from one process only in
    the order of sums (over ranks, micro-batches, tp pieces): ~1e-7 relative per step on the
    loss, a little more on parameters after Adam's 5 steps; callers with tp pass a wider `atol`.

    Losses and AdamW-with-clipping parameters cannot see a gradient multiplied by the same factor
    every step (AdamW's update is scale-invariant, clipping cancels a uniform factor), so each
    step's pre-clip gradient norm is compared as well: a summed-instead-of-averaged or
    twice-reduced gradient moves it by its factor. First-step norms differ only by summation
    order: rtol 1e-5. Later steps also follow the parameters' drift, rtol 5e-4: a near-cancelling
    batch amplifies the order of sums alone. On the gpt-tied model (seed 0, step 5) one process
    moves its grad norm by 1.5e-4 relative between micro_batch 4 and 2, and tp2 by 2.7e-4."""
    losses, state, history = got
    ref_losses, ref_state, ref_history = ref
    torch.testing.assert_close(torch.tensor(losses), torch.tensor(ref_losses), rtol=1e-5, atol=loss_atol)
    norms, ref_norms = grad_norms(history), grad_norms(ref_history)
    torch.testing.assert_close(norms[0], ref_norms[0], rtol=1e-5, atol=0, msg=lambda m: f"first grad_norm: {m}")
    torch.testing.assert_close(norms, ref_norms, rtol=5e-4, atol=0, msg=lambda m: f"grad_norm per step: {m}")
    assert state.keys() == ref_state.keys()
    for name in ref_state:
        torch.testing.assert_close(state[name], ref_state[name], rtol=1e-4, atol=atol, msg=name)
    assert ref_losses[-1] < ref_losses[0]  # the run learned something: the comparison is not vacuous


def assert_all_within(errors, bound: float):
    """Every error (a dict's values or a list) is a finite number <= bound. NaN-safe, unlike
    `max(errors) <= bound`: max([0.0, nan]) is 0.0, since every comparison with NaN is false."""
    items = errors.items() if isinstance(errors, dict) else enumerate(errors)
    bad = {key: e for key, e in items if not (math.isfinite(e) and e <= bound)}
    assert not bad, f"above {bound} or not finite: {bad}"


def _first_step_gradients(cfg):
    trainer = Trainer(cfg, torch.device("cpu"))
    micro = trainer.batches.microbatches(0, trainer.topo.coords["dp"], cfg.parallel.dp, cfg.train.micro_batch)
    trainer.forward_backward(micro, trainer.batches.loss_tokens(0))
    trainer.grads.reduce()
    grads = {}
    for name, p in trainer.model.named_parameters():
        grad = p.grad.detach()
        set_spec(grad, *spec_of(p))  # gathered over tp like its parameter
        grads[name] = gather_full(grad, trainer.topo)
    return grads


def first_step_gradients(cfg) -> dict[str, torch.Tensor]:
    """Logical name -> the reduced logical gradient the first optimizer step reads (fp32 ZeRO-0:
    `p.grad`), merged over pipeline stages and gathered over tp: what one process would compute."""
    assert cfg.parallel.zero == 0 and cfg.train.dtype == "fp32", "p.grad holds the whole gradient only in fp32 ZeRO-0"
    grads = {}
    for rank_grads in run_ranks(_first_step_gradients, cfg.parallel.world_size, cfg):
        grads.update(rank_grads)
    return grads


def model_state_after_reduce(cfg):
    """Bytes of model states held after one step's reduction (their peak), and the parameter count."""
    trainer = Trainer(cfg, torch.device("cpu"))
    trainer.train_step(0)  # creates the optimizer state
    micro = trainer.batches.microbatches(1, trainer.topo.coords["dp"], cfg.parallel.dp, cfg.train.micro_batch)
    trainer.forward_backward(micro, trainer.batches.loss_tokens(1))
    trainer.grads.reduce()
    held = trainer.grads.model_state_bytes(trainer.optimizer)
    with trainer.grads.gathered():  # a freed ZeRO-3 parameter reads as empty
        return held, sum(p.numel() for p in trainer.params)


@pytest.fixture(autouse=True, scope="session")
def _scratch_tmpdir():
    """Keep torch's and the launcher's temporary files in one scratch folder (docs/platform.md).
    multiprocessing's own folder (the launcher's fork server listens there) stays outside it: that
    module removes it at exit, after the scratch is gone."""
    multiprocessing.util.get_temp_dir()
    with tempfile.TemporaryDirectory(prefix="tetrad-tests-") as tmp:
        old = os.environ.get("TMPDIR")
        os.environ["TMPDIR"] = tmp
        tempfile.tempdir = None
        yield
        if old is None:
            os.environ.pop("TMPDIR", None)
        else:
            os.environ["TMPDIR"] = old
        tempfile.tempdir = None


def write_hf_qwen(folder: Path, family: str = "qwen2", **shape) -> None:
    """A Qwen2 or Qwen3 folder as transformers writes it (2 layers, d_model 64, GQA 4:2, no
    sliding window; Qwen3 with heads of 24, not d_model / n_heads; `shape` overrides the config's
    keys), its q, k and v biases (Qwen2) or qk-norm weights (Qwen3) given values: they start at
    zero and one, where a misplaced one would not show."""
    import transformers
    config, model = ((transformers.Qwen2Config, transformers.Qwen2ForCausalLM) if family == "qwen2"
                     else (transformers.Qwen3Config, transformers.Qwen3ForCausalLM))
    cfg = config(**{"vocab_size": 256, "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2,
                    "num_attention_heads": 4, "num_key_value_heads": 2, "use_sliding_window": False,
                    **({"head_dim": 24} if family == "qwen3" else {}), **shape})
    torch.manual_seed(0)
    hf = model(cfg)
    with torch.no_grad():
        for name, p in hf.named_parameters():
            if name.endswith("bias") or "_norm" in name:
                p.normal_(float("_norm" in name), 0.5)
    hf.save_pretrained(folder, safe_serialization=True)


# Gemma 3's shape at test size: heads of 24 (not d_model / n_heads), a softmax scale of its own, a
# sliding layer (window 5 of the 32 tokens, RoPE theta 100) and a global one (theta 10000, linear x 8)
GEMMA3_HF = {"vocab_size": 256, "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2,
             "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 24, "query_pre_attn_scalar": 20,
             "sliding_window": 5, "layer_types": ["sliding_attention", "full_attention"],
             "max_position_embeddings": 4096, "rope_theta": 10000.0, "rope_local_base_freq": 100.0,
             "rope_scaling": {"rope_type": "linear", "factor": 8.0}}


def write_hf_gemma(folder: Path, family: str = "gemma3_text", **shape) -> None:
    """A Gemma3ForCausalLM (GEMMA3_HF, `shape` overriding it) or GemmaForCausalLM folder as
    transformers writes it, fp32, every norm's weight given a value: they start at zero (HF's
    offsets from one), where a misplaced one would not show."""
    import transformers
    if family == "gemma3_text":
        hf = transformers.Gemma3ForCausalLM(transformers.Gemma3TextConfig(**{**GEMMA3_HF, **shape}))
    else:
        keys = {k: GEMMA3_HF[k] for k in ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers",
                                          "num_attention_heads", "num_key_value_heads", "head_dim")}
        hf = transformers.GemmaForCausalLM(transformers.GemmaConfig(**{**keys, **shape}))
    torch.manual_seed(0)
    hf.apply(hf._init_weights)
    with torch.no_grad():
        for name, p in hf.named_parameters():
            if "norm" in name:
                p.normal_(0.0, 0.5)
    hf.save_pretrained(folder, safe_serialization=True)


def as_a_shell_starts(ignored: tuple = ()):
    """A subprocess's preexec_fn: the stop signals as an interactive shell leaves them to a command
    it starts, at their defaults (a test run started in the background, `cmd &` without job
    control, would pass SIGINT on ignored, and a Ctrl-C test would find nothing to stop), those
    in `ignored` ignored (`nohup`'s SIGHUP)."""
    def reset() -> None:
        for sig in (signal.SIGINT, signal.SIGHUP, signal.SIGTERM):
            signal.signal(sig, signal.SIG_IGN if sig in ignored else signal.SIG_DFL)
    return reset
