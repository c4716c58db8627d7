"""`tetrad generate`: KV-cache decoding gives the full forward's logits, with RoPE tables that
follow the positions given, and so does a cache kept from one chat turn to the next; a sample's
loss by the training forward is the one its decoding logits give, after a long prompt too; a checkpoint trained on `tetrad data` shards decodes with their tokenizer; a run
folder names its checkpoints through its config.toml; a missing checkpoint is refused in one line."""

from dataclasses import asdict, replace

import numpy as np
import pytest
import torch

from conftest import tiny_config
from tetrad.cli import main
from tetrad.data.tokenizer import byte_tokenizer, run_tokenizer
from tetrad.model.llama import Transformer
from tetrad.model.sharding import init_parameters
from tetrad.dist.topology import Topology
from tetrad.train.convert import checkpoint_folder
from tetrad.train.generate import Cache, continuation_loss, generate
from tetrad.train.inference import inference_model
from tetrad.model.sampling import GREEDY, Sampling


def random_model(**model):
    cfg = tiny_config(model=model).model
    net = Transformer(cfg, Topology.single())
    init_parameters(net, seed=1)
    return net.eval()


@pytest.mark.parametrize("model", [{}, {"preset": "tiny-gpt", "n_layers": 2, "d_model": 64, "n_heads": 4,
                                        "n_kv_heads": 4, "ffn_hidden": 128, "seq_len": 32},
                                   {"sliding_window": 5},  # the cache keeps two windows: moves its keys as it fills
                                   {"norm": "gemma_rmsnorm", "mlp": "geglu", "scale_embeddings": True,  # Gemma 3
                                    "sandwich_norm": True, "qk_norm": True, "query_pre_attn_scalar": 20.0,
                                    "sliding_window": 5, "layer_types": ["sliding_attention", "full_attention"],
                                    "rope_local_base_freq": 100.0, "rope_scaling": {"rope_type": "linear", "factor": 8.0}}])
