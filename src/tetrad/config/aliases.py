"""The names users bring from Megatron-LM's arguments and torchtitan's TOML, and the hints an
unknown key or section is answered with."""

from __future__ import annotations

import dataclasses

from tetrad.config.sections import SECTIONS
from tetrad.config.wording import did_you_mean

# Names users bring from Megatron-LM's arguments and torchtitan's TOML (dashes read as
# underscores): an unknown one is answered with ours (or several, a tuple). torchtitan's
# data_parallel_shard_degree is FSDP's shard size: all of dp without a replicate degree, else
# zero_shard (dp = replicate x shard). Megatron-LM's num_distributed_optimizer_instances counts
# the replicas, dp*cp / zero_shard.
KEY_ALIASES = {
    **dict.fromkeys(("tensor_model_parallel_size", "tensor_parallel_degree", "tp_size"), "parallel.tp"),
    **dict.fromkeys(("pipeline_model_parallel_size", "pipeline_parallel_degree", "pp_size"), "parallel.pp"),
    **dict.fromkeys(("context_parallel_size", "context_parallel_degree", "cp_size"), "parallel.cp"),
    **dict.fromkeys(("data_parallel_size", "data_parallel_replicate_degree", "dp_size"), "parallel.dp"),
    "data_parallel_shard_degree": ("parallel.dp", "parallel.zero_shard"),
    "num_distributed_optimizer_instances": "parallel.zero_shard",
    "virtual_pipeline_model_parallel_size": "parallel.vpp", "pipeline_parallel_schedule": "parallel.schedule",
    "use_distributed_optimizer": "parallel.zero", "num_layers": "model.n_layers", "hidden_size": "model.d_model",
    "dim": "model.d_model", "num_attention_heads": "model.n_heads", "num_query_groups": "model.n_kv_heads",
    "ffn_hidden_size": "model.ffn_hidden", "seq_length": "model.seq_len", "learning_rate": "train.lr",
    "train_iters": "train.steps", "lr_warmup_iters": "train.warmup", "warmup_steps": "train.warmup",
    "global_batch_size": "train.global_batch", "micro_batch_size": "train.micro_batch",
    "rampup_batch_size": "train.batch_rampup",
    "local_batch_size": "train.micro_batch", "clip_grad": "train.grad_clip", "max_norm": "train.grad_clip",
    "lr_decay_style": "train.lr_schedule", "beta1": "train.adam_beta1", "beta2": "train.adam_beta2",
    "eps": "train.adam_eps", "recompute_granularity": "train.recompute",
    "reset_attention_mask": "train.document_mask", "attn_mask_type": "train.document_mask",
    "reset_position_ids": "train.reset_positions",
    "mixed_precision_param": "train.dtype", "eval_interval": "train.eval_every", "eval_iters": "train.eval_steps",
    "data_path": "data.source", "dataset_path": "data.source", "save_interval": "checkpoint.every",
    "interval": "checkpoint.every", "async_mode": "checkpoint.async_save", "log_interval": "run.log_every", "log_freq": "run.log_every",
    "dump_folder": "run.dir", "save": "checkpoint.dir", "load": "checkpoint.dir", "flavor": "model.preset",
    "dataset": "data.source", "mode": "train.recompute",
    **dict.fromkeys(("num_experts", "num_local_experts"), "model.n_experts"),
    **dict.fromkeys(("expert_model_parallel_size", "expert_parallel_size", "ep_size"), "parallel.ep"),
    **dict.fromkeys(("moe_router_topk", "num_experts_per_tok", "top_k"), "model.experts_per_token"),
    **dict.fromkeys(("moe_ffn_hidden_size", "moe_intermediate_size"), "model.expert_ffn_hidden"),
    **dict.fromkeys(("moe_aux_loss_coeff", "router_aux_loss_coef"), "model.router_aux_loss"),
    # torchtitan's load_balance_coeff is its expert-bias update rate, not an auxiliary loss's coefficient
    **dict.fromkeys(("moe_router_bias_update_rate", "load_balance_coeff"), "model.router_bias_update_rate"),
    **dict.fromkeys(("shared_expert_intermediate_size", "moe_shared_expert_intermediate_size"),
                    "model.shared_expert_ffn_hidden"),
    **dict.fromkeys(("norm_topk_prob", "route_norm"), "model.normalize_expert_weights"),
    "mlp_only_layers": "model.dense_layers",
    **dict.fromkeys(("moe_router_score_function", "score_func", "scoring_func"), "model.router_score"),
    **dict.fromkeys(("moe_router_topk_scaling_factor", "route_scale", "routed_scaling_factor"),
                    "model.expert_weight_scale"),
    # Megatron-Core's group score sums a group's k / moe_router_group_topk best scores, tetrad's its
    # model.expert_group_score_top best (2 by default, DeepSeek-V3's and torchtitan's): set it to that quotient
    **dict.fromkeys(("moe_router_num_groups", "num_expert_groups", "n_group"), "model.expert_groups"),
    **dict.fromkeys(("moe_router_group_topk", "num_limited_groups", "topk_group"), "model.expert_groups_per_token"),
    # Megatron-Core's latent attention: its switch (kv_lora_rank > 0 is ours), qk_head_dim the unrotated
    # dims (q_lora_rank, kv_lora_rank, v_head_dim and torchtitan's/HF's qk_*_head_dim are our names)
    "multi_latent_attention": "model.kv_lora_rank", "qk_head_dim": "model.qk_nope_head_dim",
    "qk_pos_emb_head_dim": "model.qk_rope_head_dim",
    # multi-token prediction: Megatron-Core's and HF's names
    "mtp_num_layers": "model.mtp_layers", "num_nextn_predict_layers": "model.mtp_layers",
    "mtp_loss_scaling_factor": "model.mtp_loss_weight",
}
# Megatron-LM's switches (no value) as the override that does what each asks.
FLAG_ALIASES = {"bf16": "train.dtype=bf16", "fp16": "train.dtype=fp16",
                "sequence_parallel": "parallel.sequence_parallel=true", "use_distributed_optimizer": "parallel.zero=1", "recompute_activations": "train.recompute=selective",
                "swiglu": "model.mlp=swiglu", "untie_embeddings_and_output_weights": "model.tie_embeddings=false",
                "add_qkv_bias": "model.qkv_bias=true", "qk_layernorm": "model.qk_norm=true",
                # its bias update rate's default, which that flag turns on
                "moe_router_enable_expert_bias": "model.router_bias_update_rate=0.001",
                "multi_latent_attention": "model.kv_lora_rank=512"}  # Megatron-Core's default rank
