"""Command line: `python -m tilegym_mamba2 [run|check|compile|bench|tune|registry|fuzz]`.

run (default)  checks the environment and runs both ops: on a GPU our kernels against the
               float64 reference (with a timing); without one, the pytorch backend against the
               float64 definitions plus an ahead-of-time compile of every kernel for sm_90.
"""
import argparse
import json
import os
import re
import sys
import time

# Nothing heavy at import: the parser and its checks need none of torch, tilegym, transformers or
# cuda.tile, so --help and usage errors answer at once; a command imports what it runs.


def _positive_int(flag):
    """An argparse type: a whole number >= 1, or an error naming ``flag``."""
    def parse(text):
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{flag} must be a whole number >= 1, got {text!r}") from None
        if value < 1:
            raise argparse.ArgumentTypeError(f"{flag} must be a whole number >= 1, got {text!r}")
        return value
    return parse


def _gpu_target(text):
    """An argparse type for --target: sm_ and a compute capability, e.g. sm_90."""
    if not re.fullmatch(r"sm_[1-9][0-9]+[af]?", text):
        raise argparse.ArgumentTypeError(f"--target must be sm_ and a compute capability (sm_80, sm_90, sm_100), "
                                         f"got {text!r}")
    return text


def _positive_seconds(text):
    """An argparse type for --seconds: a finite number > 0."""
    try:
        value = float(text)
    except ValueError:
        value = float("nan")
    if not 0 < value < float("inf"):
        raise argparse.ArgumentTypeError(f"--seconds must be a finite number > 0, got {text!r}")
    return value


def _writable_file(flag):
    """An argparse type: a file path whose folder exists and can be written (checked before a
    command runs for minutes and then loses its results)."""
    def parse(text):
        folder = os.path.dirname(os.path.abspath(text))
        if os.path.isdir(text):
            raise argparse.ArgumentTypeError(f"{flag} must name a file, {text!r} is a folder")
        if not os.path.isdir(folder):
            raise argparse.ArgumentTypeError(f"{flag} names a file in {folder!r}, which does not exist")
        if not os.access(folder, os.W_OK):
            raise argparse.ArgumentTypeError(f"{flag} names a file in {folder!r}, which is not writable")
        return text
    return parse


def _readable_file(flag):
    def parse(text):
        if not os.path.isfile(text):
            raise argparse.ArgumentTypeError(f"{flag} must name an existing file, got {text!r}")
        return text
    return parse


