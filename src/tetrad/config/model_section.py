"""The config's [model] section: the architecture, its keys named as in the other sections
(config/sections.py, which re-exports it). A contract like them (docs/design.md)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal, Union

ROPE_SCALING_KEYS = ("rope_type", "factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings")
LONGROPE_KEYS = ("rope_type", "short_factor", "long_factor", "original_max_position_embeddings", "attention_factor")


@dataclass
class ModelConfig:
    preset: str = "tiny"
    n_layers: int = 4
    d_model: int = 128
    n_heads: int = 4
    n_kv_heads: int = 2
    ffn_hidden: int = 384
    vocab_size: int = 256
    seq_len: int = 128
    # The longest sequence the model is meant for, beyond the seq_len it trains at (Megatron-LM's
    # --max-position-embeddings, HF's max_position_embeddings): how far `tetrad generate` reads
    # and what `convert --to-hf` writes, seq_len where that is longer (0: seq_len). An imported
    # model keeps its own, so a Llama 3.1 fine-tuned at seq_len 4096 still generates and exports
    # as the 128k model it is, and one trained past its original context exports the longer.
    max_position_embeddings: int = 0
    # "gemma_rmsnorm": Gemma's, in fp32, times (1 + weight): weights stored as offsets from one.
    norm: Literal["rmsnorm", "layernorm", "gemma_rmsnorm"] = "rmsnorm"
    # "geglu": Gemma's gated MLP, gelu (tanh form) of the gate times up, where SwiGLU takes silu.
    mlp: Literal["swiglu", "gelu", "geglu"] = "swiglu"
    pos: Literal["rope", "learned"] = "rope"
    tie_embeddings: bool = False
    # Biases on the q, k and v projections, as Qwen2 / Qwen2.5 have (HF's Llama `attention_bias`
    # puts one on the output projection too, which tetrad has not).
    qkv_bias: bool = False
    rope_theta: float = 10000.0
    # RoPE frequency scaling (model/rope.py rope_frequencies); empty: none. Llama 3.1's, as HF's
    # config.json holds it: {rope_type = "llama3", factor = 8.0, low_freq_factor = 1.0,
    # high_freq_factor = 4.0, original_max_position_embeddings = 8192}. Phi-3's LongRoPE (Phi-3
    # mini 128k, Phi-3.5, phi-4-mini): {rope_type = "longrope", short_factor = [...], long_factor =
    # [...], original_max_position_embeddings = 4096, attention_factor = 1.19}, a factor per
    # rotated pair (rotary_dim / 2 of them) dividing its frequency, long_factor's for a sequence
    # longer than original_max_position_embeddings, cos and sin times attention_factor. YaRN
    # (DeepSeek-V2/V3, Qwen2.5/Qwen3 long context, gpt-oss): {rope_type = "yarn", factor = 4.0,
    # original_max_position_embeddings = 32768} and, as HF's, beta_fast (32), beta_slow (1),
    # mscale, mscale_all_dim, attention_factor (cos and sin's multiplier; else inferred from
    # factor and the two mscales) and truncate (true) where wanted; factor is required.
    rope_scaling: dict[str, Union[str, float, bool, list[float]]] = field(default_factory=dict)
    # RoPE on the first rotary_dim = int(head_dim * partial_rotary_factor) dims of each head
    # (phi-4-mini: 0.75); the others pass through unrotated.
    partial_rotary_factor: float = 1.0
    norm_eps: float = 1e-5  # every norm's but latent attention's two latent norms (1e-6, as DeepSeek's)
    dropout: float = 0.0
    # Width of each attention head; 0: d_model / n_heads. Qwen3 and Mistral NeMo set their own
    # (Qwen3-4B: 32 heads of 128 over d_model 2560), so q and the attention output are
    # n_heads * head_dim wide, not d_model.
    head_dim: int = 0
    # An RMSNorm over each head of q and of k before RoPE (Qwen3's q_norm and k_norm): one weight
    # of head_dim shared by every head, whose gradient each tp rank makes from its own heads.
    qk_norm: bool = False
    # Sliding-window attention (Mistral v0.1's `sliding_window`, Qwen2's with use_sliding_window):
    # a query at position i sees the keys j with i - sliding_window < j <= i, itself included;
    # 0: every earlier key (model/masks.py). A window of seq_len or more hides nothing.
    sliding_window: int = 0
    # HF's layer_types: "sliding_attention" or "full_attention" per layer (Gemma 3); empty: all alike.
    layer_types: list[str] = field(default_factory=list)
    # RoPE theta of layer_types' sliding layers, unscaled (Gemma 3's rope_local_base_freq, 10000):
    # rope_theta and rope_scaling are then the full layers' alone. 0: every layer takes those.
    rope_local_base_freq: float = 0.0
    # The attention's softmax scale is query_pre_attn_scalar ** -0.5 (HF Gemma's); 0: head_dim's.
    query_pre_attn_scalar: float = 0.0
    # Gemma 3's sandwich norms on the attention's and the MLP's outputs before the residual add.
    sandwich_norm: bool = False
    # The token embedding times sqrt(d_model), rounded to the activations' dtype (Gemma's).
    scale_embeddings: bool = False
    # The Hugging Face architecture `tetrad convert --to-hf` writes where several compute the model:
    # "" picks Llama's, Mistral's, Qwen2's or Qwen3's from the keys above; "phi3" Phi3ForCausalLM's
    # fused q/k/v and gate/up tensors where Phi-3 has the features (an imported Phi-3 keeps it,
    # fine-tuned too). The same math either way.
    hf_model_type: Literal["", "phi3"] = ""
    # Mixture of experts (Mixtral, Qwen2-MoE, Qwen3-MoE, GLM-4.5; model/moe.py): every layer's MLP, but
    # dense_layers', is n_experts experts of the model's `mlp` kind and a router sending each token
    # to experts_per_token of them (top-k of the router's scores), dropless; 0: a dense MLP in every
    # layer. expert_ffn_hidden: each expert's hidden width (Qwen3-MoE's moe_intermediate_size; 0:
    # ffn_hidden, Mixtral's). router_aux_loss: the coefficient of the sequence-wise load-balancing
    # loss added to the training loss (0: none; not in val_loss). normalize_expert_weights: the k
    # weights renormalised to sum to one (Mixtral, Qwen3-MoE; Qwen2-MoE's norm_topk_prob=false
    # keeps the softmax's). shared_expert_ffn_hidden: the hidden width of a shared expert every MoE
    # layer adds, a dense MLP every token goes through beside its k (Qwen2-MoE's
    # shared_expert_intermediate_size, DeepSeek-MoE's n_shared_experts x moe_intermediate_size);
    # 0: none. shared_expert_gate: its output scaled per token by sigmoid(x . w) (Qwen2-MoE's).
    # dense_layers: the layers (0-based) whose MLP is a dense ffn_hidden-wide one in an MoE model
    # (Qwen2-MoE's mlp_only_layers and decoder_sparse_step, DeepSeek's first_k_dense_replace); not
    # every layer (that model is a dense one: n_experts=0). router_bias_update_rate: DeepSeek-V3's
    # expert bias (added to the scores to pick the top k alone), moved by it each step (0: kept).
    # DeepSeek-V3's routing (model/routing.py): router_score "sigmoid" (its scores; top-k weights
    # renormalised with normalize_expert_weights), expert_weight_scale (the routed experts' weights
    # times it: its routed_scaling_factor), expert_groups (equal groups of experts, in index order)
    # of which each token picks within its expert_groups_per_token best (1 group: no limit), a
    # group scored by the sum of its expert_group_score_top best scores (+ bias): 2, DeepSeek-V3's
    # (torchtitan's); 1, its best expert: DeepSeek-V2's softmax group_limited_greedy (V2, V2.5,
    # Coder-V2); Megatron-Core sums k / moe_router_group_topk of them, which is that number here
    # (2 at DeepSeek-V3's top-8 of 4 groups). It scores groups: with expert_groups 1 it stays 2.
    n_experts: int = 0
    experts_per_token: int = 2
    expert_ffn_hidden: int = 0
    router_aux_loss: float = 0.01
    router_bias_update_rate: float = 0.0
    normalize_expert_weights: bool = True
    shared_expert_ffn_hidden: int = 0
    shared_expert_gate: bool = False
    dense_layers: list[int] = field(default_factory=list)
    router_score: Literal["softmax", "sigmoid"] = "softmax"
    expert_weight_scale: float = 1.0
    expert_groups: int = 1
    expert_groups_per_token: int = 1
    expert_group_score_top: int = 2
    # Multi-head latent attention (DeepSeek-V2/V3; Megatron-Core's multi_latent_attention):
    # kv_lora_rank > 0 makes every head's keys and values from one kv_lora_rank-wide latent of the
    # token, and its queries from a q_lora_rank-wide one (0: a full query projection, as
    # DeepSeek-V2-Lite). A head's query and key are qk_nope_head_dim unrotated dims then
    # qk_rope_head_dim rotated ones (the key's rotated dims one vector every head shares); its
    # value is v_head_dim wide. head_dim is then their query/key width, nope + rope; n_kv_heads
    # equals n_heads. 0: ordinary (grouped-query) attention, and the four below unused.
    kv_lora_rank: int = 0
    q_lora_rank: int = 0
    qk_nope_head_dim: int = 128
    qk_rope_head_dim: int = 64
    v_head_dim: int = 128
    # Multi-token prediction (DeepSeek-V3's MTP; Megatron-Core's mtp_num_layers, HF's
    # num_nextn_predict_layers): mtp_layers sequential modules after the last layer, the k-th
    # predicting the token k + 1 ahead of each position from the (k-1)-th's hidden state (the
    # first's: the model's output, after the final norm) and the embedding of the token k ahead,
    # through one transformer layer of its own (index n_layers + k - 1: an MoE one where the
    # model's last layers are) and the model's embedding and head.
    # Their summed token losses, over the step's loss_tokens as the main loss, join the training
    # objective times mtp_loss_weight / mtp_layers (Megatron's mtp_loss_scaling_factor; DeepSeek-V3
    # 0.3, then 0.1); not in `loss` or val_loss; metrics' mtp_loss: each depth's mean token loss.
    # On the last pipeline stage, which then holds a copy of the embedding. RoPE only; not with layer_types. 0: none.
    mtp_layers: int = 0
    mtp_loss_weight: float = 0.1

    def __post_init__(self):
        if not self.head_dim and self.n_heads > 0:
            self.head_dim = self.qk_nope_head_dim + self.qk_rope_head_dim if self.latent_attention \
                else self.d_model // self.n_heads

    @property
    def latent_attention(self) -> bool:
        """Whether attention is multi-head latent attention (kv_lora_rank > 0)."""
        return self.kv_lora_rank > 0

    @property
    def gated_mlp(self) -> bool:
        return self.mlp in ("swiglu", "geglu")  # gate, up and down: three matrices

    def window_of(self, layer: int) -> int:
        """Layer `layer`'s sliding window (0: none): sliding_window, but in layer_types' full layers."""
        return 0 if self.layer_types and self.layer_types[layer] == "full_attention" else self.sliding_window

    def local_rope(self, layer: int) -> bool:
        """Whether layer `layer` takes the sliding layers' RoPE (rope_local_base_freq, unscaled)."""
        return bool(self.rope_local_base_freq and self.layer_types) and self.layer_types[layer] == "sliding_attention"

    def moe_layer(self, layer: int) -> bool:
        """Whether layer `layer`'s MLP is a mixture of experts (n_experts, and not in dense_layers)."""
        return bool(self.n_experts) and layer not in self.dense_layers

    @property
    def moe_layers(self) -> int:
        """How many layers' MLP is a mixture of experts (moe_layer)."""
        return sum(map(self.moe_layer, range(self.n_layers)))

    @property
    def routed_layers(self) -> int:
        """How many mixture-of-experts layers a training step runs: moe_layers and multi-token
        prediction's depths' (their layers n_layers + k), as Megatron-LM counts them for the
        load-balancing loss's mean."""
        return sum(map(self.moe_layer, range(self.n_layers + self.mtp_layers)))

    @property
    def weighs_experts(self) -> bool:
        """Whether a token's experts' outputs are weighed by the router: not at top-1 with normalized
        weights, each w / w = 1 (model/moe.py takes the one output as it is; the router then learns
        through the load-balancing loss alone)."""
        return not (self.normalize_expert_weights and self.experts_per_token == 1)

    @property
    def expert_hidden(self) -> int:
        """Each expert's hidden width: expert_ffn_hidden, or ffn_hidden where that is 0."""
        return self.expert_ffn_hidden or self.ffn_hidden

    @property
    def context_length(self) -> int:
        """The most tokens the model reads in one sequence: max_position_embeddings, or seq_len
        where that is longer."""
        return max(self.max_position_embeddings, self.seq_len)

    @property
    def rotary_dim(self) -> int:
        """The dims of each head RoPE rotates, as transformers counts them (latent attention's
        qk_rope_head_dim)."""
        return self.qk_rope_head_dim if self.latent_attention else int(self.head_dim * self.partial_rotary_factor)
