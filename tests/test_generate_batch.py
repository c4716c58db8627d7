"""`tetrad generate --prompts FILE`: a batch of left-padded prompts, one forward a step against one
KV cache, gives each prompt the tokens it gets decoded alone (`generate`), greedy and seeded (each
row its own generator seeded with --seed), prompts of different lengths, a row that stops at its
EOS while the others run on, one the context ends, learned positions, sliding windows (Gemma 3's
sliding and global layers too) and tp 2; the command writes one JSON object a prompt in input
order, plain or JSONL input, --chat too; its user errors are one line."""

from __future__ import annotations

import io
import json

import pytest
import torch
import torch.distributed as dist

from conftest import run_ranks
from test_generate import random_model
from test_generate_placement import _write_hf
from tetrad.cli import main
from tetrad.dist.layout import Layout
from tetrad.dist.topology import Topology
from tetrad.model.sampling import GREEDY, Sampling
from tetrad.train.batched import generate_batch, read_prompts
from tetrad.train.generate import found_weights, generate, prompt_ids
from tetrad.train.inference import inference_model

MODELS = {"llama": {}, "gpt": {"preset": "tiny-gpt", "n_layers": 2, "d_model": 64, "n_heads": 4, "n_kv_heads": 4,
                               "ffn_hidden": 128, "seq_len": 32, "tie_embeddings": False},  # learned positions
          "window": {"sliding_window": 5, "n_kv_heads": 2},
          "gemma3": {"norm": "gemma_rmsnorm", "mlp": "geglu", "scale_embeddings": True, "sandwich_norm": True,
                     "qk_norm": True, "head_dim": 24, "query_pre_attn_scalar": 20.0, "sliding_window": 5,
                     "layer_types": ["sliding_attention", "full_attention"], "rope_local_base_freq": 100.0,
                     "rope_scaling": {"rope_type": "linear", "factor": 8.0}, "tie_embeddings": False}}
SAMPLINGS = {"greedy": GREEDY, "seeded": Sampling(temperature=1.0, top_p=0.95)}
# Lengths 1 to 27 of a 32-token context: the 27-token prompt's context ends it after 6 tokens.
PROMPTS = [list(range(40, 49)), [7], list(range(100, 127)), list(range(60, 64)), list(range(200, 214))]


def _stop_reason(new: list[int], max_new: int, stop: frozenset[int]) -> str:
    return "eos" if new[-1] in stop else "length" if len(new) == max_new else "context"


def _alone(model, prompts, max_new, sampling, stop) -> list[tuple[list[int], str]]:
    """Each prompt decoded by itself, today's path, with the same seed."""
    out = []
    for prompt in prompts:
        new, _ = generate(model, prompt, max_new, sampling, seed=3, stop=stop)
        out.append((new, _stop_reason(new, max_new, stop)))
    return out


def _sharp(model: dict):
    """A random model whose head is scaled: far from uniform, each prompt draws its own tokens
    (a uniform one draws the same under the same seed) and greedy picks lie far apart."""
    net = random_model(**model)
    with torch.no_grad():
        (net.embed.weight if net.head is None else net.head.weight).mul_(20)
    return net


def _early_stop(model, sampling) -> frozenset[int]:
    """A token the first prompt draws alone for the first time third or later, as an EOS: that row
    stops early, the rest run on."""
    new, _ = generate(model, PROMPTS[0], 12, sampling, seed=3)
    return frozenset({next(t for k, t in enumerate(new) if k >= 2 and t not in new[:k])})


@pytest.mark.parametrize("name", SAMPLINGS)
@pytest.mark.parametrize("model", MODELS.values(), ids=MODELS.keys())
def test_each_row_of_a_batch_decodes_as_its_prompt_alone(model, name):
    net, sampling = _sharp(model), SAMPLINGS[name]
    stop = _early_stop(net, sampling)
    alone = _alone(net, PROMPTS, 12, sampling, stop)
    reasons = [why for _, why in alone]  # every way a row ends, in one batch (a seeded gemma3 row: an EOS first)
    assert set(reasons) == {"eos", "length", "context"} or (model == MODELS["gemma3"] and name == "seeded"), alone
    assert reasons[0] == "eos" and len(alone[0][0]) >= 3 and "length" in reasons
    assert len({tuple(new[:3]) for new, _ in alone}) == len(PROMPTS), alone  # each row its own tokens
    assert generate_batch(net, PROMPTS, 12, sampling, seed=3, stop=stop) == alone
    # and in batches of another make-up: one row, and the rows in another order
    assert generate_batch(net, [PROMPTS[2]], 12, sampling, seed=3, stop=stop) == [alone[2]]
    assert generate_batch(net, PROMPTS[::-1], 12, sampling, seed=3, stop=stop) == alone[::-1]