def main(argv=None):
    parser = argparse.ArgumentParser(prog="python -m tilegym_mamba2", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="command")
    sub.add_parser("run", help="environment check and one forward pass (the default)")
    sub.add_parser("check", help="report the cuTile toolchain and GPU")
    comp = sub.add_parser("compile", help="ahead-of-time compile every kernel (no GPU needed)")
    comp.add_argument("--target", type=_gpu_target, default="sm_90", help="e.g. sm_80, sm_90, sm_100")
    from .bench.model_shapes import HYBRID_SHAPES
    bench = sub.add_parser("bench", help="side-by-side benchmark with the installed peers (GPU)")
    bench.add_argument("--grid", action="store_true", help="the larger shape grid, not only the anchor shapes")
    bench.add_argument("--only", nargs="*", help="peers to include (tilegym mamba_ssm fla)")
    bench.add_argument("--tilegym-shapes", type=int, default=1,
                       help="how many shapes to time tilegym's op on (it autotunes 150-250 s per shape)")
    bench.add_argument("--time-budget", type=float, default=None,
                       help="seconds after which tilegym's (slow to tune) op is no longer started")
    bench.add_argument("--json", default="bench.json", type=_writable_file("--json"))
    bench.add_argument("--png", type=_writable_file("--png"), help="also plot time against tokens (needs matplotlib)")
    bench.add_argument("--layer", action="store_true",
                       help="instead: the layer op (mamba_chunk_scan_combined with its options, packed "
                            "batches) against mamba_ssm's")
    bench.add_argument("--backward", action="store_true",
                       help="forward + backward (training), ours vs tilegym's and mamba_ssm's, gradients checked; with "
                            "--layer: the layer op's training step")
    bench.add_argument("--serving", action="store_true",
                       help="instead: the decode and prefill-conv ops (selective_state_update, causal_conv1d_fn, "
                            "causal_conv1d_update) against mamba_ssm, causal_conv1d and HF's torch path, and a "
                            "2-layer HF Mamba-2 model patched vs unpatched")
    bench.add_argument("--decode-graphs", action="store_true",
                       help="with --serving: instead, a Mamba2-2.7B-shaped HF model (64 layers, random, bf16) "
                            "decoding through CUDA graphs, against the patched eager model and HF's torch path")
    bench.add_argument("--model", default="mamba2", choices=["mamba2", *sorted(HYBRID_SHAPES)],
                       help="with --serving --decode-graphs: the model, a Mamba2 2.7B shape or a hybrid of a "
                            "released model's shape (random, bf16)")
    bench.add_argument("--hf-training", nargs="?", const="130m", choices=["130m", "1.3b"], default=None,
                       help="instead: a HF Mamba2ForCausalLM's AdamW training step (random, 4096 tokens), patched "
                            "vs transformers' torch path in bf16, loss curves against the torch path in fp32")
    bench.add_argument("--context-parallel", action="store_true",
                       help="instead: one long sequence split over ranks (run under torchrun, one process per "
                            "GPU; without it, two processes sharing one GPU, or the CPU)")
    bench.add_argument("--tokens", type=_positive_int("--tokens"), default=None,
                       help="--context-parallel: the sequence length (default 2^20 under torchrun, 2^16 on one GPU)")
    bench.add_argument("--check", action="store_true",
                       help="instead: rerun our rows of docs/performance.md's anchor tables and flag any more "
                            "than 10%% slower than recorded (a regression check before a release)")
    bench.add_argument("--doc", default=None, type=_readable_file("--doc"),
                       help="--check: the performance document (default: the checkout's)")
    bench.add_argument("--stages", action="store_true",
                       help="instead: time each stage of our op alone, next to the whole call")
    tune = sub.add_parser("tune", help="measure and save the best config for shapes (GPU)")
    tune.add_argument("--shapes", nargs="*", default=None,
                      help="B,T,G,H,N,P each (default: the benchmark's shapes)")
    sub.add_parser("registry", help="the ops this plugin adds to tilegym")
    fz = sub.add_parser("fuzz", help="random cases against the float64 definitions, and malformed calls")
    fz.add_argument("--seconds", type=_positive_seconds, default=60.0, help="how long to run (default 60)")
    fz.add_argument("--cases", type=_positive_int("--cases"), default=None,
                    help="run this many cases from --start instead (the same cases on every machine)")
    fz.add_argument("--start", type=int, default=0, help="the master seed of --cases (default 0)")
    fz.add_argument("--seed", type=int, default=None, help="replay the one case a failure printed")
    args = parser.parse_args(argv)
    command = args.command or "run"
    import tilegym_mamba2
    tilegym_mamba2.load()  # what importing the package does elsewhere: the kernels' host side, the registry
    if command in ("run", "bench", "tune", "fuzz"):
        # Each compiles many shapes once: their other token-count classes in the background
        # (runtime/other_token_class.py) would compile each again and contend with the timing.
        os.environ.setdefault("TILEGYM_MAMBA2_PRECOMPILE", "0")
    if command == "run":
        return run()
    if command == "check":
        return check()
    if command == "compile":
        return compile_all(args.target)
    if command == "bench":
        return bench_cmd(args)
    if command == "tune":
        return tune_cmd(args)
    if command == "registry":
        return registry()
    if command == "fuzz":
        from .fuzz import fuzz
        return 1 if fuzz(args.seconds, args.seed, cases=args.cases, start=args.start) else 0


def check() -> int:
    import torch
    from .core.toolchain import describe, diagnose
    print(describe(target=None if torch.cuda.is_available() else "sm_90"))
    if torch.cuda.is_available():
        print(f"GPU: {torch.cuda.get_device_name()} (compute capability "
              f"{'.'.join(map(str, torch.cuda.get_device_capability()))})")
    else:
        print("GPU: none visible to torch; the cutile backend needs an NVIDIA GPU of compute capability 8.0+")
    return 1 if diagnose(target=None if torch.cuda.is_available() else "sm_90") else 0


