"""Tiny random Hugging Face Mamba-2 models and what the tests do with them (nothing is
downloaded), shared by the tests of integrations/hf/."""
import pytest
import torch

transformers = pytest.importorskip("transformers")

from transformers.models.mamba2.modeling_mamba2 import Mamba2Mixer  # noqa: E402

OURS = ("causal_conv1d_fn", "causal_conv1d_update", "selective_state_update", "mamba_chunk_scan_combined")

# Which of transformers' two mixer structures is installed (read here, not from the module under
# test): 5.3's mixer has torch_forward and cuda_kernels_forward; 5.17's (from 5.15 on) has one
# forward that calls module functions with a torch fallback.
STRUCTURE_5_3 = hasattr(Mamba2Mixer, "cuda_kernels_forward")
# The module-level name the mixer calls for each of our functions.
MODULE_NAMES = dict(zip(OURS, OURS if STRUCTURE_5_3 else (
    "causal_conv1d_fn", "causal_conv1d_update", "mamba2_selective_state_update", "mamba2_chunk_scan")))
# 5.25's: the mixer calls them through per-mixer wrappers (kernels' use_kernelized_func), whose
# class forward is transformers' own function.
STRUCTURE_5_25 = "causal_conv1d_forward" in vars(modeling_mamba2_module := __import__(
    "transformers.models.mamba2.modeling_mamba2", fromlist=["_"]))
only_5_17 = pytest.mark.skipif(STRUCTURE_5_3, reason=f"transformers {transformers.__version__} has 5.3's mixer")
only_5_3 = pytest.mark.skipif(not STRUCTURE_5_3, reason=f"transformers {transformers.__version__} has 5.17's mixer")



def spy_on_transformers(monkeypatch, module, name, spy):
    """Makes transformers' own function ``name`` of modeling ``module`` call ``spy(*args, _theirs=...,
    **kwargs)`` where the mixer reaches it: the module-level name (5.3 to 5.24), the function the
    wrapper class's forward runs (5.25: the ``func`` of its closure)."""
    theirs = getattr(module, name)
    if STRUCTURE_5_25:
        forward = type(theirs).forward
        cell = forward.__closure__[forward.__code__.co_freevars.index("func")]
        function = cell.cell_contents
        monkeypatch.setattr(cell, "cell_contents", lambda *a, **k: spy(*a, _theirs=function, **k))
    else:
        monkeypatch.setattr(module, name, lambda *a, **k: spy(*a, _theirs=theirs, **k))


VOCAB = 128
NEW_TOKENS = 12


def tiny_config(**overrides):
    kw = dict(vocab_size=VOCAB, hidden_size=64, num_hidden_layers=2, num_heads=4, head_dim=32, expand=2,
              state_size=16, n_groups=2, chunk_size=16, conv_kernel=4, pad_token_id=0, eos_token_id=1,
              bos_token_id=1)
    kw.update(overrides)
    return transformers.Mamba2Config(**kw)


def tiny_mamba2(dtype=torch.float32, device="cpu", seed=0, **overrides):
    torch.manual_seed(seed)
    return transformers.Mamba2ForCausalLM(tiny_config(**overrides)).to(device=device, dtype=dtype).eval()


def prompt(batch=2, tokens=37, device="cpu", seed=1):
    gen = torch.Generator().manual_seed(seed)
    return torch.randint(2, VOCAB, (batch, tokens), generator=gen).to(device)


def greedy(model, ids, **kw):
    with torch.no_grad():
        return model.generate(ids, max_new_tokens=NEW_TOKENS, min_new_tokens=NEW_TOKENS, do_sample=False, **kw)


def logits(model, ids, **kw):
    with torch.no_grad():
        return model(ids, **kw).logits


def expected_calls(layers, prompts=1, decode_steps=NEW_TOKENS - 1):
    return {"causal_conv1d_fn": layers * prompts, "mamba_chunk_scan_combined": layers * prompts,
            "causal_conv1d_update": layers * decode_steps, "selective_state_update": layers * decode_steps}


