"""Validation of multi-head latent attention's keys (model.kv_lora_rank and the head widths)."""

from __future__ import annotations

from tetrad.config.model_section import ModelConfig
from tetrad.config.sections import ConfigError


def check_latent_attention(m: ModelConfig) -> None:
    """Latent attention's keys, where model.kv_lora_rank turns it on."""
    if m.latent_attention:
        raise ConfigError(f"model.kv_lora_rank={m.kv_lora_rank} asks for multi-head latent attention, which this "
                          "version of tetrad does not run yet; set kv_lora_rank=0")
