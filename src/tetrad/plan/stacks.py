"""Software stacks: what a training framework's kernels fuse and what its communication overlaps.

These are properties of a code base, the same for every run it makes (never per-run factors):
the same layout costs more under eager PyTorch than under torch.compile, and Megatron-LM of
2021 had no flash attention. `tetrad estimate` predicts tetrad itself unless told otherwise.
"""

from __future__ import annotations

from dataclasses import dataclass


# elementwise_factor of an eager PyTorch stack (below).
EAGER_ELEMENTWISE = 2.0


@dataclass(frozen=True)
class Stack:
    name: str
    # Attention core: flash-style (scores never in HBM; backward recomputes them) or
    # materialised scores (QK^T and AV as batched GEMMs over the full square, softmax in HBM).
    flash_attention: bool = True
    # HBM traffic of the element-wise ops (norms, residuals, activation, RoPE) relative to fully
    # fused kernels; eager PyTorch runs each as separate kernels with fp32 up-casts.
    elementwise_factor: float = 1.0
    # Mixture-of-experts layers' routing (the dispatch, the routed experts' activation, the
    # weighted combine) runs eagerly between compiled regions (tetrad's model/moe.py under
    # train.compile): its element-wise traffic costs EAGER_ELEMENTWISE whatever the rest costs.
    eager_routing: bool = False
    # Hidden-sized tensors the SwiGLU keeps for backward: gate, up and product when fused;
    # eager autograd also keeps silu(gate).
    swiglu_saved: int = 3
    # Copies of the attention output kept: eager keeps SDPA's own and the output projection's
    # input (a transposed, hence copied, view).
    attn_out_copies: int = 1
    # RMSNorm runs as one fused kernel that keeps its input for backward (torch's on CUDA);
    # otherwise as torch's composite (on CPU), which keeps its input in fp32 and the fp32
    # normalised output: 8 bytes an element, whatever the activations' dtype (memory.as_run).
    fused_rms_norm: bool = True
    # Under SP a column-parallel linear keeps its all-gathered input for backward (torch's
    # SequenceParallel, tetrad) instead of gathering it again there (Megatron-LM, Korthikanti).
    sp_saves_gathered_input: bool = False
    # Tensor-parallel collectives hidden behind GEMMs: "none"; "bwd" (each column-parallel input
    # gradient's all-reduce behind that linear's weight-gradient GEMM); "full" (async TP).
    tp_overlap: str = "bwd"
    # Data-parallel gradient buckets reduced during the last micro-batch's backward.
    dp_overlap: bool = True
    # ZeRO-1/2's all-gather of the updated weights runs bucket by bucket under the next step's
    # first forward (Megatron-Core's overlap_param_gather) instead of after the optimizer step.
    param_gather_overlap: bool = False
    # The attention core's kernel (plan/layer.py's ATTENTION_KERNELS): "flash2" (FlashAttention-2,
    # torch's SDPA flash), "fused" (a Hopper-native kernel: cuDNN's via Transformer Engine, or
    # FlashAttention-3, at the GPU's `fused_attention_efficiency`), "triton" (FlashAttention's
    # 2022-23 Triton kernel).
    attention_kernel: str = "flash2"
    # Pipeline sends carry 1/tp of the activations and all-gather inside the node (Narayanan
    # et al.'s scatter/gather); with sequence parallelism they are 1/tp anyway.
    pp_scatter_gather: bool = False
    # Pipeline sends and receives block the rank (Megatron-LM's paired send/recv around each
    # micro-batch) instead of running beside its compute; their time then counts as bubble.
    pp_blocking_p2p: bool = False
    # Bytes per gradient element in the data-parallel reduction (fp32 unless the stack reduces
    # its 16-bit gradients as they are).
    grad_reduce_bytes: int = 4
    # Weight-gradient GEMMs accumulate straight into the fp32 gradient buffer; otherwise each
    # micro-batch's gradient is added to it (eager autograd: read both, write one).
    fused_grad_accumulation: bool = True
    # ZeRO-1 reduce-scatters the gradients (Megatron's distributed optimizer) rather than
    # all-reducing them and stepping on its shard (tetrad today: twice the ring time).
    zero1_reduce_scatter: bool = True
    # Under pipeline parallelism ZeRO-3 gathers a stage's weights once per step and keeps them,
    # reducing gradients once at the end (torchtitan's FSDP2 with PP): it costs what ZeRO-1 does.
    zero3_held_under_pp: bool = False
    # ZeRO-3's implementation, for the copies it makes every micro-batch (layer.py's `_zero3_copies`):
    # "buckets" (tetrad's: gathers into flat buffers the parameters are views of, gradients added
    # to a full fp32 bucket as unfused accumulation), "fsdp1" (FullyShardedDataParallel's flat
    # parameter), "fsdp2" (fully_shard's per-parameter shards).
    zero3_impl: str = "buckets"
    # Under a split backward (zero-bubble) the head's weight gradient is made in BI, not queued
    # for BW (tetrad's model/llama.py: the queue would keep the logits' gradient alive).
    head_weight_grad_in_bi: bool = False
    # Masked attention (documents, a sliding window) runs the kernel tetrad's runtime chooses
    # (plan/kernels.py): flash's varlen kernel in 16-bit, the whole square under a bias otherwise.
    # Other stacks are costed with flash's causal half (Megatron-LM's THD, flex attention).
    tetrad_attention: bool = False


