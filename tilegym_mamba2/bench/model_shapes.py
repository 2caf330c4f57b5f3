"""The released models whose shapes `bench --serving --decode-graphs --model NAME` builds at
random init: plain data, so that the command line reads the names without importing torch."""

_ATTENTION = dict(num_attention_heads=32, num_key_value_heads=8, pad_token_id=0, eos_token_id=1, bos_token_id=1)
# name -> (the released model whose shape it takes, transformers config class, its arguments);
# the vocabulary is the case's (a small one: the embedding is not what decoding measures).
HYBRID_SHAPES = {
    # Nemotron-H 8B's mamba and attention blocks; its MLP blocks ("-") are not a block type of
    # transformers 5.3's NemotronH, so they are left out.
    "nemotron_h": ("Nemotron-H 8B without its MLP blocks", "NemotronHConfig", dict(
        hybrid_override_pattern="M-M-M-M*-M-M-M-M-M*-M-M-M-M-M*-M-M-M-M-M*-M-M-M-M-M-".replace("-", ""),
        hidden_size=4096,
        intermediate_size=21504, mamba_num_heads=128, mamba_head_dim=64, mamba_n_groups=8, ssm_state_size=128,
        head_dim=128, mamba_chunk_size=128, **_ATTENTION)),
    "bamba": ("Bamba 9B", "BambaConfig", dict(
        hidden_size=4096, intermediate_size=14336, num_hidden_layers=32, attn_layer_indices=[9, 18, 27],
        mamba_n_heads=128, mamba_d_head=64, mamba_n_groups=1, mamba_d_state=128, mamba_chunk_size=256, **_ATTENTION)),
    "granitemoehybrid": ("Granite 4.0-H Micro (dense)", "GraniteMoeHybridConfig", dict(
        hidden_size=2048, intermediate_size=8192, shared_intermediate_size=8192, num_local_experts=0,
        num_hidden_layers=40, layer_types=["attention" if i % 10 == 9 else "mamba" for i in range(40)],
        mamba_n_heads=64, mamba_d_head=64, mamba_n_groups=1, mamba_d_state=128, mamba_chunk_size=256, **_ATTENTION)),
    # The mixture-of-experts hybrids (decode graphs route their experts on the device). Granite
    # 4.0-H Tiny's shape (about 7B parameters, 64 experts, top 6, a shared expert), and Nemotron 3
    # Nano's blocks (128 experts of 1856, top 6, a shared expert of 3712) at 9 of its 52 layers,
    # about 5B parameters, so that it fits beside the torch path's copy.
    "granitemoehybrid_moe": ("Granite 4.0-H Tiny", "GraniteMoeHybridConfig", dict(
        hidden_size=1536, intermediate_size=512, shared_intermediate_size=1024, num_local_experts=64,
        num_experts_per_tok=6, num_hidden_layers=40,
        layer_types=["attention" if i % 10 == 5 else "mamba" for i in range(40)], mamba_n_heads=48,
        mamba_d_head=64, mamba_n_groups=1, mamba_d_state=128, mamba_chunk_size=256,
        **(_ATTENTION | dict(num_attention_heads=12, num_key_value_heads=4)))),
    "nemotron_h_moe": ("Nemotron 3 Nano's blocks, 9 layers", "NemotronHConfig", dict(
        layers_block_type=["mamba", "moe", "mamba", "moe", "attention", "mamba", "moe", "mamba", "moe"],
        hidden_size=2688, n_routed_experts=128, num_experts_per_tok=6, n_group=1, topk_group=1,
        moe_intermediate_size=1856, moe_shared_expert_intermediate_size=3712, mamba_num_heads=64,
        mamba_head_dim=64, mamba_n_groups=8, ssm_state_size=128, head_dim=128, mamba_chunk_size=128,
        **(_ATTENTION | dict(num_key_value_heads=2)))),
    "zamba2": ("Zamba2 2.7B", "Zamba2Config", dict(
        hidden_size=2560, intermediate_size=10240, num_hidden_layers=54,
        layers_block_type=["hybrid" if i % 6 == 5 else "mamba" for i in range(54)], mamba_d_state=64,
        n_mamba_heads=80, mamba_ngroups=1, chunk_size=256, num_mem_blocks=2, adapter_rank=128, use_mem_rope=True,
        **(_ATTENTION | dict(num_key_value_heads=32)))),
}
