"""Multi-token prediction (model/mtp.py) in Hugging Face's format: DeepSeek-V3's and GLM-4.5's
`num_nextn_predict_layers` depths are the Hub's layers N..N+D-1 (N = num_hidden_layers), each a
decoder layer's tensors (self_attn.*, mlp.*, its norms: by a main layer's names) beside the
depth's own enorm, hnorm, eh_proj and shared_head.norm (vLLM's and SGLang's deepseek_mtp and
glm4_moe_mtp read these names). tetrad's depth k is `mtp.<k>`: its `block.*` is that decoder
layer, its `norm` shared_head.norm. The Hub's files also hold each depth's `embed_tokens` and
`shared_head.head`, copies of the model's embedding and head, which tetrad shares: written as
copies, read only to check that they are copies (`copies`). transformers' DeepseekV3ForCausalLM
and Glm4MoeForCausalLM compute none of it and skip those layers on load.
"""

from __future__ import annotations

import re

MTP_TYPES = ("deepseek_v3", "glm4_moe")  # the architectures with multi-token-prediction layers
OWN = {"enorm": "enorm", "hnorm": "hnorm", "eh_proj": "eh_proj", "norm": "shared_head.norm"}  # a depth's own modules
COPIES = {"embed.weight": "embed_tokens.weight", "head.weight": "shared_head.head.weight"}  # inside its HF layer
HF_LAYER = re.compile(r"model\.layers\.(\d+)\.")


def blocks(m) -> list[tuple[str, int]]:
    """(tetrad prefix, HF layer index) of every transformer block of model `m`: the main layers,
    then each multi-token-prediction depth's block."""
    return [(f"layers.{i}", i) for i in range(m.n_layers)] + \
        [(f"mtp.{k}.block", m.n_layers + k) for k in range(m.mtp_layers)]


def layer_of(name: str, n_layers: int) -> tuple[int, str]:
    """(HF layer index, the name inside that layer) of a tetrad parameter in a block or a depth:
    layers.i.X -> (i, X), mtp.k.block.X -> (N + k, X), mtp.k.enorm.weight -> (N + k, enorm.weight)
    (a depth's own modules: OWN's HF names)."""
    top, index, rest = name.split(".", 2)
    if top == "layers":
        return int(index), rest
    if rest.startswith("block."):
        return n_layers + int(index), rest[len("block."):]
    module, _, leaf = rest.rpartition(".")
    return n_layers + int(index), f"{OWN[module]}.{leaf}"


def copies(m) -> dict[str, str]:
    """HF copy -> the tetrad parameter it copies: each depth's embed_tokens and shared_head.head
    (a tied model's head is its embedding)."""
    head = "embed.weight" if m.tie_embeddings else "head.weight"
    return {f"model.layers.{m.n_layers + k}.{hf}": (head if ours == "head.weight" else ours)
            for k in range(m.mtp_layers) for ours, hf in COPIES.items()}


def held_depths(keys, n_layers: int) -> int:
    """How many depths HF tensor names `keys` hold a tensor of: layers N, N + 1, ... in a row."""
    layers = {int(found.group(1)) for found in map(HF_LAYER.match, keys) if found}
    depth = 0
    while n_layers + depth in layers:
        depth += 1
    return depth


def beyond(key: str, m) -> bool:
    """Whether HF tensor `key` is of a layer past model `m`'s blocks: a depth it leaves out."""
    found = HF_LAYER.match(key)
    return found is not None and int(found.group(1)) >= m.n_layers + m.mtp_layers