STACKS: dict[str, Stack] = {s.name: s for s in [
    # tetrad's attention is torch's SDPA (model/attention.py): with a current torch (2.11 seen) it
    # runs cuDNN's fused kernel in bf16/fp16 where torch prefers it (Hopper, Blackwell: seen on an
    # H200 by bench/gpu_check.py) and FlashAttention-2 elsewhere (a GPU with no fused efficiency).
    Stack("tetrad", elementwise_factor=EAGER_ELEMENTWISE, swiglu_saved=4, attn_out_copies=2, fused_grad_accumulation=False,
          sp_saves_gathered_input=True, zero1_reduce_scatter=False, attention_kernel="fused",
          head_weight_grad_in_bi=True, tetrad_attention=True),
    # tetrad with train.compile: inductor fuses each block's element-wise chains (norms, RoPE,
    # SwiGLU, residuals) into one kernel per region between tp/cp collectives, so they cost what
    # fused kernels do (Ansel et al. 2024, "PyTorch 2", ASPLOS, sec. 5: inductor's fusion), and
    # AOT autograd's partitioner saves one SwiGLU tensor and one attention output copy fewer:
    # measured by tetrad's saved-tensor count (2 layers, d 64, ffn 256, 128 tokens, fp32, tp 1):
    # 1,946,132 -> 1,552,916 bytes, per layer one SwiGLU tensor (131,072), one attention output
    # (32,768) and 32,768 more, not counted here. Collectives, the optimizer and an MoE layer's
    # routing stay tetrad's eager ones.
    Stack("tetrad-compiled", eager_routing=True, fused_grad_accumulation=False, sp_saves_gathered_input=True, zero1_reduce_scatter=False,
          attention_kernel="fused", head_weight_grad_in_bi=True, tetrad_attention=True),
    # torch.compile'd PyTorch (torchtitan), Megatron-Core with Transformer Engine.
    Stack("compiled", zero3_held_under_pp=True, sp_saves_gathered_input=True, zero3_impl="fsdp2"),
    # Megatron-LM since 2023 (flash attention, fused kernels, overlapped gradient buckets).
    Stack("megatron", pp_blocking_p2p=True),
    # Megatron-LM of Narayanan et al. 2021: scores materialised, TP and DP collectives synchronous,
    # fp16 gradients all-reduced as they are, scatter/gather pipeline sends.
    Stack("megatron-2021", flash_attention=False, tp_overlap="none", dp_overlap=False, pp_scatter_gather=True,
          pp_blocking_p2p=True, grad_reduce_bytes=2, fused_grad_accumulation=False),
    # PyTorch FSDP without torch.compile (FSDP2 fully_shard over an eager model, e.g. torchtitan
    # eager; FSDP1's copies are `llm-foundry`'s): eager element-wise kernels and
    # autograd's saved tensors as tetrad's own; gradients reduce-scattered per bucket (one per
    # wrapped block) as backward produces them, in fp32 (MixedPrecision reduce_dtype); TP, where
    # used, is DTensor's, with no asynchronous overlap. Source: Zhao et al. 2023, "PyTorch FSDP"
    # (arXiv 2304.11277), sections 3.3-3.4 (backward prefetch, rate limiter, reduce-scatter per unit).
    Stack("fsdp", elementwise_factor=EAGER_ELEMENTWISE, swiglu_saved=4, attn_out_copies=2, fused_grad_accumulation=False,
          sp_saves_gathered_input=True, tp_overlap="none", zero3_impl="fsdp2"),
    # DeepSpeed ZeRO 1-3 over an eager model (Megatron-DeepSpeed, HF + DeepSpeed): eager kernels;
    # gradients reduced in the model's 16-bit dtype (`communication_data_type` defaults to it) and
    # reduce-scattered (`reduce_scatter: true`); its pipeline engine blocks on each send/receive.
    # Sources: DeepSpeed config documentation (deepspeed.ai/docs/config-json, ZeRO section);
    # Rajbhandari et al. 2020 (arXiv 1910.02054) section 7 for ZeRO-3's per-layer gathers.
    Stack("deepspeed", elementwise_factor=EAGER_ELEMENTWISE, swiglu_saved=4, attn_out_copies=2, fused_grad_accumulation=False,
          tp_overlap="none", pp_blocking_p2p=True, grad_reduce_bytes=2),
    # Megatron-Core with Transformer Engine (Megatron-LM's core since 2024, NeMo): the distributed
    # optimizer reduce-scatters gradient buckets in the last micro-batch's backward and all-gathers
    # the updated weights under the next forward (--overlap-grad-reduce, --overlap-param-gather;
    # Megatron-Core's distributed-optimizer documentation), TE's cuDNN fused attention, and its
    # batched pipeline sends and receives. Source: docs.nvidia.com/megatron-core/developer-guide
    # (dist_optimizer, DistributedDataParallelConfig).
    Stack("megatron-core", pp_blocking_p2p=True, param_gather_overlap=True, attention_kernel="fused"),
    # MosaicML's LLM Foundry on Composer (2023): PyTorch FSDP1 over an eager model, as `fsdp`, with
    # FlashAttention's Triton kernel (its MPT configs' `attn_impl: triton`, e.g.
    # scripts/train/yamls/pretrain/mpt-7b.yaml of github.com/mosaicml/llm-foundry); its `DEFAULT`
    # mixed precision gathers 16-bit weights and reduces fp32 gradients (composer/distributed/
    # mosaic_parallelism.py, get_mixed_precision), every micro-batch (Composer's ddp_sync_context
    # enters no_sync only for DDP).
    Stack("llm-foundry", elementwise_factor=EAGER_ELEMENTWISE, swiglu_saved=4, attn_out_copies=2, fused_grad_accumulation=False,
          sp_saves_gathered_input=True, tp_overlap="none", attention_kernel="triton", zero3_impl="fsdp1"),
]}
STACKS["torchtitan"] = STACKS["compiled"]  # the name users know it by


def load_stack(name: str) -> Stack:
    if name not in STACKS:
        raise ValueError(f"unknown software stack {name!r}; known: {', '.join(STACKS)}")
    return STACKS[name]
