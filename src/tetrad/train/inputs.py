"""[model] keys a raw config's inputs decide, for `load_config(model_from_inputs=...)`: every
command checks a config through it before anything else, so it loads torch's checkpoint stack
(init_from.py: DCP, safetensors; about 1.5 s) only when `checkpoint.init_from` names weights,
and a one-line config refusal comes back in a fraction of a second."""

from __future__ import annotations

from tetrad.data import shards


def model_keys(raw: dict) -> dict:
    """The data's vocabulary, then the shape of the weights `checkpoint.init_from` names (what a
    load needs, whatever the data says)."""
    keys = shards.model_keys(raw)
    source = raw.get("checkpoint", {}).get("init_from")
    if isinstance(source, str) and source:
        from tetrad.train.init_from import weights_model_keys  # deferred for start-up time (docstring)
        keys.update(weights_model_keys(source))
    return keys