def run() -> int:
    """The main job: every check below prints its error against float64; the last line is the verdict."""
    import torch
    from .testing import relative_error
    import tilegym_mamba2
    from .testing import Mamba2ProblemSpec, forward_inputs
    torch.manual_seed(0)  # the same inputs on every run
    status = check()
    print()
    checks = {}
    if torch.cuda.is_available():
        spec = Mamba2ProblemSpec(batch_size=4, num_tokens=16384, num_groups=1, num_heads=8, state_size=128,
                                 head_size=64, chunk_size=128)
        inputs = spec.get_sample_inputs(with_reference=True, with_backward=False)
        print("cutile backend: the first call of each op compiles its kernels for this GPU (a few seconds "
              "each op, about 15 kernels in all; cached on disk for later runs)")
        start = time.perf_counter()
        out, final = tilegym_mamba2.mamba2_chunk_forward(**forward_inputs(inputs))
        torch.cuda.synchronize()
        first = time.perf_counter() - start
        checks["mamba2_chunk_forward out"] = relative_error(out, inputs["out"])
        checks["mamba2_chunk_forward final_state"] = relative_error(final, inputs["final_state"])
        from .bench.forward import measure
        ms = measure(lambda: tilegym_mamba2.mamba2_chunk_forward(**forward_inputs(inputs)))
        print(f"mamba2_chunk_forward, {spec}:\n  first call {first:.1f} s (compile included), median {ms:.3f} ms,"
              f" error vs float64 reference: out {checks['mamba2_chunk_forward out']:.1e}, "
              f"final_state {checks['mamba2_chunk_forward final_state']:.1e}")
        checks["mamba_chunk_scan_combined"] = layer_example("cuda")
        checks["mamba_chunk_scan_combined backward"] = gradient_example("cuda")
        return verdict(checks, status)
    from .ssd.reference.forward import token_recurrence
    spec = Mamba2ProblemSpec(batch_size=1, num_tokens=300, num_groups=1, num_heads=4, state_size=64,
                             head_size=64, chunk_size=128, device="cpu")
    inputs = forward_inputs(spec.get_sample_inputs(with_reference=False, with_backward=False))
    out, final = tilegym_mamba2.mamba2_chunk_forward(**inputs, backend="pytorch")
    ref_out, ref_final = token_recurrence(*list(inputs.values())[:7])
    checks["mamba2_chunk_forward out"], checks["mamba2_chunk_forward final_state"] = (
        relative_error(out, ref_out), relative_error(final, ref_final))
    print(f"No GPU: pytorch backend on {spec.num_tokens} tokens vs the token recurrence: "
          f"out {checks['mamba2_chunk_forward out']:.1e}, final_state {checks['mamba2_chunk_forward final_state']:.1e}")
    checks["mamba_chunk_scan_combined"] = layer_example("cpu")
    checks["mamba_chunk_scan_combined backward"] = gradient_example("cpu")
    print("\nAhead-of-time compile of every cuTile kernel for sm_90, to prove they compile (running them "
          "needs a GPU): about 40 kernels, 1-2 minutes on a 2-core CPU (seconds once cuTile's disk cache holds them) ...")
    compiled = compile_all("sm_90")
    return verdict(checks, status, compile_failed=bool(compiled))


def verdict(checks, toolchain_status=0, *, compile_failed=False, tolerance=1e-2) -> int:
    """Prints the last line of the main job and returns its exit status."""
    failed = [name for name, err in checks.items() if not err <= tolerance]  # NaN fails too
    problems = [f"{name} error {checks[name]:.1e}" for name in failed]
    if toolchain_status:
        problems.append("the cuTile toolchain check (see above)")
    if compile_failed:
        problems.append("the ahead-of-time compile (see above)")
    print()
    if problems:
        print(f"FAILED: {'; '.join(problems)} (tolerance {tolerance:.0e})")
        return 1
    print(f"all checks passed: errors <= {tolerance:.0e} (largest {max(checks.values()):.1e}, "
          f"{len(checks)} checks against float64)")
    return 0


def layer_example(device) -> float:
    """The layer op as a mixer calls it, on three packed sequences with every option, against
    the float64 definition. On CUDA it runs our kernels, elsewhere the pytorch backend."""
    import torch
    from .testing import relative_error
    import tilegym_mamba2
    from .bench.layer import LayerCase, layer_inputs
    from .ssd.reference.layer import layer_token_recurrence
    dtype = torch.bfloat16 if device == "cuda" else torch.float32
    args, lengths = layer_inputs(LayerCase("example", 1, 381, 2, 8, 64, 64, sequences=3), device, dtype)
    args.update(D=torch.randn(8, 64, device=device), dt_limit=(0.0, 1.0))  # D per channel, a clamp
    out, varlen = tilegym_mamba2.mamba_chunk_scan_combined(**args, chunk_size=64)
    definition = {k: v for k, v in args.items() if k not in ("return_varlen_states",)}
    ref_out, _, ref_varlen = layer_token_recurrence(**definition)
    errors = (relative_error(out, ref_out), relative_error(varlen, ref_varlen))
    err = max(errors)  # a non-finite output is inf (relative_error)
    backend = "cutile" if device == "cuda" else "pytorch"
    print(f"mamba_chunk_scan_combined ({backend} backend), 3 packed sequences {lengths}, D per channel, "
          f"z, dt_bias, softplus, dt_limit: error vs the float64 definition {err:.1e} (out and varlen states)")
    return err


