"""A Hugging Face Mamba2ForCausalLM's training step, patched against unpatched, in one process:
``python -m tilegym_mamba2 bench --hf-training [130m|1.3b]``.

A random model of the named shape (Mamba-2 130M: 24 layers of 768; 1.3B: 48 layers of 2048; head
64, state 128, vocab 50288; nothing downloaded), trained from one initial state three ways on the
same batches: transformers' torch path in fp32 (the yardstick), the torch path in bf16, and
patched with apply_tilegym_kernel_to_mamba2 in bf16; AdamW, ``steps`` steps of one row of
``tokens`` tokens (halved while the torch path runs out of memory). Rows: ms per step (median of
the steps after the first ``WARMUP``), tokens per second, and each bf16 loss curve's largest
distance from the fp32 one: the patched curve is within bf16 noise when its distance is no more
than about the torch path's own in bf16.
"""
import copy
import time
from dataclasses import dataclass

import torch

WARMUP = 3


@dataclass(frozen=True)
class TrainingShape:
    name: str
    layers: int
    hidden: int
    vocab: int = 50288
    head_dim: int = 64
    state_size: int = 128
    chunk_size: int = 256


SHAPES = {
    "130m": TrainingShape("Mamba-2 130M", 24, 768),
    "1.3b": TrainingShape("Mamba-2 1.3B", 48, 2048),
    "tiny": TrainingShape("tiny (tests)", 2, 64, vocab=128, head_dim=16, state_size=16, chunk_size=16),
}


def mamba2_model(shape, device, dtype, seed=0):
    import transformers
    config = transformers.Mamba2Config(
        vocab_size=shape.vocab, hidden_size=shape.hidden, num_hidden_layers=shape.layers,
        num_heads=2 * shape.hidden // shape.head_dim, head_dim=shape.head_dim, expand=2, state_size=shape.state_size,
        n_groups=1, chunk_size=shape.chunk_size, tie_word_embeddings=True,  # as the released models
        pad_token_id=0, eos_token_id=1, bos_token_id=1)
    torch.manual_seed(seed)
    return transformers.Mamba2ForCausalLM(config).to(device=device, dtype=dtype)


def train(model, batches, lr=3e-4):
    """-> (losses, ms per step). One optimizer step per batch, the loss of the outputs alone."""
    optimizer = torch.optim.AdamW(model.parameters(), lr=lr)
    model.train()
    losses, times = [], []
    for ids in batches:
        _sync(ids.device)
        start = time.perf_counter()
        loss = model(ids, labels=ids).loss
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        _sync(ids.device)
        times.append((time.perf_counter() - start) * 1e3)
        losses.append(loss.item())
    timed = sorted(times[WARMUP:] or times)
    return losses, timed[len(timed) // 2]


def run_hf_training_bench(size="130m", tokens=4096, steps=20, device="cuda", log=print):
    """-> dict(shape, tokens, rows): one row per path, with its losses."""
    from ..transformers import apply_tilegym_kernel_to_mamba2
    shape = SHAPES[size]
    reference = mamba2_model(shape, device, torch.float32)
    initial = copy.deepcopy(reference.state_dict())
    log(f"{shape.name}: {sum(p.numel() for p in reference.parameters()) / 1e6:.0f} M parameters, {steps} steps")
    while True:
        gen = torch.Generator().manual_seed(1)
        batches = [torch.randint(2, shape.vocab, (1, tokens), generator=gen).to(device) for _ in range(steps)]
        try:
            reference.load_state_dict(initial)
            fp32_losses, fp32_ms = train(reference, batches)
            break
        except torch.OutOfMemoryError:
            if tokens <= 512:
                raise
            tokens //= 2
            torch.cuda.empty_cache()
            log(f"the fp32 torch path ran out of memory: {tokens} tokens per step instead")
    del reference
    rows = [dict(path="torch path, fp32", ms=fp32_ms, losses=fp32_losses)]
    for path, patched in (("torch path, bf16", False), ("patched, bf16", True)):
        model = mamba2_model(shape, device, torch.float32)
        model.load_state_dict(initial)
        model = model.to(torch.bfloat16)
        if patched:
            apply_tilegym_kernel_to_mamba2(model=model)
        losses, ms = train(model, batches)
        rows.append(dict(path=path, ms=ms, losses=losses))
        del model
        if device == "cuda":
            torch.cuda.empty_cache()
    for row in rows:
        row["tokens_per_s"] = tokens * 1e3 / row["ms"]
        row["max_loss_gap_to_fp32"] = max(abs(a - b) for a, b in zip(row["losses"], fp32_losses))
        log(f"{row['path']:>18} | {row['ms']:9.2f} ms/step | {row['tokens_per_s']:9.0f} tokens/s | "
            f"loss {row['losses'][0]:.4f} -> {row['losses'][-1]:.4f} | max |loss - fp32's| "
            f"{row['max_loss_gap_to_fp32']:.2e}")
    torch_bf16, patched = rows[1], rows[2]
    log(f"patched / torch path (bf16): {torch_bf16['ms'] / patched['ms']:.2f}x tokens/s")
    return dict(shape=shape.name, tokens=tokens, steps=steps, rows=rows)


def _sync(device):
    if torch.device(device).type == "cuda":
        torch.cuda.synchronize()
