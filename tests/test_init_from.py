"""Weights in and out: an HF Llama (built here with random weights) fine-tunes under parallel
layouts through checkpoint.init_from, directly or converted, and its first training loss is the
HF model's on the same batch; a run on `tetrad data` shards exports to an HF folder that
transformers loads with its tokenizer, and `tetrad generate` decodes with that tokenizer."""

import json
import os
import warnings
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from conftest import TINY, run_ranks, train_layout, write_hf_qwen
from test_convert import write_hf_phi3
from test_data import write_docs
from tetrad.cli import main
from tetrad.config import load_config
from tetrad.data.tokenizer import load_tokenizer
from tetrad.train.batches import split_batches
from tetrad.train import building, trainer
from tetrad.train.convert import logical_shapes, read_weights
from tetrad.train.generate import single_process_model
from tetrad.train.init_from import check_init_from, initial_weights
from tetrad.train.inputs import model_keys

transformers = pytest.importorskip("transformers")


def config(tmp_path, name, **sections):
    raw = {"train": {**TINY["train"], "steps": 1}, "run": {"dir": str(tmp_path / name)}, **sections}
    return load_config(overrides=raw, model_from_inputs=model_keys)


def whole(handle) -> torch.Tensor:
    """The whole logical tensor of a stored_weights handle."""
    return handle[tuple(slice(0, n) for n in handle.shape)]


def hf_loss(hf_dir: Path, inputs: torch.Tensor, labels: torch.Tensor) -> float:
    hf = transformers.AutoModelForCausalLM.from_pretrained(hf_dir, attn_implementation="eager").eval()
    with torch.no_grad():
        logits = hf(inputs).logits
    return float(F.cross_entropy(logits.flatten(0, 1), labels.flatten()))


@pytest.mark.dist
def test_hf_llama_fine_tunes_from_its_weights_under_parallel_layouts(tmp_path, capsys):
    hf_cfg = transformers.LlamaConfig(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=4096)
    torch.manual_seed(0)
    transformers.LlamaForCausalLM(hf_cfg).save_pretrained(tmp_path / "hf", safe_serialization=True)
    assert main(["convert", str(tmp_path / "hf"), "--to-tetrad", str(tmp_path / "ckpt")]) == 0
    assert f"--checkpoint.init_from={tmp_path / 'ckpt'}" in capsys.readouterr().out

    for source, parallel in ((tmp_path / "hf", {"tp": 2}), (tmp_path / "ckpt", {"pp": 2, "zero": 1})):
        cfg = config(tmp_path, f"run-{source.name}", parallel=parallel, checkpoint={"init_from": str(source)},
                     model={"seq_len": 32})
        assert (cfg.model.n_layers, cfg.model.d_model, cfg.model.n_kv_heads) == (2, 64, 2)  # from the weights
        losses, _, _ = train_layout(cfg)
        inputs, labels = split_batches(cfg)[0].global_batch_at(0)
        assert losses[0] == pytest.approx(hf_loss(tmp_path / "hf", inputs, labels), rel=1e-5), source.name

    # The command `convert --to-tetrad` prints runs (it named a folder `resume` could not take).
    fine_tune = ["train", f"--checkpoint.init_from={tmp_path / 'ckpt'}", "--model.seq_len=32",
                 "--checkpoint.every=1", f"--run.dir={tmp_path / 'cli'}"]
    assert main(fine_tune + ["--train.steps=1"]) == 0
    out = capsys.readouterr().out
    # announced by the weights' shape, not the preset's name (tiny: 4 layers, d_model 64)
    assert f"training the 2-layer, d_model 64 model of {tmp_path / 'ckpt'} with dp=1" in out
    assert "train.warmup=20 > train.steps=1: the learning rate never reaches train.lr" in out
    assert main(fine_tune + ["--train.steps=2", "--train.warmup=2"]) == 0  # resumes its own checkpoint
    out = capsys.readouterr().out
    assert f"training the 2-layer, d_model 64 model fine-tuned from {tmp_path / 'ckpt'}" in out
    assert "never reaches" not in out
    assert main(["train", f"--checkpoint.init_from={tmp_path / 'ckpt'}", "--model.n_layers=3",
                 f"--run.dir={tmp_path / 'bad'}"]) == 2
    assert "n_layers=2 there, 3 here" in capsys.readouterr().err