def gradient_example(device) -> float:
    """Training: the layer op's gradients (every input, packed sequences, D per channel, z, dt_bias,
    softplus) through autograd, against float64 autograd of its definition."""
    import torch
    from .testing import relative_error
    import tilegym_mamba2
    from .bench.layer import LayerCase, layer_inputs
    from .ssd.reference.layer import layer_token_recurrence
    dtype = torch.bfloat16 if device == "cuda" else torch.float32
    args, lengths = layer_inputs(LayerCase("example", 1, 381, 2, 8, 64, 64, sequences=3), device, dtype)
    args.update(D=torch.randn(8, 64, device=device))
    del args["return_varlen_states"], args["cu_seqlens"]  # seq_idx marks the same sequences
    names = ["x", "dt", "A", "B", "C", "D", "z", "dt_bias"]
    dout = torch.randn(args["x"].shape, device=device, dtype=torch.float64)
    ours = {k: args[k].detach().requires_grad_() for k in names}
    out = tilegym_mamba2.mamba_chunk_scan_combined(**{**args, **ours}, chunk_size=64)
    (out.double() * dout).sum().backward()
    reference = {k: args[k].double().detach().requires_grad_() for k in names}
    (layer_token_recurrence(**{**args, **reference})[0] * dout).sum().backward()
    errors = [relative_error(ours[k].grad, reference[k].grad) for k in names]
    err = max(errors)
    backend = "cutile" if device == "cuda" else "pytorch"
    print(f"mamba_chunk_scan_combined backward ({backend} backend), same case: largest gradient error "
          f"vs float64 autograd of the definition {err:.1e} (over d{', d'.join(names)})")
    return err


def compile_all(target) -> int:
    """Compiles every kernel the ops launch for ``target``; 1 (with the diagnosis printed) on failure."""
    from .aot import (compile_backward_kernels, compile_end_state_kernels, compile_kernels, compile_layer_kernels,
                      compile_serving_kernels)
    from .core.toolchain import explain_compile_failure
    kernels, start = 0, time.perf_counter()
    try:
        for op, compiled in (("mamba2_chunk_forward", lambda: compile_kernels(target)),
                             ("mamba2_chunk_forward, short rows in one launch",
                              lambda: compile_kernels(target, chained=True)),
                             ("mamba_chunk_scan_combined, every option",
                              lambda: compile_layer_kernels(target, per_sequence_init=True)),
                             ("mamba2_chunk_backward", lambda: compile_backward_kernels(target)),
                             ("mamba_chunk_scan_combined backward, packed sequences",
                              lambda: compile_backward_kernels(target, layer="packed")),
                             ("mamba_chunk_scan_combined backward, per-sequence states",
                              lambda: compile_backward_kernels(target, layer="sequence_states")),
                             ("serving ops (decode step, prefill conv)", lambda: compile_serving_kernels(target)),
                             ("context-parallel summary", lambda: compile_end_state_kernels(target))):
            print(f"  {op}:")
            for name, size, seconds in compiled():
                print(f"    {name:30s} {target}  {size:8d} bytes  {seconds:.1f} s")
                kernels += 1
    except Exception as e:
        print(explain_compile_failure(e) or f"compile failed: {type(e).__name__}: {e}", file=sys.stderr)
        return 1
    print(f"  {kernels} kernels compiled for {target} in {time.perf_counter() - start:.0f} s")
    return 0