def test_kv_cache_decoding_gives_the_full_forward_logits(model):
    net = random_model(**model)
    tokens = torch.randint(0, 256, (2, 20), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        full = net(tokens, torch.arange(20))
        cache = {}
        steps = [net(tokens[:, :7], torch.arange(7), cache=cache)]  # the prompt at once, then one at a time
        steps += [net(tokens[:, i:i + 1], torch.tensor([i]), cache=cache) for i in range(7, 20)]
    torch.testing.assert_close(torch.cat(steps, dim=1), full, atol=1e-5, rtol=1e-5)
    assert full.abs().max() > 1e-2


def test_rope_tables_follow_the_positions_tensor():
    """The model keeps the RoPE tables of the positions tensor it was last given: a new tensor, or
    the same one changed in place, gets its own; inference mode (no version counter) works too."""
    net = random_model()
    tokens = torch.randint(0, 256, (1, 8), generator=torch.Generator().manual_seed(0))
    positions = torch.arange(8)
    with torch.no_grad():
        first = net(tokens, positions)
        assert torch.equal(net(tokens, positions), first)
        positions[4:] += 3  # a gap: relative positions change, and the logits with them
        gapped = net(tokens, positions)
        assert torch.equal(gapped, net(tokens, torch.tensor([0, 1, 2, 3, 7, 8, 9, 10])))
        assert not torch.allclose(gapped, first)
    with torch.inference_mode():
        assert torch.equal(net(tokens, torch.arange(8)), first)


def test_a_samples_loss_by_the_training_forward_is_its_decoding_loss():
    net = random_model()
    prompt = list(b"The licence ")
    new, logits = generate(net, prompt, max_new=12, sampling=Sampling(temperature=1.0), seed=3, keep_logits=True)
    assert len(new) == 12
    decoding = torch.stack([-torch.log_softmax(lg, -1)[t] for lg, t in zip(logits, new)]).mean()
    assert continuation_loss(net, prompt, new) == pytest.approx(float(decoding), rel=1e-5)
    # Greedy decoding is deterministic and picks each step's likeliest token.
    greedy, greedy_logits = generate(net, prompt, max_new=5, sampling=GREEDY, keep_logits=True)
    assert greedy == [int(lg.argmax()) for lg in greedy_logits]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_short_continuations_loss_after_a_long_prompt_is_its_own(dtype):
    """One token after 500: its loss is its cross-entropy under the whole sequence's logits (the
    number training counts for it), in bf16 too. Before, the whole sequence's summed loss less the
    prompt's own (two forwards) lost it in the prompt's rounding: 5e-3 off in bf16, 4e-5 in fp32."""
    net = random_model(seq_len=512)
    state = {name: p.detach() for name, p in net.named_parameters()}
    model = inference_model(net.cfg, state.__getitem__, Topology.single(), dtype)
    ids = torch.randint(0, 256, (500,), generator=torch.Generator().manual_seed(0)).tolist()
    with torch.no_grad():
        logits = model(torch.tensor([ids]), torch.arange(len(ids)))[0].float()
    for new in (1, 3):
        expected = torch.nn.functional.cross_entropy(logits[-new - 1:-1], torch.tensor(ids[-new:]))
        assert continuation_loss(model, ids[:-new], ids[-new:]) == pytest.approx(float(expected), rel=1e-6, abs=0)


def test_generation_stops_at_seq_len():
    net = random_model()  # seq_len 32
    new, _ = generate(net, list(range(30)), max_new=50, sampling=Sampling(temperature=1.0))
    assert len(new) == 3  # tokens at positions 30, 31 and 32 (read from 32 tokens)


def test_a_kept_cache_runs_only_what_a_prompt_adds_and_gives_a_fresh_decodings_logits():
    """A chat's next turn starts with the last one's prompt and answer: a kept Cache runs only the
    rest. A prompt that departs from its ids earlier (an answer that tokenizes otherwise once
    rendered) keeps the common start, none at all, or (the same ids again) all but the last
    token, whose logits are wanted. Every time the tokens and logits are those of a fresh cache."""
    net = random_model()  # seq_len 32
    cache, first = Cache(), list(range(10, 20))
    new, _ = generate(net, first, max_new=4, sampling=GREEDY, cache=cache)
    assert cache.ids == first + new[:-1]  # the last token drawn is never run

    def turn(prompt, kept):
        reused = cache.reused
        ours, ours_logits = generate(net, prompt, max_new=4, sampling=GREEDY, cache=cache, keep_logits=True)
        assert cache.reused - reused == kept
        fresh, fresh_logits = generate(net, prompt, max_new=4, sampling=GREEDY, keep_logits=True)
        assert ours == fresh and cache.ids == prompt + ours[:-1]
        torch.testing.assert_close(torch.stack(ours_logits), torch.stack(fresh_logits), atol=1e-5, rtol=1e-5)
    turn(first + new + [5, 6], len(first) + len(new) - 1)
    turn(first[:6] + [7, 8, 9], 6)
    turn([1, 2], 0)
    turn(list(cache.ids), len(cache.ids) - 1)
    assert cache.prompted == 10 + 16 + 9 + 2 + 5  # the last prompt: [1, 2] and 3 of its 4 new tokens


def test_missing_checkpoint_is_refused_in_one_line(tmp_path, capsys):
    assert main(["generate", str(tmp_path / "none"), "--prompt", "hi"]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("tetrad generate: no checkpoint at") and "\n" not in err


def test_the_runs_tokenizer_is_found_or_refused(tmp_path):
    assert run_tokenizer(tmp_path, "licenses")[1] is None  # bytes
    assert run_tokenizer(tmp_path, "licenses")[0].encode("é").ids == list("é".encode())
    np.save(tmp_path / "ids.npy", np.arange(300, dtype=np.uint16))
    for source, why in ((tmp_path / "moved", "is not found from here"), (tmp_path / "ids.npy", "no tokenizer.json")):
        with pytest.raises(ValueError, match=why):
            run_tokenizer(tmp_path, str(source))
    byte_tokenizer().save(str(tmp_path / "tokenizer.json"))  # one beside the checkpoint wins
    assert run_tokenizer(tmp_path, str(tmp_path / "ids.npy"))[1] == tmp_path / "tokenizer.json"


def test_a_run_folder_names_its_checkpoints_where_checkpoint_dir_put_them(tmp_path, capsys):
    """`generate RUN_DIR` (and `convert RUN_DIR`) as `report RUN_DIR` reads it: through its
    config.toml, which may put the checkpoints elsewhere or say that none were saved."""
    run, root = tmp_path / "run", tmp_path / "elsewhere"
    run.mkdir()
    (run / "config.toml").write_text(tiny_config(checkpoint={"dir": str(root)}, run={"dir": str(run)}).to_toml())
    assert main(["generate", str(run), "--prompt", "hi"]) == 2
    err = capsys.readouterr().err
    assert "is a run folder without checkpoints (its checkpoint.every = 0; 0 saves none); train with " \
           "--checkpoint.every=N" in err, err
    (root / "step_00000002").mkdir(parents=True)
    (root / "step_00000002" / "tetrad.json").write_text("{}")  # published (checkpoint_folder does not verify)
    assert checkpoint_folder(run) == root / "step_00000002"


def test_a_prompt_starts_with_the_tokenizers_own_prefix():
    """Generation from a model whose tokenizer starts texts with <|begin_of_text|> (Llama 3)
    feeds it first, as HF's generate does; tetrad's own BPE gets none."""
    from test_data import _with_begin_of_text
    from tetrad.data.tokenizer import train_bpe
    from tetrad.train.generate import complete
    net = random_model(vocab_size=512)
    plain = train_bpe(iter(["the licence text and more of the licence text"]), 300)
    _, ids, _ = complete(net, plain, "the licence", max_new=2)
    assert ids == plain.encode("the licence", add_special_tokens=False).ids
    tokenizer, bos = _with_begin_of_text(train_bpe(iter(["the licence text and more of the licence text"]), 300))
    text, ids, _ = complete(net, tokenizer, "the licence", max_new=2)
    assert ids == [bos] + plain.encode("the licence", add_special_tokens=False).ids
    assert text.startswith("the licence")
    assert complete(net, tokenizer, "", max_new=1)[1] == [bos]  # an empty prompt: the prefix alone


def test_the_eos_the_data_recorded_stops_generation_and_is_the_exports(tmp_path, monkeypatch):
    """A Llama-3-like tokenizer with <|endoftext|>, <|end_of_text|> and <|eot_id|>, its data made
    with --eos <|eot_id|>: generate stops there, and the export's config.json and
    tokenizer_config.json name it, not the first of KNOWN_EOS the tokenizer has (as before)."""
    import json
    from tetrad.data.tokenizer import eos_id, train_bpe
    from tetrad.train.generate import stop_tokens, load_generator
    tokenizer = train_bpe(iter(["the licence grants the right to copy the text"] * 4), 300)
    tokenizer.add_special_tokens(["<|end_of_text|>", "<|eot_id|>"])
    tokenizer.save(str(tmp_path / "tokenizer.json"))
    eot = tokenizer.token_to_id("<|eot_id|>")
    assert eos_id(tokenizer) != eot
    (tmp_path / "text.txt").write_text("the licence grants the right to copy the text, and to share it.\n\n" * 60)
    data, run, hf = tmp_path / "data", tmp_path / "run", tmp_path / "hf"
    assert main(["data", str(tmp_path / "text.txt"), "--out", str(data), "--tokenizer", str(tmp_path / "tokenizer.json"),
                 "--eos", "<|eot_id|>"]) == 0
    assert main(["train", f"--data.source={data}", "--train.steps=1", "--model.seq_len=32", "--train.global_batch=2",
                 "--train.micro_batch=1", "--checkpoint.every=1", f"--run.dir={run}"]) == 0
    _, run_tokenizer, source = load_generator(run)
    assert stop_tokens(run_tokenizer, None, source) == {eot}
    import tetrad.train.generate as module
    seen, decode = [], module.generate
    monkeypatch.setattr(module, "generate", lambda *args: seen.append(args[5]) or decode(*args))
    assert main(["generate", str(run), "--prompt", "the", "--max-new-tokens", "2"]) == 0
    assert seen == [{eot}]  # what `tetrad generate` stops on
    assert main(["convert", str(run), "--to-hf", str(hf)]) == 0
    assert json.loads((hf / "config.json").read_text())["eos_token_id"] == eot
    assert json.loads((hf / "tokenizer_config.json").read_text())["eos_token"] == "<|eot_id|>"


@pytest.mark.parametrize("eos", ["one", "list", "none", "config-only"])
def test_an_imported_models_eos_ends_generation_and_goes_back_out(tmp_path, eos):
    """A Hugging Face folder (weights written by transformers) whose config names <|eot_id|> as
    its EOS ("one"; "config-only": and its generation_config.json names none), or whose
    generation_config.json names <|end_of_text|> and <|eot_id|> as Llama 3.1 Instruct's does
    ("list"): generate stops at them, on the folder as it stands (before: config-only's stopped at
    the first of KNOWN_EOS the tokenizer has) and after --to-tetrad, and --to-hf and a second round
    trip write them back. "none": the search, as before."""
    import json
    transformers = pytest.importorskip("transformers")
    from tetrad.data.tokenizer import eos_id, train_bpe
    from tetrad.train.generate import stop_tokens, load_generator
    tokenizer = train_bpe(iter(["the licence grants the right to copy the text"] * 4), 300)
    tokenizer.add_special_tokens(["<|end_of_text|>", "<|eot_id|>"])
    end, eot = tokenizer.token_to_id("<|end_of_text|>"), tokenizer.token_to_id("<|eot_id|>")
    assert eos_id(tokenizer) not in (end, eot)
    hf = tmp_path / "hf"
    config = transformers.LlamaConfig(vocab_size=320, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                                      num_attention_heads=2, num_key_value_heads=2, max_position_embeddings=32,
                                      tie_word_embeddings=False,
                                      eos_token_id=eot if eos in ("one", "config-only") else None)
    transformers.LlamaForCausalLM(config).save_pretrained(hf, safe_serialization=True)
    if eos in ("list", "config-only"):
        (hf / "generation_config.json").write_text(json.dumps({"eos_token_id": [end, eot]} if eos == "list" else
                                                              {"do_sample": False}))
    tokenizer.save(str(hf / "tokenizer.json"))
    expected = {"one": {eot}, "list": {end, eot}, "none": {eos_id(tokenizer)}, "config-only": {eot}}[eos]
    written = {"one": eot, "list": [end, eot], "none": eos_id(tokenizer), "config-only": eot}[eos]
    _, hf_tokenizer, source = load_generator(hf)  # `tetrad generate HF_DIR`
    assert stop_tokens(hf_tokenizer, None, source) == expected
    for round_trip in range(2):
        ckpt, back = tmp_path / f"ckpt{round_trip}", tmp_path / f"back{round_trip}"
        assert main(["convert", str(hf), "--to-tetrad", str(ckpt)]) == 0
        _, run_tokenizer, source = load_generator(ckpt)
        assert stop_tokens(run_tokenizer, None, source) == expected
        assert main(["convert", str(ckpt), "--to-hf", str(back)]) == 0
        assert json.loads((back / "config.json").read_text())["eos_token_id"] == written
        hf = back


@pytest.mark.parametrize("written, expected", [
    ({"do_sample": True, "temperature": 0.6, "top_p": 0.9}, Sampling(0.6, 50, 0.9)),  # Llama 3.1's; HF's top_k 50
    ({"do_sample": True, "temperature": 0.7, "top_k": 20, "top_p": 0.8, "repetition_penalty": 1.05},
     Sampling(0.7, 20, 0.8, repetition_penalty=1.05)),  # Qwen2.5 Instruct's
    ({"do_sample": True, "temperature": 0.6, "top_k": 20, "top_p": 0.95, "min_p": 0.1, "repetition_penalty": None},
     Sampling(0.6, 20, 0.95, min_p=0.1)),
    ({"do_sample": False, "temperature": 0.6, "repetition_penalty": 1.2},
     Sampling(0.0, repetition_penalty=1.2)),  # transformers decodes greedily, and penalises there too
    ({"temperature": 0.6}, Sampling(0.0)),  # do_sample absent: false, as transformers reads it
    (None, Sampling())])  # no generation_config.json: tetrad's defaults
def test_an_imported_models_sampling_is_generates_default(tmp_path, written, expected):
    """After --to-tetrad, `tetrad generate` samples as transformers' generate would with the
    model's generation_config.json where no flag says otherwise; a flag wins; --to-hf writes the
    file back (before: tetrad's 0.8 / all / 1 whatever the model asked, and the file was lost)."""
    import json
    transformers = pytest.importorskip("transformers")
    from tetrad.data.tokenizer import train_bpe
    from tetrad.data.tokenizer import model_sampling
    from tetrad.sample import _arguments
    from tetrad.train.generate import load_generator, sampling_settings
    hf = tmp_path / "hf"
    config = transformers.LlamaConfig(vocab_size=300, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                                      num_attention_heads=2, num_key_value_heads=2, max_position_embeddings=32)
    transformers.LlamaForCausalLM(config).save_pretrained(hf, safe_serialization=True)
    (hf / "generation_config.json").unlink(missing_ok=True)
    if written is not None:
        (hf / "generation_config.json").write_text(json.dumps(written))
    train_bpe(iter(["the licence grants the right to copy the text"] * 4), 300).save(str(hf / "tokenizer.json"))
    ckpt, back = tmp_path / "ckpt", tmp_path / "back"
    assert main(["convert", str(hf), "--to-tetrad", str(ckpt)]) == 0
    _, _, source = load_generator(ckpt)
    asked = model_sampling(source)
    assert sampling_settings(_arguments([str(ckpt)]), asked) == expected
    flags = ["--temperature", "0.3", "--repetition-penalty", "1.1"]
    assert sampling_settings(_arguments([str(ckpt), *flags]), asked) == replace(expected, temperature=0.3,
                                                                                 repetition_penalty=1.1)
    assert main(["convert", str(ckpt), "--to-hf", str(back)]) == 0
    if written is not None:
        loaded = transformers.GenerationConfig.from_pretrained(back)
        assert (loaded.do_sample, loaded.temperature) == (written.get("do_sample", False), written["temperature"])
        assert loaded.repetition_penalty == written.get("repetition_penalty")


def test_sampling_processes_the_logits_as_transformers_generate_does(tmp_path):
    """Each token of an imported model is drawn from what transformers' generate draws it from
    with the same settings (its output_scores: the logits after its processors), step by step
    along the text it generated: the repetition penalty over the prompt and the text so far
    first, then temperature, top-k, top-p and min-p in that order (another order, or a penalty
    that skips the prompt, keeps other tokens)."""
    transformers = pytest.importorskip("transformers")
    from tetrad.train.convert import read_weights
    from tetrad.train.generate import single_process_model
    config = transformers.LlamaConfig(vocab_size=300, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                                      num_attention_heads=2, num_key_value_heads=2, max_position_embeddings=64)
    torch.manual_seed(0)
    hf_model = transformers.LlamaForCausalLM(config).eval()
    with torch.no_grad():
        hf_model.lm_head.weight.mul_(10)  # logits a few units apart, where every filter keeps some and drops some
    hf_model.save_pretrained(tmp_path / "hf", safe_serialization=True)
    assert main(["convert", str(tmp_path / "hf"), "--to-tetrad", str(tmp_path / "ckpt")]) == 0
    cfg, state = read_weights(tmp_path / "ckpt")
    model = single_process_model(cfg.model, state)
    settings = Sampling(temperature=0.7, top_k=40, top_p=0.8, min_p=0.05, repetition_penalty=1.5)
    prompt = torch.tensor([[7, 21, 7, 150, 33, 21, 260, 7]])
    torch.manual_seed(1)
    out = hf_model.generate(prompt, do_sample=True, max_new_tokens=12, output_scores=True,
                            return_dict_in_generate=True, eos_token_id=None, pad_token_id=0, **asdict(settings))
    assert len(out.scores) == 12
    kept = []
    for step, theirs in enumerate(out.scores):
        seen = out.sequences[0, :prompt.shape[1] + step]
        with torch.no_grad():
            logits = model(seen[None], torch.arange(len(seen)))[0, -1]
        ours = settings.processed(logits, seen.tolist())
        assert torch.equal(ours.isinf(), theirs[0].isinf()), step
        torch.testing.assert_close(ours[ours.isfinite()], theirs[0][ours.isfinite()], atol=1e-4, rtol=1e-4)
        kept.append(int(ours.isfinite().sum()))
    assert 1 < min(kept) and max(kept) < 40, kept  # the filters cut in and leave a choice


def test_a_run_fine_tuned_on_a_models_tokenizer_keeps_its_eos_and_sampling(tmp_path):
    """The fine-tuning loop: `tetrad data --tokenizer HF_DIR` keeps the model's generation_config.json
    (its EOS ids and sampling, and config.json's pad_token_id) beside the tokenizer it copies, so a
    run trained on that data from the model's weights generates as the model asks, stops at all
    its EOS ids, and exports the file again (before: only convert --to-tetrad kept it, and a
    fine-tuned run lost it), its pad_token_id in config.json too (before: dropped)."""
    import json
    transformers = pytest.importorskip("transformers")
    from tetrad.data.tokenizer import model_sampling, train_bpe
    from tetrad.train.generate import stop_tokens, load_generator
    text = "the licence grants the right to copy the text\n"
    tokenizer = train_bpe(iter([text] * 4), 300)
    tokenizer.add_special_tokens(["<|end_of_text|>", "<|eot_id|>"])
    end, eot = tokenizer.token_to_id("<|end_of_text|>"), tokenizer.token_to_id("<|eot_id|>")
    hf = tmp_path / "hf"
    config = transformers.LlamaConfig(vocab_size=320, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                                      num_attention_heads=2, num_key_value_heads=2, max_position_embeddings=32,
                                      pad_token_id=end)
    transformers.LlamaForCausalLM(config).save_pretrained(hf, safe_serialization=True)
    asked = {"do_sample": True, "temperature": 0.6, "top_p": 0.9, "repetition_penalty": 1.1, "eos_token_id": [end, eot]}
    (hf / "generation_config.json").write_text(json.dumps(asked))
    tokenizer.save(str(hf / "tokenizer.json"))
    (tmp_path / "text.txt").write_text(text * 200)
    shards, run, back = tmp_path / "shards", tmp_path / "run", tmp_path / "back"
    assert main(["data", str(tmp_path / "text.txt"), "--tokenizer", str(hf), "--out", str(shards), "--workers", "1",
                 "--eos", "<|end_of_text|>"]) == 0
    assert main(["train", f"--data.source={shards}", f"--checkpoint.init_from={hf}", "--train.steps=1",
                 "--train.global_batch=2", "--train.micro_batch=1", "--checkpoint.every=1", f"--run.dir={run}"]) == 0
    _, run_tokenizer, source = load_generator(run)
    assert model_sampling(source) == {"temperature": 0.6, "top_k": 50, "top_p": 0.9, "min_p": 0.0,
                                      "repetition_penalty": 1.1}
    assert stop_tokens(run_tokenizer, None, source) == {end, eot}
    assert main(["convert", str(run), "--to-hf", str(back)]) == 0
    loaded = transformers.GenerationConfig.from_pretrained(back)
    assert (loaded.eos_token_id, loaded.temperature, loaded.repetition_penalty) == ([end, eot], 0.6, 1.1)
    assert loaded.pad_token_id == end == transformers.AutoConfig.from_pretrained(back).pad_token_id


def test_a_hugging_face_folder_generates_as_transformers_without_converting(tmp_path, capsys):
    """`tetrad generate HF_DIR`: the base model a fine-tune starts from, sampled as it stands: its
    weights read as init_from reads them, its tokenizer.json, its generation_config.json; greedy
    decoding gives transformers' greedy tokens (before: 'no checkpoint' until converted)."""
    import json
    transformers = pytest.importorskip("transformers")
    from tetrad.data.tokenizer import train_bpe
    from tetrad.train.generate import complete, load_generator
    hf = tmp_path / "hf"
    config = transformers.LlamaConfig(vocab_size=300, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=32)
    torch.manual_seed(0)
    hf_model = transformers.LlamaForCausalLM(config).eval()
    with torch.no_grad():
        hf_model.lm_head.weight.mul_(20)  # greedy picks far apart: no near-tie that rounding could flip
    hf_model.save_pretrained(hf, safe_serialization=True)
    (hf / "generation_config.json").write_text(json.dumps({"do_sample": False}))
    train_bpe(iter(["the licence grants the right to copy the text"] * 4), 300).save(str(hf / "tokenizer.json"))
    model, tokenizer, source = load_generator(hf)
    assert source == hf / "tokenizer.json"
    _, prompt, new = complete(model, tokenizer, "the licence", 8, GREEDY, source=source)
    with torch.no_grad():
        theirs = hf_model.generate(torch.tensor([prompt]), do_sample=False, max_new_tokens=8, eos_token_id=None,
                                   pad_token_id=0)[0, len(prompt):].tolist()
    assert new == theirs
    capsys.readouterr()
    assert main(["generate", str(hf), "--prompt", "the licence", "--max-new-tokens", "8"]) == 0
    out = capsys.readouterr()
    assert out.out.strip() == "the licence" + tokenizer.decode(theirs, skip_special_tokens=False)  # greedy: do_sample false
    config_json = hf / "config.json"
    config_json.write_text(json.dumps({**json.loads(config_json.read_text()), "num_key_value_heads": 4}))
    assert main(["generate", str(hf), "--prompt", "the"]) == 2  # one line naming the tensor, no traceback
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "model.layers.0.self_attn.k_proj.weight: (16, 32) in the file" in err, err
