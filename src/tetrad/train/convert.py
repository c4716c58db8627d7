"""`tetrad convert`: tetrad checkpoints <-> Hugging Face safetensors of the architectures
train/hf_architectures.py maps (LlamaForCausalLM, MistralForCausalLM, Qwen2ForCausalLM,
Qwen3ForCausalLM, Phi3ForCausalLM, GemmaForCausalLM, Gemma3ForCausalLM, MixtralForCausalLM,
Qwen2MoeForCausalLM, Qwen3MoeForCausalLM, Glm4MoeForCausalLM, DeepseekV2ForCausalLM, DeepseekV3ForCausalLM).

One CPU process, whatever layout the checkpoint was trained under: checkpoints hold the logical
(unsharded, unpadded) tensors, so conversion is renaming (Phi-3's fused tensors split or joined
too, a mixture of experts' per-expert tensors stacked or unstacked, DeepSeek's RoPE rows
de-interleaved or interleaved (hf_deepseek.rope_orders); GLM-4.5's and DeepSeek-V3's expert biases,
their e_score_correction_bias buffers, are the checkpoint's `extra.expert_bias`; their
multi-token-prediction layers are model.mtp_layers' depths (hf_mtp); DeepSeek-V3's fp8
weights dequantized to bf16, hf_fp8). Reading HF weights goes through safetensors (no pickle); a converted tetrad checkpoint
holds weights only (step 0, no optimizer state) and starts a run with
`--checkpoint.init_from=CKPT`. The tokenizer travels both ways: the run's (its data's, or bytes)
is written into the HF folder for `AutoTokenizer`, and an HF folder's tokenizer.json is kept
beside the converted weights.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import shutil
import sys
from pathlib import Path

import torch
import torch.distributed.checkpoint as dcp
from safetensors.torch import load_file, save_file
from tokenizers import Tokenizer
from torch.distributed.checkpoint import FileSystemWriter

from tetrad.config import Config, ConfigError, load_config, read_toml
from tetrad.config.wording import counted
from tetrad.data.chat import CONFIG as CHAT_CONFIG, JINJA as CHAT_JINJA, ChatTemplate, template_beside
from tetrad.data.shards import TOKENIZER
from tetrad.data.tokenizer import (GENERATION_CONFIG, document_prefix, keep_generation_config, model_eos, model_pad,
                                   run_eos, run_tokenizer)
from tetrad.model.llama import Transformer
from tetrad.model.sharding import spec_of
from tetrad.dist.topology import Topology
from tetrad.train.checkpoint import (MANIFEST, CheckpointError, SafeReader, check_shapes, digest_files, publish, resolve,
                                     verify)
from tetrad.train.checkpoint.store import one_process, read_extras, read_manifest
from tetrad.train.expert_bias import ExpertBias
from tetrad.train.hf_architectures import (TOP_NAMES, check_exportable, exported_type, hf_architecture, hf_rope_scaling,
                                            hf_rows, hf_tensor_shapes, hf_tensors)
from tetrad.train.hf_deepseek import rope_interleaved, rope_orders
from tetrad.train.hf_fp8 import dequantized, fp8_block, unscaled
from tetrad.train.hf_gemma import TEXT_TOWER
from tetrad.train.hf_moe import beyond_layers, expert_bias_names, expert_param, split_experts, stack_experts
from tetrad.train.hf_folder import hf_model_keys, hf_shapes, stale_copies
from tetrad.train.hf_mtp import MTP_TYPES, copies


def logical_shapes(model_cfg) -> dict[str, tuple[int, ...]]:
    """Every parameter's logical shape, from a model built on the meta device (no memory)."""
    with torch.device("meta"):
        model = Transformer(model_cfg, Topology.single("meta"))
    return {name: spec_of(p)[0].full_shape for name, p in model.named_parameters()}


def checkpoint_folder(path: Path) -> Path:
    """The checkpoint `path` names: a checkpoint folder, a checkpoint root (its newest), or a run
    folder (the newest under its config.toml's checkpoint.dir, by default RUN_DIR/checkpoints)."""
    if (path / MANIFEST).exists() or path.name.startswith("step_"):
        return resolve(path)
    run_config = path / "config.toml"
    saved = read_toml(run_config).get("checkpoint", {}) if run_config.is_file() else {}
    root = Path(saved.get("dir") or path / "checkpoints")
    if root.is_dir():
        return resolve(root)
    if run_config.is_file():
        raise CheckpointError(f"{path} is a run folder without checkpoints (its checkpoint.every = "
                              f"{saved.get('every', 0)}; 0 saves none); train with --checkpoint.every=N to save "
                              "every N steps and at the last")
    return resolve(path)  # a checkpoint root


