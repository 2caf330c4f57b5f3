"""The kernels of one decode step of a Hugging Face model at `bench --serving --decode-graphs`'s
shape (GPU): the step the decode graphs capture, run eagerly on the bucket's static cache, under
torch.profiler, with HF's norms and with ours (`rms_norm=False` / `True`).

    python benchmarks/decode_step_profile.py [MODEL ...] [--batch B]   # default: mamba2, batch 1

MODEL is mamba2 or a hybrid of bench/decode.py's HYBRID_SHAPES. Per model and norm setting it
prints the kernels and kernel milliseconds of one step (a 9-token generation less a 1-token one,
over the 8 steps between) and the 12 kernels that take the most time.
"""
import argparse
import collections

import torch
import transformers

from tilegym_mamba2.bench.decode import CASE, HYBRID_SHAPES, hybrid_config
from tilegym_mamba2.bench.serving import model_config
from tilegym_mamba2.integrations.hf.decode_graphs import DecodeGraphs
from tilegym_mamba2.transformers import apply_tilegym_kernel_to_mamba2

STEPS = 8


def kernel_times(run):
    """-> {kernel name: (launches, GPU ms)} of run()."""
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        run()
        torch.cuda.synchronize()
    table = collections.defaultdict(lambda: [0, 0.0])
    for event in prof.events():
        if event.device_type == torch.autograd.DeviceType.CUDA:
            table[event.name][0] += 1
            table[event.name][1] += event.device_time_total / 1e3
    return table


def profile(name, batch, norms):
    torch.manual_seed(0)
    with torch.device("cuda"):
        config = model_config(CASE) if name == "mamba2" else hybrid_config(name, CASE.vocab)
        model = transformers.AutoModelForCausalLM.from_config(config).to(torch.bfloat16).eval()
    apply_tilegym_kernel_to_mamba2(model=model, rms_norm=norms)
    model.forward = DecodeGraphs(model, (batch,), use_graphs=False)
    ids = torch.randint(2, CASE.vocab, (batch, CASE.decode_prompt), device="cuda")

    def generate(new):
        with torch.inference_mode():
            model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=new, min_new_tokens=new,
                           do_sample=False, pad_token_id=0)

    generate(4)  # compiles, tunes and takes the bucket
    many, one = kernel_times(lambda: generate(STEPS + 1)), kernel_times(lambda: generate(1))
    step = {k: ((n - one.get(k, (0, 0))[0]) / STEPS, (ms - one.get(k, (0, 0.0))[1]) / STEPS)
            for k, (n, ms) in many.items()}
    print(f"== {name}, batch {batch}, rms_norm={norms}: {model.config.num_hidden_layers} layers; one step: "
          f"{sum(n for n, _ in step.values()):.0f} kernels, {sum(ms for _, ms in step.values()):.3f} ms of kernel time")
    for kernel, (n, ms) in sorted(step.items(), key=lambda kv: -kv[1][1])[:12]:
        print(f"   {ms:7.3f} ms {n:6.0f}x  {kernel[:90]}")


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("models", nargs="*", default=["mamba2"], choices=["mamba2", *HYBRID_SHAPES])
    parser.add_argument("--batch", type=int, default=1)
    args = parser.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("decode_step_profile.py profiles CUDA kernels: it needs an NVIDIA GPU")
    for name in args.models:
        for norms in (False, True):
            profile(name, args.batch, norms)
            torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