def bench_cmd(args) -> int:
    import torch
    from .bench import forward as bench
    if args.context_parallel:  # runs on the CPU too (a small shape, and says so)
        from .bench.context_parallel import run_context_parallel_bench
        try:
            run_context_parallel_bench(tokens=args.tokens, out_json=args.json)
        except (ValueError, RuntimeError) as e:
            print(e, file=sys.stderr)
            return 2 if isinstance(e, ValueError) else 1
        return 0
    if args.check:
        return bench_check(args.doc)
    if not torch.cuda.is_available():
        print("bench needs an NVIDIA GPU; none is visible to torch", file=sys.stderr)
        return 1
    if args.hf_training:
        from .bench.hf_training import run_hf_training_bench
        result = run_hf_training_bench(args.hf_training)
        with open(args.json, "w") as f:
            json.dump(dict(gpu=torch.cuda.get_device_name(), **result), f, indent=1)
        return 0
    shapes = bench.GRID_SHAPES if args.grid else bench.ANCHOR_SHAPES
    if args.stages:
        bench.stage_times(shapes)
        return 0
    if args.layer:
        from .bench.layer import layer_table, run_layer_bench
        rows = run_layer_bench(training=args.backward)
        if args.backward:  # the whole block's training step too (bench/block.py)
            from .bench.block import run_block_bench
            rows += [dict(row, mode="block, forward + backward") for row in run_block_bench()]
        return _save_and_print(rows, layer_table, args.json)
    if args.backward:
        from .bench.backward import backward_table, run_backward_bench
        return _save_and_print(run_backward_bench(only=args.only), backward_table, args.json)
    if args.serving and args.decode_graphs:
        from .bench.decode import run_decode_bench
        rows = run_decode_bench(model_name=args.model)
        with open(args.json, "w") as f:
            json.dump(dict(gpu=torch.cuda.get_device_name(), model=args.model, rows=rows), f, indent=1)
        return 0
    if args.serving:
        from .bench.serving import run_serving_bench
        from .bench.serving_ops import notes_text, plot_serving, serving_table
        result = run_serving_bench(out_json=args.json)
        print(serving_table(result["rows"], result["meta"].get("copy_bandwidth_bytes_per_s")))
        if args.png:
            try:
                plot_serving(result["rows"], args.png, title=f"Mamba-2 serving ops, {result['meta']['gpu']}")
            except ImportError as e:
                result["notes"]["png"] = f"not drawn: {e}"
        print(notes_text(result["notes"]))
        return 0
    result = bench.run(shapes, only=args.only, tilegym_shapes=args.tilegym_shapes, out_json=args.json,
                       time_budget_s=args.time_budget)
    print(bench.table(result))
    if args.png:
        bench.plot(result, args.png)
    return 0


def _save_and_print(rows, table, path) -> int:
    import torch
    with open(path, "w") as f:
        json.dump(dict(gpu=torch.cuda.get_device_name(), date=time.strftime("%Y-%m-%d"), rows=rows), f, indent=1)
    print(table(rows))
    return 0


def bench_check(doc) -> int:
    """The anchors' rows rerun beside their recorded figures; 1 when any is flagged."""
    import torch
    from pathlib import Path
    from .bench.check import default_document, measure_anchors, read_anchors, report
    path = Path(doc) if doc else default_document()
    if not path.is_file():
        print(f"bench --check reads the recorded figures from a checkout's docs/performance.md; {path} is not "
              f"a file (--doc names another)", file=sys.stderr)
        return 2
    try:
        anchors = read_anchors(path.read_text())
    except ValueError as e:
        print(f"{path}: {e}", file=sys.stderr)
        return 2
    print(f"{len(anchors)} anchor figures in {path}:")
    for a in anchors:
        print(f"  {a.kind:9s} {a.row:48s} {a.column:15s} {a.recorded_ms:.3f} ms")
    if not anchors:
        print(f"{path} holds no anchor figures (tables marked <!-- check: ... -->): nothing to check",
              file=sys.stderr)
        return 2
    if not torch.cuda.is_available():
        print("rerunning them needs an NVIDIA GPU; none is visible to torch", file=sys.stderr)
        return 1
    text, flagged = report(anchors, measure_anchors(anchors))
    print(text)
    return 1 if flagged else 0


def tune_cmd(args) -> int:
    import torch
    from .bench.forward import GRID_SHAPES
    from .core.validation import check_forward_args
    from .ssd.forward import config_for
    from .testing import Mamba2ProblemSpec, forward_inputs
    if not torch.cuda.is_available():
        print("tune needs an NVIDIA GPU; none is visible to torch", file=sys.stderr)
        return 1
    shapes = [tuple(int(v) for v in s.split(",")) for s in args.shapes] if args.shapes else GRID_SHAPES
    for shape in shapes:  # (batch, tokens, groups, heads, state_size, head_size), random inputs
        spec = Mamba2ProblemSpec.from_shape(shape, chunk_size=128, dtype=torch.bfloat16, device="cuda")
        inputs = forward_inputs(spec.get_sample_inputs(with_reference=False, with_backward=False))
        print(f"tuning {shape}: {config_for(*check_forward_args(**inputs, backend='cutile'), tune=True)}")
    return 0


def registry() -> int:
    from .core.registry import load_registry
    for entry in load_registry().values():
        print(f"{entry.name}\n  {entry.contract}\n  backends: {entry.backends}\n  fallback: {entry.fallback}"
              f"\n  displaces tilegym's own to: {entry.displaces}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