class StoredWeights:
    """A checkpoint's logical parameters, read on one process whatever layout wrote them
    (integrity checked on opening, shapes before any read), all at once or a few at a time (an
    export holds one shard of a model too large for the host's memory, not the model). `cfg` is
    the training run's record: what only that run needed (its run.wandb or run.tensorboard
    package) is not asked of the machine that exports or samples it."""

    def __init__(self, checkpoint: Path):
        self.path = checkpoint_folder(checkpoint)
        manifest = verify(self.path)
        saved = self.path / "config.toml"
        self.cfg = load_config(saved if saved.is_file() else None, overrides={"model": manifest["model"]}, runtime=False)
        self.reader = SafeReader(self.path)
        metadata = self.reader.read_metadata()
        stored = metadata.state_dict_metadata
        self.shapes = logical_shapes(self.cfg.model)
        self.dtypes = {name: stored[f"model.{name}"].properties.dtype if f"model.{name}" in stored else torch.float32
                       for name in self.shapes}
        check_shapes(metadata, {f"model.{name}": shape for name, shape in self.shapes.items()}, self.path)

    def read(self, names: list[str]) -> dict[str, torch.Tensor]:
        state = {f"model.{name}": torch.empty(self.shapes[name], dtype=self.dtypes[name]) for name in names}
        with one_process():
            dcp.load(state, storage_reader=self.reader, no_dist=True)
        return {k[len("model."):]: v for k, v in state.items()}


def read_weights(checkpoint: Path) -> tuple[Config, dict[str, torch.Tensor]]:
    """The checkpoint's config and all its logical parameters by name (StoredWeights)."""
    weights = StoredWeights(checkpoint)
    return weights.cfg, weights.read(list(weights.shapes))


def _refuse_written(out: Path, flag: str) -> None:
    """Neither direction writes into a folder that holds anything: it could be the HF model a run
    was fine-tuned from (a single model.safetensors, written over), another export (whose shards
    readers of every *.safetensors would mix with the new weights) or a checkpoint."""
    if out.exists() and (not out.is_dir() or any(out.iterdir())):
        raise CheckpointError(f"{flag} {out} exists and is not an empty folder; choose a new one, or remove it first")


DEFAULT_SHARD_GB = 5.0  # Hugging Face Hub's usual shard size; an export holds one shard at a time
EXPORT_DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


def _shards(sizes: dict[str, int], max_bytes: float) -> list[list[str]]:
    """HF tensor names (in order) cut into runs of at most `max_bytes` each (a bigger tensor alone)."""
    shards: list[list[str]] = [[]]
    filled = 0
    for name, size in sizes.items():
        if shards[-1] and filled + size > max_bytes:
            shards.append([])
            filled = 0
        shards[-1].append(name)
        filled += size
    return shards


