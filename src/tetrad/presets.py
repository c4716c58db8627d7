"""Model presets: named shapes that fill the `[model]` section before the user's own keys apply.

Shapes follow the published model cards (Llama 3 paper, Table 3; GPT-3 paper, Table 2.1; Mixtral's
and GLM-4.5-Air's config.json).
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
    # pre-training context, 4096 (the 32k and 128k stages extend it).
    "glm-4.5-air": dict(n_layers=46, d_model=4096, n_heads=96, n_kv_heads=8, head_dim=128, ffn_hidden=10944,
                        vocab_size=151552, seq_len=4096, norm="rmsnorm", mlp="swiglu", pos="rope",
                        tie_embeddings=False, rope_theta=1000000.0, norm_eps=1e-5, partial_rotary_factor=0.5,
                        qkv_bias=True, n_experts=128, experts_per_token=8, expert_ffn_hidden=1408,
                        shared_expert_ffn_hidden=1408, dense_layers=[0], router_score="sigmoid"),
    "gpt3-175b": dict(n_layers=96, d_model=12288, n_heads=96, n_kv_heads=96, ffn_hidden=49152, vocab_size=50257,
                      seq_len=2048, norm="layernorm", mlp="gelu", pos="learned", tie_embeddings=True,
                      rope_theta=10000.0, norm_eps=1e-5),
}