def test_longrope_picks_each_rows_factors_by_its_own_positions():
    """LongRoPE's long factors start past original_max_position_embeddings (12 here): a short
    prompt left-padded beside one past it keeps its short factors, its logits those it gets alone."""
    scaling = {"rope_type": "longrope", "short_factor": [1.0] * 8, "long_factor": [4.0 + 2 * i for i in range(8)],
               "original_max_position_embeddings": 12, "attention_factor": 1.0}
    net, short = random_model(rope_scaling=scaling), [40, 41, 42]
    with torch.no_grad():
        alone = net(torch.tensor([short]), torch.arange(3), cache={}, tail=1)[0, -1]
        positions = (torch.arange(20) - torch.tensor([[17], [0]])).clamp(min=0)
        batch = net(torch.tensor([[0] * 17 + short, list(range(100, 120))]), positions, cache={}, tail=1)[:, -1]
    torch.testing.assert_close(batch[0], alone, atol=1e-5, rtol=1e-5)
    assert generate_batch(_sharp({"rope_scaling": scaling}), [short, list(range(100, 120))], 6, GREEDY, seed=3) == \
        _alone(_sharp({"rope_scaling": scaling}), [short, list(range(100, 120))], 6, GREEDY, frozenset())


def _batch_on_this_rank(cfg, state: dict, sampling: Sampling, stop: frozenset[int]) -> list:
    tp = dist.get_world_size() if dist.is_initialized() else 1
    model = inference_model(cfg, state.__getitem__, Topology(Layout(tp=tp), torch.device("cpu")))
    return generate_batch(model, PROMPTS, 10, sampling, seed=3, stop=stop)


def test_tp2_decodes_a_batch_as_each_prompt_alone_in_one_process():
    """Each of two ranks holds half the heads (and of each row's KV cache) and of the vocabulary;
    both give every row the one-process tokens, seeded, the early EOS and the context's end too."""
    net, sampling = _sharp(MODELS["window"]), SAMPLINGS["seeded"]
    stop = _early_stop(net, sampling)
    alone = _alone(net, PROMPTS, 10, sampling, stop)
    state = {name: p.detach().clone() for name, p in net.named_parameters()}
    assert run_ranks(_batch_on_this_rank, 2, net.cfg, state, sampling, stop) == [alone, alone]


@pytest.fixture(scope="module")
def hf(tmp_path_factory):
    """A tiny Llama folder with a BPE tokenizer and a chat template (test_generate_placement's)."""
    folder = tmp_path_factory.mktemp("batch") / "hf"
    _write_hf(folder)
    return folder


LINES = ["the licence", "Permission", "to deal in the Software without restriction, including", "a"]
LONG = "the licence " * 300
FLAGS = ["--max-new-tokens", "8", "--temperature", "1", "--seed", "5"]


def _alone_out(hf, capsys, flags: list[str]) -> str:
    assert main(["generate", str(hf), *flags, *FLAGS]) == 0
    return capsys.readouterr().out


def test_the_command_writes_each_prompts_own_text_in_input_order(hf, tmp_path, capsys):
    """Plain lines (a blank one skipped) in batches of 3: each object's prompt and completion are
    `--prompt`'s text with the same seed; the output is in input order, one object a line; and
    the same under --tp 2."""
    prompts, out = tmp_path / "prompts.txt", tmp_path / "out.jsonl"
    prompts.write_text(LINES[0] + "\n\n" + "\n".join(LINES[1:]) + "\n")
    assert main(["generate", str(hf), "--prompts", str(prompts), "--output", str(out), "--batch-size", "3",
                 *FLAGS]) == 0
    err = capsys.readouterr().err
    assert "tetrad generate: 3 of 4 prompts\n" in err and "tetrad generate: 4 prompts, " in err, err
    rows = [json.loads(line) for line in out.read_text().splitlines()]
    assert [row["prompt"] for row in rows] == LINES and [row["line"] for row in rows] == [1, 3, 4, 5]
    for row in rows:
        assert row["prompt"] + row["completion"] + "\n" == _alone_out(hf, capsys, ["--prompt", row["prompt"]])
        assert row["stop"] in ("eos", "length") and 0 < row["new_tokens"] <= 8
    two = tmp_path / "two.jsonl"  # on two forked ranks, each holding half the model and the cache
    assert main(["generate", str(hf), "--prompts", str(prompts), "--output", str(two), "--batch-size", "3",
                 "--tp", "2", *FLAGS]) == 0
    assert two.read_text() == out.read_text() and "(cpu, fp32, tp 2)" in capsys.readouterr().err