def _write_safetensors(weights: StoredWeights, m, model_type: str, out: Path, max_gb: float,
                       dtype: torch.dtype | None, buffers: dict[str, torch.Tensor]) -> None:
    """The weights of model `m` (the checkpoint's, or it without its multi-token-prediction depths)
    as HF's tensors in `out`: model.safetensors, or shards of at most `max_gb` with
    model.safetensors.index.json (as transformers' save_pretrained), read and written one shard at
    a time; in `dtype` (None: as stored). An expert parameter is its experts' tensors (its pieces),
    read again where a shard boundary falls among them; RoPE rows in the order config.json's says
    (DeepSeek's interleaved). `buffers` (HF name -> tensor, kept in its own dtype: the fp32 expert
    biases) join the last shard; the multi-token-prediction layers' copies of the embedding and
    head (hf_mtp.copies) are read as those parameters."""
    kept = {n: shape for n, shape in weights.shapes.items() if m.mtp_layers or not n.startswith("mtp.")}
    rows, shapes = hf_rows(kept, model_type, m.n_layers), split_experts(kept)
    orders = rope_orders(m, rope_interleaved(hf_architecture(m)))
    parts: dict[str, list[str]] = {}
    for name, (key, _, _) in rows.items():
        parts.setdefault(key, []).append(name)
    copied = copies(m)
    parts.update({key: [name] for key, name in copied.items()})
    sizes = {key: sum(math.prod(shapes[n]) * (dtype or weights.dtypes[expert_param(n)]).itemsize for n in names)
             for key, names in parts.items()}
    shards = _shards(sizes, max_gb * 2**30)
    files = ["model.safetensors"] if len(shards) == 1 else \
        [f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors" for i in range(len(shards))]
    for keys, file in zip(shards, files):
        state = weights.read(sorted({expert_param(n) for key in keys for n in parts[key]}))
        state = {n: v[orders[n].argsort()] if n in orders else v for n, v in state.items()}
        tensors = {k: v.to(dtype) if dtype else v for k, v in hf_tensors(state, model_type, m.n_layers).items() if k in keys}
        tensors.update({k: (state[copied[k]].to(dtype) if dtype else state[copied[k]]).clone() for k in keys if k in copied})
        if file == files[-1]:
            tensors.update(buffers)
        save_file(tensors, out / file, metadata={"format": "pt"})
        (out / file).chmod(0o644)  # safetensors writes 0600; a model folder is for sharing
        del state, tensors
    if len(shards) > 1:
        index = {"metadata": {"total_size": sum(sizes.values()) + sum(b.nbytes for b in buffers.values())},
                 "weight_map": {**{key: file for keys, file in zip(shards, files) for key in keys},
                                **dict.fromkeys(buffers, files[-1])}}
        (out / "model.safetensors.index.json").write_text(json.dumps(index, indent=2) + "\n")


def to_hf(checkpoint: Path, out: Path, max_shard_gb: float = DEFAULT_SHARD_GB, dtype: str = "") -> tuple[bool, str]:
    """Write the HF folder `out` (weights in `dtype`, one of EXPORT_DTYPES; "": as stored); whether
    it holds a tokenizer (one is known), and a note of multi-token-prediction depths left out
    ("" where none): an architecture without such layers (all but DeepSeek-V3 and GLM-4.5) gets
    the model without them, whose logits they never touch (a training aid: refusing would leave
    such a run no export at all)."""
    _refuse_written(out, "--to-hf")
    weights = StoredWeights(checkpoint)
    m = weights.cfg.model
    check_exportable(m)
    stored = read_extras(weights.path, ExpertBias.NAME)
    note = ""
    if m.mtp_layers and exported_type(m) not in MTP_TYPES:
        note = (f"left out the {counted(m.mtp_layers, 'multi-token-prediction depth')} (model.mtp_layers): "
                f"{hf_architecture(m)['architectures'][0]} has no such layers (DeepseekV3ForCausalLM and "
                "Glm4MoeForCausalLM have); the export computes the same logits")
        m = dataclasses.replace(m, mtp_layers=0)
        stored = {layer: bias for layer, bias in stored.items() if not layer.startswith("mtp.")}
    names = expert_bias_names(m, exported_type(m))  # GLM-4.5's and DeepSeek-V3's; the other families have none
    if not names:
        _refuse_moved_biases(weights.path, stored)
    biases = {key: stored.get(layer, torch.zeros(m.n_experts)).float() for layer, key in names.items()}
    out.mkdir(parents=True, exist_ok=True)
    _write_safetensors(weights, m, exported_type(m), out, max_shard_gb, EXPORT_DTYPES.get(dtype), biases)
    tokenizer, source = exported_tokenizer(weights.path, weights.cfg.data.source)
    if tokenizer is not None:
        write_hf_tokenizer(tokenizer, out, m.context_length, template_beside(source) if source else None, source)
    if source is not None and source.with_name(GENERATION_CONFIG).is_file():  # an imported model's, kept
        shutil.copyfile(source.with_name(GENERATION_CONFIG), out / GENERATION_CONFIG)
    written = EXPORT_DTYPES.get(dtype) or next(iter(weights.dtypes.values()))
    hf_config = {"vocab_size": m.vocab_size,
                 "hidden_size": m.d_model, "intermediate_size": m.ffn_hidden, "num_hidden_layers": m.n_layers,
                 "num_attention_heads": m.n_heads, "num_key_value_heads": m.n_kv_heads, "head_dim": m.head_dim,
                 "max_position_embeddings": m.context_length, "rms_norm_eps": m.norm_eps, "rope_theta": m.rope_theta,
                 "tie_word_embeddings": m.tie_embeddings, "hidden_act": "silu",
                 "torch_dtype": str(written).removeprefix("torch."), **hf_architecture(m),  # Gemma's activation its own
                 **hf_rope_scaling(m.rope_scaling), **(_special_token_ids(tokenizer, source) if tokenizer is not None else {})}
    (out / "config.json").write_text(json.dumps(hf_config, indent=2) + "\n")
    return tokenizer is not None, note


def _refuse_moved_biases(folder: Path, stored: dict[str, torch.Tensor]) -> None:
    """The softmax MoE formats tetrad exports (Mixtral, Qwen2-MoE, Qwen3-MoE) route by the probabilities
    alone: a checkpoint whose expert biases (`stored`) moved (model.router_bias_update_rate) routes otherwise."""
    moved = sorted(name for name, bias in stored.items() if bias.any())
    if moved:
        raise ConfigError(f"{folder} holds expert biases moved from zero ({len(moved)} MoE layers', {moved[0]}'s "
                          "first: model.router_bias_update_rate) and no softmax Hugging Face MoE format has one, so "
                          "the export would route otherwise (GLM-4.5's, with model.router_score='sigmoid', has); "
                          "sample or evaluate this checkpoint with tetrad instead")


def exported_tokenizer(folder: Path, data_source: str) -> tuple[Tokenizer | None, Path | None]:
    """The run's tokenizer and where it came from (data/tokenizer.py run_tokenizer), or (None, None)
    for a weights-only checkpoint (`--to-tetrad`) with no tokenizer.json beside it: no run read
    data for it, so the default data.source in its config.toml says nothing of its vocabulary."""
    if not (folder / TOKENIZER).is_file() and not read_manifest(folder)["optimizer"]:
        return None, None
    return run_tokenizer(folder, data_source)


def _special_token_ids(tokenizer, source: Path | None = None) -> dict:
    """config.json's `eos_token_id` (where HF's generate stops: an imported model's list as it
    came, model_eos), `bos_token_id` (what the tokenizer starts a text with), for the tokens the
    tokenizer has, and an imported model's `pad_token_id` (model_pad), where its tokenizer is the run's."""
    found = {f"{name}_token_id": token for name, token in _special_tokens(tokenizer, source).items()}
    imported, pad = model_eos(source), model_pad(source)
    found.update({} if pad is None else {"pad_token_id": pad})
    return {**found, "eos_token_id": imported} if len(imported) > 1 else found


def _special_tokens(tokenizer, source: Path | None = None) -> dict[str, int]:
    """The run's end-of-document token (run_eos: the one its data recorded beside the tokenizer's
    `source`) and the tokenizer's one-token document prefix, by HF's names."""
    found = {}
    eos = run_eos(tokenizer, source)
    if eos is not None:  # bytes: no end-of-document token
        found["eos"] = eos
    prefix = document_prefix(tokenizer)
    if len(prefix) == 1:
        found["bos"] = prefix[0]
    return found


def write_hf_tokenizer(tokenizer, out: Path, max_length: int, chat: ChatTemplate | None = None,
                       source: Path | None = None) -> None:
    """tokenizer.json and the tokenizer_config.json that lets `AutoTokenizer` load it, with the
    chat template the run's data was rendered with, if any (`apply_chat_template` then works)."""
    tokenizer.save(str(out / TOKENIZER))
    names = {f"{name}_token": tokenizer.id_to_token(token) for name, token in _special_tokens(tokenizer, source).items()}
    config = {"tokenizer_class": "PreTrainedTokenizerFast", "model_max_length": max_length, **names}
    if chat is not None:  # rendered with the bos_token and eos_token the data was rendered with
        config.update({"chat_template": chat.text, **{f"{name}_token": token for name, token
                                                       in (("bos", chat.bos), ("eos", chat.eos)) if token}})
    (out / "tokenizer_config.json").write_text(json.dumps(config, indent=2) + "\n")


def hf_mismatches(hf_dir: Path, model_cfg, model_type: str) -> list[str]:
    """How the folder's weights, named as config.json's `model_type` names them, differ from
    `model_cfg`'s parameters and expert biases (none: they fit). GLM-4.5's and DeepSeek-V3's
    multi-token-prediction layers past model.mtp_layers are no part of the model
    (hf_moe.beyond_layers); those it keeps may hold copies of the embedding and head (hf_mtp.copies)."""
    tower = TEXT_TOWER.get(model_type, "")  # a multimodal model's vision tower is not this model's
    found = {k: shape for k, shape in hf_shapes(hf_dir).items()
             if k.startswith(tower) and not beyond_layers(k, model_cfg, model_type)}
    expected = {**hf_tensor_shapes(logical_shapes(model_cfg), model_type, model_cfg.n_layers),
                **dict.fromkeys(expert_bias_names(model_cfg, model_type).values(), (model_cfg.n_experts,))}
    # A tied model's export may hold the head too, the embedding's copy (transformers reads past it)
    extra = {k for k in found if k not in expected} - set(copies(model_cfg)) - \
        ({tower + TOP_NAMES["head.weight"]} if model_cfg.tie_embeddings else set())
    problems = [f"{k}: missing" for k in expected if k not in found]
    problems += [f"{k}: not a weight of this model" for k in sorted(extra)]
    problems += [f"{k}: {found[k]} in the file, {shape} for config.json's model"
                 for k, shape in expected.items() if k in found and found[k] != shape]
    return problems


DEQUANTIZED_DTYPE = torch.bfloat16  # fp8 weights' (hf_fp8): the release's other tensors' type, half of fp32's disk


def to_tetrad(hf_dir: Path, out: Path) -> list[str]:
    """The HF folder as a weights-only checkpoint (GLM-4.5's and DeepSeek-V3's expert biases as its
    extra.expert_bias, their multi-token-prediction layers as model.mtp_layers' depths); notes of
    what it left out, one line each."""
    _refuse_written(out, "--to-tetrad")
    if not (hf_dir / "config.json").is_file():
        tetrad = any((hf_dir / name).exists() for name in ("config.toml", MANIFEST, "checkpoints"))
        raise CheckpointError(f"{hf_dir} is not a Hugging Face model folder (no config.json); --to-tetrad reads one: "
                              "config.json and *.safetensors" + (" (a tetrad run or checkpoint needs no conversion: "
                              f"train from it with --checkpoint.init_from={hf_dir})" if tetrad else ""))
    hf = json.loads((hf_dir / "config.json").read_text())
    keys, note = hf_model_keys(hf_dir, hf)
    cfg = load_config(overrides={"model": keys})
    problems = hf_mismatches(hf_dir, cfg.model, hf.get("model_type", ""))
    if problems:
        raise CheckpointError(f"{hf_dir} does not match its config.json:\n  " + "\n  ".join(problems[:20]))
    weights = {k: v for f in sorted(hf_dir.glob("*.safetensors")) for k, v in load_file(f).items()}
    weights = dequantized(weights, fp8_block(hf, hf_dir / "config.json"), DEQUANTIZED_DTYPE)
    raw = next((k for k, v in weights.items() if v.dtype in (torch.float8_e4m3fn, torch.float8_e5m2)), None)
    if raw is not None:
        raise CheckpointError(unscaled(hf_dir, raw))
    rows = hf_rows(logical_shapes(cfg.model), hf.get("model_type", ""), cfg.model.n_layers)
    orders = rope_orders(cfg.model, rope_interleaved(hf))  # DeepSeek's RoPE rows, de-interleaved
    tmp = out.with_name(out.name + ".partial")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    biases = {f"extra.{ExpertBias.NAME}.{layer}": weights[key].float()
              for layer, key in expert_bias_names(cfg.model, hf.get("model_type", "")).items()}
    with one_process():
        state = stack_experts({n: weights[k][start:stop][orders.get(n, slice(None))].contiguous()
                               for n, (k, start, stop) in rows.items()})
        dcp.save({**{f"model.{n}": tensor for n, tensor in state.items()}, **biases},
                 storage_writer=FileSystemWriter(tmp), no_dist=True)
    for name in (TOKENIZER, CHAT_CONFIG, CHAT_JINJA):  # generate and export find them beside the weights
        if (hf_dir / name).is_file():
            shutil.copyfile(hf_dir / name, tmp / name)
    keep_generation_config(hf_dir, tmp, hf)
    publish(tmp, out, cfg, 0, digest_files(tmp, 0, 1), optimizer=False, layout={})
    left_out = sum(beyond_layers(k, cfg.model, hf.get("model_type", "")) for k in weights)
    return [line for line in (note, stale_copies(hf_dir, cfg.model, weights.__getitem__, weights.keys())) if line] + \
        [f"left out {counted(left_out, 'tensor')} of multi-token-prediction layers past model.mtp_layers="
         f"{cfg.model.mtp_layers}"] * bool(left_out)


def convert_command(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="tetrad convert", description="Convert between tetrad checkpoints and "
                                     "Hugging Face safetensors (LlamaForCausalLM; Qwen2ForCausalLM for "
                                     "model.qkv_bias, Qwen3ForCausalLM for model.qk_norm, MistralForCausalLM for a Llama with "
                                     "model.sliding_window, Phi3ForCausalLM for model.hf_model_type=phi3, which an imported "
                                     "Phi-3 sets, or for LongRoPE or model.partial_rotary_factor; Gemma3ForCausalLM for "
                                     "model.norm=gemma_rmsnorm with sandwich norms, GemmaForCausalLM without; for "
                                     "model.n_experts, Qwen2MoeForCausalLM with a shared expert, Qwen3MoeForCausalLM "
                                     "with model.qk_norm, MixtralForCausalLM without, Glm4MoeForCausalLM for "
                                     "model.router_score=sigmoid; for model.kv_lora_rank (latent attention), "
                                     "DeepseekV2ForCausalLM with a softmax router, DeepseekV3ForCausalLM otherwise), "
                                     "on one CPU process.")
    parser.add_argument("source", type=Path, help="a tetrad checkpoint (or checkpoint dir with `latest`, or a run "
                        "dir), or an HF dir")
    direction = parser.add_mutually_exclusive_group(required=True)
    direction.add_argument("--to-hf", type=Path, metavar="OUT_DIR", help="write config.json + model.safetensors")
    direction.add_argument("--to-tetrad", type=Path, metavar="CKPT", help="write a weights-only tetrad checkpoint")
    parser.add_argument("--max-shard-gb", type=float, default=DEFAULT_SHARD_GB, help="--to-hf: weights in files of at "
                        "most this many GiB with model.safetensors.index.json, as save_pretrained shards them; "
                        "the export holds one at a time (default %(default)g)")
    parser.add_argument("--dtype", choices=sorted(EXPORT_DTYPES), help="--to-hf: the weights' type (default: as "
                        "the checkpoint stores them, fp32 for a run's master weights)")
    args = parser.parse_args(argv)
    try:
        if args.to_tetrad is not None and (args.dtype or args.max_shard_gb != DEFAULT_SHARD_GB):
            raise ValueError("--dtype and --max-shard-gb are for --to-hf; --to-tetrad keeps the weights as they are")
        if args.max_shard_gb <= 0:
            raise ValueError(f"--max-shard-gb must be above 0, got {args.max_shard_gb}")
        if args.to_hf is not None:
            tokenizer, note = to_hf(args.source, args.to_hf, args.max_shard_gb, args.dtype or "")
            if note:
                print(f"tetrad: {note}")
            if tokenizer:
                print(f"tetrad: wrote {args.to_hf}/config.json, the weights (*.safetensors) and the tokenizer")
            else:
                print(f"tetrad: wrote {args.to_hf}/config.json and the weights (*.safetensors); no tokenizer: the weights "
                      f"came without a tokenizer.json (copy the model's own into {args.to_hf})")
        else:
            for note in to_tetrad(args.source, args.to_tetrad):
                print(f"tetrad: {note}")
            tokenizer = args.to_tetrad / TOKENIZER
            print(f"tetrad: wrote {args.to_tetrad}; fine-tune from it with `tetrad train --checkpoint.init_from="
                  f"{args.to_tetrad} --data.source=DATA` (the model's shape follows the weights)"
                  + (f", DATA made with `tetrad data TEXT --tokenizer {tokenizer} --out DATA`"
                     if tokenizer.is_file() else ""))
    except (CheckpointError, ValueError) as e:
        print(f"tetrad: {e}", file=sys.stderr)
        return 2  # a user's mistake, as every command answers one
    return 0