@pytest.mark.dist
def test_hf_qwen2_fine_tunes_from_its_folder_under_tp(tmp_path):
    """Qwen2 (q, k and v biases, given values here) straight from its HF folder: the first
    step's loss is transformers' on the same batch, under tp2 with SP (the biases split)."""
    write_hf_qwen(tmp_path / "hf", "qwen2", max_position_embeddings=4096)
    cfg = config(tmp_path, "run", parallel={"tp": 2, "sequence_parallel": True},
                 checkpoint={"init_from": str(tmp_path / "hf")}, model={"seq_len": 32})
    assert cfg.model.qkv_bias
    losses, _, _ = train_layout(cfg)
    inputs, labels = split_batches(cfg)[0].global_batch_at(0)
    assert losses[0] == pytest.approx(hf_loss(tmp_path / "hf", inputs, labels), rel=1e-5)


class Counted:
    """A stored_weights handle that records the elements each read of its tensor asks for."""

    def __init__(self, handle, name: str, reads: dict):
        self.handle, self.name, self.reads = handle, name, reads

    @property
    def shape(self):
        return self.handle.shape

    def __getitem__(self, box):
        part = self.handle[box]
        self.reads[self.name] = self.reads.get(self.name, 0) + part.numel()
        return part


def _counting(read, reads: dict):
    def counted(name: str):
        stored = read(name)
        if isinstance(stored, torch.Tensor):  # what a reader gave before handles: read whole
            reads[name] = reads.get(name, 0) + stored.numel()
            return stored
        return Counted(stored, name, reads)
    return counted


def _reads_starting(cfg) -> dict[str, int]:
    """The elements of each tensor of checkpoint.init_from this rank reads as its Trainer starts."""
    reads, stored = {}, building.initial_weights
    building.initial_weights = lambda source: _counting(stored(source), reads)  # in this forked rank alone
    trainer.Trainer(cfg, torch.device("cpu"))
    return reads


@pytest.mark.dist
@pytest.mark.parametrize("parallel", [{"tp": 2}, {"pp": 2}, {"tp": 2, "zero": 3, "dp": 2}])
def test_each_rank_reads_only_its_part_of_the_weights_it_starts_from(tmp_path, parallel):
    """A tp rank read every tensor whole and cut its rows or columns from it (tp x the reads, the
    largest tensor whole on each rank); now each reads its shard alone (the norms, replicated,
    whole). Under ZeRO-3 a rank reads the tp shards of the tensors its flat shard overlaps; a pp
    rank its stages' tensors alone."""
    hf_cfg = transformers.LlamaConfig(vocab_size=255, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64)
    transformers.LlamaForCausalLM(hf_cfg).save_pretrained(tmp_path / "hf", safe_serialization=True)
    cfg = config(tmp_path, "run", parallel=parallel, checkpoint={"init_from": str(tmp_path / "hf")},
                 model={"seq_len": 32})
    shapes = {name: torch.Size(shape).numel() for name, shape in logical_shapes(cfg.model).items()}
    ranks = run_ranks(_reads_starting, cfg.parallel.world_size, cfg)
    tp = parallel.get("tp", 1)
    for reads in ranks:
        for name, read in reads.items():
            part = shapes[name] if name.endswith("norm.weight") else shapes[name] / tp  # 255 rows: 128, 127
            assert read == pytest.approx(part, rel=0.01), (name, read, part)
    assert set().union(*ranks) == set(shapes)
    if parallel == {"tp": 2}:
        assert all(set(reads) == set(shapes) for reads in ranks)
    if "pp" in parallel:  # each stage's tensors on its rank alone
        assert sum(map(len, ranks)) == len(shapes)


@pytest.mark.dist
def test_hf_phi3_fine_tunes_from_its_folder_under_tp_and_exports_as_phi3(tmp_path):
    """Phi-3 (q, k and v in one tensor, gate and up in another; a window of 5 of the 32 tokens)
    straight from its HF folder: every rank reads its rows of the fused tensors, the weights are
    convert's, and the first step's loss under tp2 is transformers' on the same batch. The run
    exports as Phi3ForCausalLM (model.hf_model_type came with the weights), which transformers
    loads to the fine-tuned model's logits."""
    write_hf_phi3(tmp_path / "hf", sliding_window=5)
    assert main(["convert", str(tmp_path / "hf"), "--to-tetrad", str(tmp_path / "ckpt")]) == 0
    _, converted = read_weights(tmp_path / "ckpt")
    read = initial_weights(str(tmp_path / "hf"))
    assert all(torch.equal(whole(read(name)), p) for name, p in converted.items())
    cfg = config(tmp_path, "run", parallel={"tp": 2}, checkpoint={"init_from": str(tmp_path / "hf"), "every": 1},
                 model={"seq_len": 32})
    assert (cfg.model.hf_model_type, cfg.model.sliding_window) == ("phi3", 5)
    check_init_from(cfg)
    losses, _, _ = train_layout(cfg)
    inputs, labels = split_batches(cfg)[0].global_batch_at(0)
    assert losses[0] == pytest.approx(hf_loss(tmp_path / "hf", inputs, labels), rel=1e-5)

    assert main(["convert", str(tmp_path / "run"), "--to-hf", str(tmp_path / "tuned")]) == 0
    assert json.loads((tmp_path / "tuned" / "config.json").read_text())["architectures"] == ["Phi3ForCausalLM"]
    _, state = read_weights(tmp_path / "run")
    assert not torch.equal(state["layers.0.mlp.w1.weight"], converted["layers.0.mlp.w1.weight"])  # it trained
    ids = inputs[:1]
    hf = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "tuned", attn_implementation="eager").eval()
    with torch.no_grad():
        torch.testing.assert_close(single_process_model(cfg.model, state)(ids, torch.arange(ids.shape[1])),
                                   hf(ids).logits, atol=1e-4, rtol=1e-4)