def test_jsonl_on_stdin_keeps_each_objects_fields_and_chat_answers_each_message(hf, monkeypatch, capsys):
    """JSONL on stdin (`--prompts -`), each object's own fields kept; with --chat each prompt is
    the user's one message, answered as `--chat --prompt` answers it."""
    records = [{"id": i, "prompt": line} for i, line in enumerate(LINES[:3])]
    for chat in ([], ["--chat", "--system", "You answer briefly."]):
        monkeypatch.setattr("sys.stdin", io.StringIO("".join(json.dumps(r) + "\n" for r in records)))
        assert main(["generate", str(hf), "--prompts", "-", *chat, *FLAGS]) == 0
        rows = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
        assert [(row["id"], row["prompt"]) for row in rows] == [(r["id"], r["prompt"]) for r in records]
        for row in rows:
            text = _alone_out(hf, capsys, [*chat, "--prompt", row["prompt"]])
            assert text == (row["completion"] if chat else row["prompt"] + row["completion"]) + "\n"


def test_a_byte_order_mark_is_no_part_of_the_first_prompt(tmp_path):
    """A file that starts with a UTF-8 byte order mark reads as the same file without it: JSONL
    stays JSONL (not each line a prompt of JSON text), a plain first line has no mark."""
    for text, prompts in (('{"prompt": "hi"}\n{"prompt": "yo"}\n', [{"prompt": "hi"}, {"prompt": "yo"}]),
                          ("hi\nyo\n", [{"prompt": "hi"}, {"prompt": "yo"}])):
        (tmp_path / "p.txt").write_text("\ufeff" + text, encoding="utf-8")
        assert read_prompts(str(tmp_path / "p.txt")) == [(1, prompts[0]), (2, prompts[1])]


@pytest.mark.parametrize("text, flags, line", [
    ("hi\n", ["--prompt", "hi"], "--prompts reads the prompts from its file; drop --prompt (or add it to the file)"),
    ("hi\n", ["--batch-size", "0"], "--batch-size 0: need --batch-size >= 1"),
    ("\n  \n", [], "--prompts {file} holds no prompt; write one prompt a line, or a JSON object with a \"prompt\" a "
                   "line"),
    ("hi\n" + LONG + "\n", [], "--prompts {file} line 2: the prompt is {tokens} tokens; the model reads at most 256 "
                               "tokens, so use a shorter one; shorten it or leave it out"),
    ('{"prompt": "hi"}\n{"text": "x"}\n', [], "--prompts {file} line 2: the first line is a JSON object, so every "
                                              "line must be one with a string \"prompt\"; fix the line, or make the "
                                              "file plain text"),
    ("hi\n", ["--output", "/no/such/folder/out.jsonl"], "--output /no/such/folder/out.jsonl: pass it with --prompts, "
                                                        "a file in a folder that exists"),
    ("hi\n", ["--output", "/tmp"], "--output /tmp: pass it with --prompts, a file in a folder that exists"),
], ids=["with --prompt", "batch size 0", "empty", "too long", "jsonl without prompt", "output folder missing",
        "output a folder"])
def test_a_bad_prompts_file_or_flag_is_one_line(hf, tmp_path, capsys, text, flags, line):
    file = tmp_path / "prompts.txt"
    file.write_text(text)
    assert main(["generate", str(hf), "--prompts", str(file), *flags]) == 2
    tokens = len(prompt_ids(found_weights(hf).tokenizer, LONG, 10 ** 6))
    assert tokens > 256
    assert capsys.readouterr() == ("", f"tetrad generate: {line.format(file=file, tokens=tokens)}\n")
