"""What a Hugging Face model folder's weights are, from their files' headers (the tensors unread):
every tensor's shape, the model they make (config.json's, its multi-token-prediction depths those
whose weights the folder holds: train/hf_mtp.py), and where the depths' copies of the embedding or
head are not copies. Read by `convert --to-tetrad` and `checkpoint.init_from` alike."""

from __future__ import annotations

from collections.abc import Callable, Collection
from pathlib import Path

import torch
from safetensors import SafetensorError, safe_open

from tetrad.train.checkpoint import CheckpointError
from tetrad.train.hf_architectures import TOP_NAMES, model_config_from_hf
from tetrad.train.hf_fp8 import SCALE
from tetrad.train.hf_mtp import copies, held_depths


def hf_shapes(hf_dir: Path) -> dict[str, tuple[int, ...]]:
    """Every weight's shape in the folder's *.safetensors files, from their headers (no tensor
    is read); RoPE tables some exports carry are not weights, nor fp8 weights' scales (hf_fp8)."""
    files = sorted(hf_dir.glob("*.safetensors"))
    if not files:
        raise CheckpointError(f"{hf_dir} holds no *.safetensors file")
    shapes = {}
    for file in files:
        try:
            with safe_open(file, "pt") as f:
                shapes.update({k: tuple(f.get_slice(k).get_shape()) for k in f.keys()
                               if "rotary_emb" not in k and not k.endswith(SCALE)})
        except SafetensorError as e:
            raise CheckpointError(f"{file} is not a readable safetensors file ({e})") from None
    return shapes


def hf_model_keys(hf_dir: Path, hf: dict) -> tuple[dict, str]:
    """[model] keys of HF folder `hf_dir` with config.json `hf`, model.mtp_layers the
    multi-token-prediction layers its weights hold of the num_nextn_predict_layers config.json
    names (transformers' save_pretrained writes that key and none of those layers), and a note
    where they are fewer ("" where not)."""
    keys = model_config_from_hf(hf, hf_dir / "config.json")
    said = keys["mtp_layers"]
    if said:
        keys["mtp_layers"] = min(said, held_depths(hf_shapes(hf_dir), keys["n_layers"]))
    if keys["mtp_layers"] == said:
        return keys, ""
    return keys, (f"{hf_dir} holds {keys['mtp_layers']} of the num_nextn_predict_layers={said} multi-token-prediction "
                  f"layers its config.json names (transformers' save_pretrained writes none): model.mtp_layers="
                  f"{keys['mtp_layers']}")


def stale_copies(hf_dir: Path, m, read: Callable[[str], torch.Tensor], keys: Collection[str]) -> str:
    """A note where the multi-token-prediction layers' copies of the embedding or head among HF
    tensor names `keys` (read by `read`) differ from the model's own ("" where they are copies):
    tetrad's depths share the model's, as DeepSeek-V3's design does, so the model's own are kept;
    a fine-tune by code that computes no depth (transformers') leaves the copies stale."""
    differ = [key for key, name in copies(m).items() if key in keys and not torch.equal(read(key), read(TOP_NAMES[name]))]
    if not differ:
        return ""
    more = f" (and {len(differ) - 1} more)" if len(differ) > 1 else ""
    return (f"{hf_dir}: {differ[0]}{more} is not a copy of the model's own embedding or head, which tetrad's "
            "multi-token prediction shares: left out, the model's own used")
