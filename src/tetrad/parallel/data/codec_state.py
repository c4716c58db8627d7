"""The gradient codecs' per-bucket state (error feedback, PowerSGD's Q) as a rank's checkpoint
state: one codec per bucket group (the dense buckets', and under expert parallelism the experts'),
each keeping its own buckets' entries, keyed by bucket index, so the groups' keys never meet. Each bucket's entry carries a signature of what it belongs to (its parameters by name, in
order, and its size), so a resumed run whose buckets are laid out differently starts those
buckets afresh instead of adding another bucket's residual.
"""

from __future__ import annotations

import zlib

import torch

from tetrad.parallel.data.buffers import Bucket


def signature(bucket: Bucket, names: dict[int, str]) -> torch.Tensor:
    """What a bucket's codec state belongs to: its parameters (by name, in order) and size."""
    joined = "\n".join(names.get(id(p), "?") for p in bucket.params)
    return torch.tensor([zlib.crc32(joined.encode()), bucket.padded], dtype=torch.int64)


def codec_state_dict(codecs: dict, buckets: list[Bucket], names: dict[int, str]) -> dict[str, torch.Tensor]:
    """This rank's codec state by bucket, with each bucket's signature; `codecs`: by bucket group."""
    state = {name: t for codec in codecs.values() for name, t in codec.state_dict().items()}
    keys = {int(name.split(".")[1]) for name in state}
    return {**state, **{f"signature.{k}": signature(buckets[k], names) for k in keys}}


def load_codec_state(codecs: dict, buckets: list[Bucket], names: dict[int, str], state: dict[str, torch.Tensor],
                     device: torch.device) -> None:
    """Restore codec state for the buckets that hold the saved parameters at the saved size, each
    bucket's into its group's codec (`codecs`, by bucket group)."""
    same = {k for k in range(len(buckets))
            if torch.equal(state.get(f"signature.{k}", torch.zeros(0)), signature(buckets[k], names))}
    for group, codec in codecs.items():
        codec.load_state_dict({name: t.to(device) for name, t in state.items() if not name.startswith("signature.")
                               and int(name.split(".")[1]) in same and buckets[int(name.split(".")[1])].group == group})