def cache_tensors(cache):
    """The tensors a Mamba2 model's cache keeps, in a fixed order: 5.3's Mamba2Cache holds all
    layers in two tensors; a DynamicCache (5.17) a conv and a recurrent state per layer."""
    if hasattr(cache, "ssm_states"):
        return [cache.conv_states, cache.ssm_states]
    return [state for layer in cache.layers for state in (layer.conv_states[0], layer.recurrent_states[0])]


def assert_logits_close(ours, ref, tol=1e-4):
    err = (ours.float() - ref.float()).abs().max().item()
    assert err <= tol * max(1.0, ref.abs().max().item()), f"max |ours - torch path| = {err}"


# Tiny random configs of the hybrids the patch supports (transformers' own classes).
HYBRIDS = {
    "bamba": lambda: transformers.BambaConfig(
        num_hidden_layers=3, attn_layer_indices=[1], mamba_n_heads=4, mamba_d_head=32, mamba_n_groups=2,
        mamba_d_state=16, mamba_chunk_size=16, **HYBRID_COMMON),
    "granitemoehybrid": lambda: transformers.GraniteMoeHybridConfig(
        num_hidden_layers=3, layer_types=["mamba", "attention", "mamba"], num_local_experts=4,
        num_experts_per_tok=2, shared_intermediate_size=64, mamba_n_heads=4, mamba_d_head=32, mamba_n_groups=2,
        mamba_d_state=16, mamba_chunk_size=16, **HYBRID_COMMON),
    "nemotron_h": lambda: transformers.NemotronHConfig(
        num_hidden_layers=3, layers_block_type=["mamba", "attention", "mamba"], head_dim=16, ssm_state_size=16,
        mamba_num_heads=4, mamba_n_groups=2, mamba_head_dim=16, mamba_chunk_size=16, **HYBRID_COMMON),
    "zamba2": lambda: transformers.Zamba2Config(
        num_hidden_layers=2, layers_block_type=["mamba", "hybrid"], mamba_d_state=16, n_mamba_heads=4,
        mamba_ngroups=2, chunk_size=16, num_mem_blocks=1, adapter_rank=8, use_mem_rope=True, **HYBRID_COMMON),
}
FALCON_H1 = lambda **kw: transformers.FalconH1Config(  # noqa: E731
    num_hidden_layers=2, mamba_d_ssm=128, mamba_n_heads=4, mamba_d_head=32, mamba_n_groups=2, mamba_d_state=16,
    mamba_chunk_size=16, **kw, **HYBRID_COMMON)
HYBRIDS_5_17 = {"falcon_h1": lambda: FALCON_H1(), "falcon_h1-rmsnorm": lambda: FALCON_H1(mamba_rms_norm=True)}
PROMPT_BATCH = {"falcon_h1-rmsnorm": 1}
# The mixture-of-experts hybrids: GraniteMoeHybrid's default above has experts (and a shared
# expert); NemotronH with a "moe" layer (routed experts in one group, a shared expert).
MOE_HYBRIDS = {
    "granitemoehybrid": HYBRIDS["granitemoehybrid"],
    "nemotron_h-moe": lambda: transformers.NemotronHConfig(
        num_hidden_layers=3, layers_block_type=["mamba", "moe", "attention"], n_routed_experts=4,
        num_experts_per_tok=2, n_group=1, topk_group=1, moe_intermediate_size=32,
        moe_shared_expert_intermediate_size=32, head_dim=16, ssm_state_size=16, mamba_num_heads=4, mamba_n_groups=2,
        mamba_head_dim=16, mamba_chunk_size=16, **HYBRID_COMMON),
}
HYBRID_COMMON = dict(vocab_size=VOCAB, hidden_size=64, num_attention_heads=4, num_key_value_heads=2,
                     intermediate_size=64, pad_token_id=0, eos_token_id=1, bos_token_id=1)


def tiny_hybrid(model_type, device="cpu", dtype=torch.float32, seed=5, **overrides):
    """A random model of HYBRIDS (or HYBRIDS_5_17) with sdpa attention; ``overrides`` set on its config."""
    torch.manual_seed(seed)
    config = (HYBRIDS | HYBRIDS_5_17 | MOE_HYBRIDS)[model_type]()
    for name, value in overrides.items():
        setattr(config, name, value)
    config._attn_implementation = "sdpa"
    return transformers.AutoModelForCausalLM.from_config(config).to(device=device, dtype=dtype).eval()