# torchtitan's tables whose keys live in one of ours.
SECTION_ALIASES = {"optimizer": "train", "lr_scheduler": "train", "activation_checkpoint": "train",
                   "job": "run", "metrics": "run", "parallelism": "parallel"}


def places_of(key: str, section: str | None = None) -> list[str]:
    """Where `key` (unknown in `section`) is a config key, as 'section.key': in other sections, or
    ours for a Megatron-LM/torchtitan name."""
    key = key.replace("-", "_")
    homes = [f"{name}.{key}" for name, cls in SECTIONS.items()
             if name != section and key in {f.name for f in dataclasses.fields(cls)}]
    alias = KEY_ALIASES.get(key, ())
    return homes or (list(alias) if isinstance(alias, tuple) else [alias])


def suggest_key(section: str, key: str) -> str:
    """' (did you mean ...?)' for an unknown key of `section`, or ''."""
    places = places_of(key, section)
    known = [f.name for f in dataclasses.fields(SECTIONS[section])]
    return f" (did you mean {' or '.join(map(repr, places))}?)" if places else did_you_mean(key, known, section)


def suggest_section(section: str) -> str:
    """' (did you mean ...?)' for an unknown section, or ''."""
    return f" (did you mean {SECTION_ALIASES[section]!r}?)" if section in SECTION_ALIASES else \
        did_you_mean(section, SECTIONS)
