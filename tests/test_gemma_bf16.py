"""Gemma's roundings in bf16, which tests/test_gemma.py's fp32 logits cannot see: the embedding
times sqrt(d_model) rounded to bf16 first (sqrt(72) = 8.485 is 8.5 there), and Gemma's RMSNorm
times (1 + weight) in fp32 before its one rounding. tetrad's model in bf16 gives transformers'
bf16 tensors bit for bit at the first layer's input and its norm's output (either rounding done
otherwise changes about a third of them); the export's refusals of what its config cannot say."""

import pytest
import torch

from conftest import tiny_config, write_hf_gemma
from tetrad.cli import main
from tetrad.config import ConfigError
from tetrad.train.convert import read_weights
from tetrad.train.generate import single_process_model
from tetrad.train.hf_architectures import check_exportable

transformers = pytest.importorskip("transformers")


def test_gemma_in_bf16_embeds_and_norms_as_transformers_bit_for_bit(tmp_path):
    write_hf_gemma(tmp_path / "hf", hidden_size=72)
    assert main(["convert", str(tmp_path / "hf"), "--to-tetrad", str(tmp_path / "ckpt")]) == 0
    cfg, state = read_weights(tmp_path / "ckpt")
    theirs = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "hf", dtype=torch.bfloat16,
                                                               attn_implementation="eager").eval()
    ours = single_process_model(cfg.model, state, dtype=torch.bfloat16)
    seen = {}

    def keep(key, output=False):
        def hook(module, args, *out):
            seen[key] = (out[0] if output else args[0]).detach()
        return hook
    theirs.model.layers[0].register_forward_pre_hook(keep("their input"))
    theirs.model.layers[0].input_layernorm.register_forward_hook(keep("their norm", output=True))
    ours.layers["0"].register_forward_pre_hook(keep("our input"))
    ours.layers["0"].attn_norm.register_forward_hook(keep("our norm", output=True))
    tokens = torch.randint(0, 256, (2, 32), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        theirs(tokens), ours(tokens, torch.arange(32))
    assert seen["our input"].dtype == torch.bfloat16
    assert torch.equal(seen["our input"], seen["their input"])
    assert torch.equal(seen["our norm"], seen["their norm"])


GEMMA3 = {"norm": "gemma_rmsnorm", "mlp": "geglu", "scale_embeddings": True, "sandwich_norm": True, "qk_norm": True,
          "sliding_window": 5, "layer_types": ["sliding_attention", "full_attention"], "rope_local_base_freq": 100.0,
          "rope_scaling": {"rope_type": "linear", "factor": 8.0}}
GEMMA1 = {**GEMMA3, "sandwich_norm": False, "qk_norm": False, "sliding_window": 0, "layer_types": [],
          "rope_local_base_freq": 0.0, "rope_scaling": {}}


@pytest.mark.parametrize("model,named", [
    # GemmaForCausalLM's config as written has no RoPE scaling: transformers would not scale
    ({**GEMMA1, "rope_scaling": {"rope_type": "linear", "factor": 8.0}}, "rope_scaling"),
    # every Gemma rotates the whole head
    ({**GEMMA3, "partial_rotary_factor": 0.5}, "partial_rotary_factor"),
    # the sliding layers scaled as the global ones: transformers 4 and tetrad's import read it unscaled
    ({**GEMMA3, "rope_local_base_freq": 0.0}, "rope_local_base_freq")])
def test_a_gemma_whose_config_json_cannot_say_it_is_refused_before_export(model, named):
    with pytest.raises(ConfigError, match=named) as refused:
        check_exportable(tiny_config(model=model).model)
    assert "\n" not in str(refused.value)