def test_phi3_weights_that_do_not_fit_name_the_fused_tensor_before_ranks_start(tmp_path, capsys):
    write_hf_phi3(tmp_path / "hf", num_hidden_layers=1)
    config_json = tmp_path / "hf" / "config.json"
    config_json.write_text(json.dumps({**json.loads(config_json.read_text()), "num_key_value_heads": 4}))
    capsys.readouterr()
    assert main(["train", f"--checkpoint.init_from={tmp_path / 'hf'}", "--train.steps=1", "--model.seq_len=32",
                 f"--run.dir={tmp_path / 'run'}"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "Traceback" not in err, err
    assert "model.layers.0.self_attn.qkv_proj.weight: (128, 64) in the file, (192, 64) for config.json's model" in err


@pytest.mark.dist
def test_a_run_on_shards_exports_to_hf_with_its_tokenizer(tmp_path, capsys):
    write_docs(tmp_path / "text")
    assert main(["data", str(tmp_path / "text"), "--out", str(tmp_path / "shards"), "--vocab-size", "300"]) == 0
    cfg = config(tmp_path, "run", data={"source": str(tmp_path / "shards")}, checkpoint={"every": 1},
                 model={k: v for k, v in TINY["model"].items()})
    train_layout(cfg)
    ckpt = tmp_path / "run" / "checkpoints"
    assert main(["convert", str(ckpt), "--to-hf", str(tmp_path / "hf")]) == 0
    assert os.stat(tmp_path / "hf" / "model.safetensors").st_mode & 0o777 == 0o644

    ours = load_tokenizer(tmp_path / "shards" / "tokenizer.json")
    theirs = transformers.AutoTokenizer.from_pretrained(tmp_path / "hf")
    text = "document 7: word3 héllo"
    assert theirs(text)["input_ids"] == ours.encode(text).ids and theirs.decode(ours.encode(text).ids) == text
    assert theirs.eos_token == "<|endoftext|>"
    _, state = read_weights(ckpt)
    model = single_process_model(cfg.model, state)
    ids = torch.tensor([ours.encode(text).ids])
    hf = transformers.LlamaForCausalLM.from_pretrained(tmp_path / "hf", attn_implementation="eager").eval()
    with torch.no_grad():
        torch.testing.assert_close(model(ids, torch.arange(ids.shape[1])), hf(ids).logits, atol=1e-4, rtol=1e-4)

    capsys.readouterr()
    assert main(["generate", str(tmp_path / "run"), "--prompt", "document", "--max-new-tokens", "5"]) == 0
    out = capsys.readouterr()
    assert out.out.startswith("document") and str(tmp_path / "shards" / "tokenizer.json") in out.err
    # And back: the HF folder's tokenizer stays beside the converted weights.
    assert main(["convert", str(tmp_path / "hf"), "--to-tetrad", str(tmp_path / "back")]) == 0
    assert (tmp_path / "back" / "tokenizer.json").read_text() == (tmp_path / "hf" / "tokenizer.json").read_text()
    assert json.loads((tmp_path / "hf" / "tokenizer_config.json").read_text())["model_max_length"] == 32


def tiny_hf(folder: Path, vocab_size: int = 256) -> None:
    hf_cfg = transformers.LlamaConfig(vocab_size=vocab_size, hidden_size=64, intermediate_size=128, num_hidden_layers=1,
                                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=32)
    torch.manual_seed(0)
    transformers.LlamaForCausalLM(hf_cfg).save_pretrained(folder, safe_serialization=True)


def _fine_tuned_at_16(tmp_path, architecture: str, **hf_config) -> dict:
    """An HF model of 64 positions (`architecture`: Llama, Mistral), fine-tuned one step at
    seq_len 16 and exported: tetrad generate's greedy decoding to position 49, past seq_len, must
    equal transformers' generate on the export. Returns the export's config.json."""
    from tetrad.model.sampling import GREEDY
    from tetrad.train.generate import generate, load_generator
    hf_cfg = getattr(transformers, f"{architecture}Config")(
        vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=1, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=64, **hf_config)
    torch.manual_seed(0)
    hf_model = getattr(transformers, f"{architecture}ForCausalLM")(hf_cfg)
    with torch.no_grad():
        hf_model.lm_head.weight.mul_(20)  # greedy picks far apart: no near-tie that rounding could flip
    hf_model.save_pretrained(tmp_path / "hf", safe_serialization=True)
    assert main(["train", f"--checkpoint.init_from={tmp_path / 'hf'}", "--model.seq_len=16", "--train.steps=1",
                 "--train.global_batch=2", "--train.micro_batch=1", "--checkpoint.every=1",
                 f"--run.dir={tmp_path / 'run'}"]) == 0
    assert main(["convert", str(tmp_path / "run"), "--to-hf", str(tmp_path / "back")]) == 0
    model, _, _ = load_generator(tmp_path / "run")
    prompt = list(range(3, 13))
    new, _ = generate(model, prompt, 40, GREEDY)
    assert len(new) == 40  # to position 49 of 64, past seq_len 16
    back = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "back", attn_implementation="eager").eval()
    with torch.no_grad():
        theirs = back.generate(torch.tensor([prompt]), do_sample=False, max_new_tokens=40, eos_token_id=None,
                               pad_token_id=0)[0, len(prompt):].tolist()
    assert new == theirs
    return json.loads((tmp_path / "back" / "config.json").read_text())


def test_a_model_fine_tuned_at_a_shorter_seq_len_keeps_its_context(tmp_path):
    """An HF model of 64 positions fine-tuned at seq_len 16 is still a 64-position model, as
    Megatron-LM's --max-position-embeddings keeps it apart from --seq-length: its export says 64
    (before: 16, which readers such as vLLM take as the limit), and `tetrad generate` decodes
    past 16 (before: stopped there), the tokens transformers' generate picks from the export."""
    assert _fine_tuned_at_16(tmp_path, "Llama")["max_position_embeddings"] == 64
    cfg = config(tmp_path, "cfg", checkpoint={"init_from": str(tmp_path / "hf")}, model={"seq_len": 16})
    assert (cfg.model.seq_len, cfg.model.max_position_embeddings, cfg.model.context_length) == (16, 64, 64)


def test_a_windowed_model_fine_tuned_within_its_window_exports_the_window(tmp_path):
    """A Mistral of 64 positions and a window of 16, fine-tuned at seq_len 16 (where the window
    hides nothing), still has its window past position 16, where its export's context reaches and
    `tetrad generate` applies it: config.json says sliding_window 16, and greedy decoding to
    position 49 equals transformers' generate on the export (before: exported with no window, as
    a Llama that sees every key)."""
    exported = _fine_tuned_at_16(tmp_path, "Mistral", sliding_window=16)
    assert (exported["sliding_window"], exported["max_position_embeddings"]) == (16, 64), exported


def test_a_tetrad_model_fine_tuned_at_a_shorter_seq_len_keeps_its_context(tmp_path):
    """As an HF import does: a tetrad model trained at seq_len 32 and fine-tuned from its
    checkpoint at 16 still reads (generate) and exports 32 tokens (before: 16)."""
    run = tmp_path / "pre"
    assert main(["train", "--model.seq_len=32", "--train.steps=1", "--train.global_batch=2",
                 "--train.micro_batch=1", "--checkpoint.every=1", f"--run.dir={run}"]) == 0
    cfg = config(tmp_path, "ft", checkpoint={"init_from": str(run)}, model={"seq_len": 16})
    assert (cfg.model.seq_len, cfg.model.context_length) == (16, 32)


def test_hf_weights_that_do_not_fit_are_a_config_error_before_ranks_start(tmp_path, capsys):
    """config.json fits [model] but the weights the ranks would read do not (an edited config,
    a broken file): one line naming the tensor, not a rank's traceback."""
    tiny_hf(tmp_path / "hf")
    config_json = tmp_path / "hf" / "config.json"
    config_json.write_text(json.dumps({**json.loads(config_json.read_text()), "intermediate_size": 96}))
    args = ["train", f"--checkpoint.init_from={tmp_path / 'hf'}", "--train.steps=1", "--model.seq_len=32"]
    capsys.readouterr()  # transformers' own progress bars
    assert main([*args, f"--run.dir={tmp_path / 'run'}"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "Traceback" not in err, err
    assert "model.layers.0.mlp.gate_proj.weight: (128, 64) in the file, (96, 64) for config.json's model" in err

    tiny_hf(tmp_path / "broken")
    (tmp_path / "broken" / "model.safetensors").write_bytes(b"not a safetensors file")
    args[1] = f"--checkpoint.init_from={tmp_path / 'broken'}"
    capsys.readouterr()
    assert main([*args, f"--run.dir={tmp_path / 'run2'}"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "model.safetensors is not a readable safetensors file" in err, err


def test_init_from_takes_a_run_folder_as_generate_and_convert_do(tmp_path):
    """RUN_DIR names its newest checkpoint, read without DCP's one-process warning."""
    tiny_hf(tmp_path / "hf")
    step = tmp_path / "run" / "checkpoints" / "step_00000003"
    assert main(["convert", str(tmp_path / "hf"), "--to-tetrad", str(step)]) == 0
    cfg = config(tmp_path, "finetune", checkpoint={"init_from": str(tmp_path / "run")}, model={"seq_len": 32})
    assert (cfg.model.n_layers, cfg.model.d_model) == (1, 64)  # from the weights
    check_init_from(cfg)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        embed = whole(initial_weights(str(tmp_path / "run"))("embed.weight"))
    assert not caught, [str(w.message) for w in caught]
    hf = transformers.LlamaForCausalLM.from_pretrained(tmp_path / "hf")
    assert torch.equal(embed, hf.model.embed_tokens.weight.detach())


def test_data_tokenized_with_another_vocabulary_than_the_weights_is_refused(tmp_path, capsys):
    """Shards from another tokenizer, or text read as bytes, would train the weights on the wrong
    ids, silently."""
    write_docs(tmp_path / "text")
    (tmp_path / "other.txt").write_text("a text of other words, so other merges " * 40)
    for name, text in (("theirs", tmp_path / "text"), ("other", tmp_path / "other.txt")):
        assert main(["data", str(text), "--out", str(tmp_path / name), "--vocab-size", "300"]) == 0
    tiny_hf(tmp_path / "hf", vocab_size=300)
    (tmp_path / "hf" / "tokenizer.json").write_bytes((tmp_path / "theirs" / "tokenizer.json").read_bytes())
    step = tmp_path / "run" / "checkpoints" / "step_00000001"  # a tetrad checkpoint keeps the tokenizer beside
    assert main(["convert", str(tmp_path / "hf"), "--to-tetrad", str(step)]) == 0
    capsys.readouterr()
    for source, weights in ((tmp_path / "hf", tmp_path / "hf"), (tmp_path / "run", step)):
        check_init_from(config(tmp_path, "ok", checkpoint={"init_from": str(source)},
                               data={"source": str(tmp_path / "theirs")}, model={"seq_len": 32}))
        for data, how in ((tmp_path / "other", "was tokenized with another vocabulary"),
                          ("licenses", "is read as bytes, another vocabulary")):
            assert main(["train", f"--checkpoint.init_from={source}", f"--data.source={data}", "--model.seq_len=32",
                         "--train.steps=1", f"--run.dir={tmp_path / 'refused'}"]) == 2
            err = capsys.readouterr().err
            assert how in err and f"theirs: `tetrad data TEXT --tokenizer {weights / 'tokenizer.json'}" in err, err


def test_shards_in_another_vocabulary_size_than_weights_without_a_tokenizer_name_the_weights(tmp_path, capsys):
    """Weights whose tokenizer is not known (here a byte-level model's): the refusal names them as
    what set model.vocab_size, not a model.vocab_size the user never set."""
    write_docs(tmp_path / "text")
    assert main(["data", str(tmp_path / "text"), "--out", str(tmp_path / "shards"), "--vocab-size", "300"]) == 0
    tiny_hf(tmp_path / "hf", vocab_size=256)
    capsys.readouterr()
    assert main(["train", f"--checkpoint.init_from={tmp_path / 'hf'}", f"--data.source={tmp_path / 'shards'}",
                 "--model.seq_len=32", "--train.steps=1", f"--run.dir={tmp_path / 'refused'}"]) == 2
    err = capsys.readouterr().err
    assert f"but the weights of checkpoint.init_from='{tmp_path / 'hf'}' have 256 (model.vocab_size follows them); " \
        "tokenize the text with their tokenizer, or give the text itself, read as bytes" in err, err
