"""Model presets: named shapes that fill the `[model]` section before the user's own keys apply.

Shapes follow the published model cards (Llama 3 paper, Table 3; GPT-3 paper, Table 2.1; Mixtral's,
GLM-4.5-Air's and DeepSeek's config.json).
"""

from __future__ import annotations

_LLAMA3 = dict(norm="rmsnorm", mlp="swiglu", pos="rope", tie_embeddings=False, vocab_size=128256,
               rope_theta=500000.0, norm_eps=1e-5, seq_len=8192)

PRESETS: dict[str, dict] = {
    # Small enough for 8 CPU ranks: 4 layers (pp=2 x vpp=2), heads and KV heads divisible by 2,
    # seq_len divisible by 2*cp for cp in {1, 2, 4}; byte-level vocabulary.
    "tiny": dict(n_layers=4, d_model=128, n_heads=4, n_kv_heads=2, ffn_hidden=384, vocab_size=256,
                 seq_len=128, norm="rmsnorm", mlp="swiglu", pos="rope", tie_embeddings=False,
                 rope_theta=10000.0, norm_eps=1e-5),
    # The learned-position GPT variant at the same size.
    "tiny-gpt": dict(n_layers=4, d_model=128, n_heads=4, n_kv_heads=4, ffn_hidden=512, vocab_size=256,
                     seq_len=128, norm="layernorm", mlp="gelu", pos="learned", tie_embeddings=True,
                     rope_theta=10000.0, norm_eps=1e-5),
    "llama3-8b": dict(n_layers=32, d_model=4096, n_heads=32, n_kv_heads=8, ffn_hidden=14336, **_LLAMA3),
    "llama3-70b": dict(n_layers=80, d_model=8192, n_heads=64, n_kv_heads=8, ffn_hidden=28672, **_LLAMA3),
    "llama3-405b": dict(n_layers=126, d_model=16384, n_heads=128, n_kv_heads=8, ffn_hidden=53248, **_LLAMA3),
    # Mixtral 8x7B (Jiang et al. 2024, "Mixtral of Experts"; its config.json): Mistral 7B's
    # shape with 8 SwiGLU experts of 14336, top-2, in every layer; trained at a 32k context.
    "mixtral-8x7b": dict(n_layers=32, d_model=4096, n_heads=32, n_kv_heads=8, ffn_hidden=14336, vocab_size=32000,
                         seq_len=32768, norm="rmsnorm", mlp="swiglu", pos="rope", tie_embeddings=False,
                         rope_theta=1000000.0, norm_eps=1e-5, n_experts=8, experts_per_token=2),
    # GLM-4.5-Air (Zhipu's config.json; transformers' Glm4MoeConfig defaults): 128 SwiGLU experts of
    # 1408, top-8 of sigmoid scores, an ungated shared expert of 1408, the first layer dense (10944),
    # heads of 128 (96 of them over d 4096), RoPE on half of each, biases on q, k and v; its
    # pre-training context, 4096 (the 32k and 128k stages extend it). One multi-token-prediction module
    # (num_nextn_predict_layers 1), an MoE layer: 2.38B more, 109.2B in all; the card's 106B total and
    # 12B active leave it out (a test).
    "glm-4.5-air": dict(n_layers=46, d_model=4096, n_heads=96, n_kv_heads=8, head_dim=128, ffn_hidden=10944,
                        vocab_size=151552, seq_len=4096, norm="rmsnorm", mlp="swiglu", pos="rope",
                        tie_embeddings=False, rope_theta=1000000.0, norm_eps=1e-5, partial_rotary_factor=0.5,
                        qkv_bias=True, n_experts=128, experts_per_token=8, expert_ffn_hidden=1408,
                        shared_expert_ffn_hidden=1408, dense_layers=[0], router_score="sigmoid", mtp_layers=1),
    # DeepSeek-V3 (its config.json; DeepSeek-V3 technical report, arXiv 2412.19437): multi-head latent
    # attention (128 heads, q and kv latents of 1536 and 512, heads of 128 + 64 rotated, values of
    # 128), the first 3 layers dense (18432), then 256 SwiGLU experts of 2048 and a shared one, top-8
    # of sigmoid scores within 4 of 8 groups, normalised and scaled by 2.5; expert biases moved by
    # 0.001 a step and a sequence-wise balance loss of 0.0001 (the report's pre-training values). Its
    # 4096 pre-training context: config.json's YaRN rope_scaling (factor 40, to 160k) is left out
    # (the planner needs none). One multi-token-prediction module (num_nextn_predict_layers 1; the
    # report's D = 1), an MoE layer: 671.0B parameters and 11.6B of it, 682.6B (37.6B and 38.2B active;
    # the card's 671B + 14B = 685B counts the module's own copies of the embedding and the head, 1.85B,
    # which tetrad shares with the model's; a test).
    "deepseek-v3": dict(n_layers=61, d_model=7168, n_heads=128, n_kv_heads=128, ffn_hidden=18432,
                        vocab_size=129280, seq_len=4096, norm="rmsnorm", mlp="swiglu", pos="rope",
                        tie_embeddings=False, rope_theta=10000.0, norm_eps=1e-6, kv_lora_rank=512,
                        q_lora_rank=1536, qk_nope_head_dim=128, qk_rope_head_dim=64, v_head_dim=128,
                        n_experts=256, experts_per_token=8, expert_ffn_hidden=2048, shared_expert_ffn_hidden=2048,
                        dense_layers=[0, 1, 2], router_score="sigmoid", expert_weight_scale=2.5, expert_groups=8,
                        expert_groups_per_token=4, router_bias_update_rate=0.001, router_aux_loss=0.0001,
                        mtp_layers=1),
    # DeepSeek-V2 (its config.json; arXiv 2405.04434): latent attention as DeepSeek-V3's over d_model
    # 5120, the first layer dense (12288), then 160 SwiGLU experts of 1536 and two shared (one of
    # 3072), top-6 of the softmax within 3 of 8 groups each scored by its best expert
    # (group_limited_greedy), not renormalised, scaled by 16; balance loss 0.003. YaRN left out as
    # DeepSeek-V3's. 235.7B parameters, 21.4B active (the card's 236B and 21B; a test).
    "deepseek-v2": dict(n_layers=60, d_model=5120, n_heads=128, n_kv_heads=128, ffn_hidden=12288,
                        vocab_size=102400, seq_len=4096, norm="rmsnorm", mlp="swiglu", pos="rope",
                        tie_embeddings=False, rope_theta=10000.0, norm_eps=1e-6, kv_lora_rank=512,
                        q_lora_rank=1536, qk_nope_head_dim=128, qk_rope_head_dim=64, v_head_dim=128,
                        n_experts=160, experts_per_token=6, expert_ffn_hidden=1536, shared_expert_ffn_hidden=3072,
                        dense_layers=[0], normalize_expert_weights=False, expert_weight_scale=16.0, expert_groups=8,
                        expert_groups_per_token=3, expert_group_score_top=1, router_aux_loss=0.003),
    # DeepSeek-V2-Lite (its config.json; DeepSeek-V2 paper, arXiv 2405.04434): latent attention without
    # a query latent (16 heads), the first layer dense (10944), then 64 SwiGLU experts of 1408 and two
    # shared (one of 2816), top-6 of the softmax, not renormalised; balance loss 0.001. YaRN left out as
    # DeepSeek-V3's. 15.7B parameters, 2.66B active (the card's 15.7B and 2.4B, which leaves the
    # embedding out: 2.45B; a test).
    "deepseek-v2-lite": dict(n_layers=27, d_model=2048, n_heads=16, n_kv_heads=16, ffn_hidden=10944,
                             vocab_size=102400, seq_len=4096, norm="rmsnorm", mlp="swiglu", pos="rope",
                             tie_embeddings=False, rope_theta=10000.0, norm_eps=1e-6, kv_lora_rank=512,
                             q_lora_rank=0, qk_nope_head_dim=128, qk_rope_head_dim=64, v_head_dim=128,
                             n_experts=64, experts_per_token=6, expert_ffn_hidden=1408, shared_expert_ffn_hidden=2816,
                             dense_layers=[0], normalize_expert_weights=False, router_aux_loss=0.001),
    "gpt3-175b": dict(n_layers=96, d_model=12288, n_heads=96, n_kv_heads=96, ffn_hidden=49152, vocab_size=50257,
                      seq_len=2048, norm="layernorm", mlp="gelu", pos="learned", tie_embeddings=True,
                      rope_theta=10000.0, norm_eps=1e-5),
}
