"""The one-launch path for short rows (ssd/chained_prefill.py) on a GPU: against float64,
repeated, on two streams at once, and under CUDA-graph capture (skipped without a GPU).

Every output starts as NaN (poisoned_outputs); fresh random inputs each run (seed in messages)."""
import pytest
import torch

from tilegym_mamba2.runtime import limits

import tilegym_mamba2
from tilegym_mamba2.runtime import plan
from tilegym_mamba2.ssd.forward import run_stages
from tilegym_mamba2.runtime.launch import poisoned_outputs
from tilegym_mamba2.runtime.tuning import CHAINED_SEGMENTS, ConfigCache, bucket_key, chained_config, choose_config
from tilegym_mamba2.testing import Mamba2ProblemSpec, forward_inputs
from tilegym_mamba2.core.validation import check_forward_args, values

from gpu_checks import fresh_seed, rel_err  # noqa: E402

pytestmark = pytest.mark.gpu

TOLERANCE = {torch.bfloat16: 1e-2, torch.float16: 4e-3}  # as the plain op's (test_forward_gpu.py)

CASES = [
    # batch, tokens, groups, heads, state, head, dtype, with an initial state
    (1, 2048, 1, 32, 128, 64, torch.bfloat16, True),   # the prefill
    (1, 2048, 1, 32, 128, 64, torch.bfloat16, False),
    (2, 1000, 2, 8, 64, 128, torch.float16, True),     # two head tiles per head, ragged
    (3, 640, 1, 6, 64, 32, torch.bfloat16, False),
    (2, 4095, 1, 4, 128, 64, torch.bfloat16, True),    # the longest row offered, ragged
    (1, 1, 1, 4, 128, 64, torch.bfloat16, True),       # one token
    (1, 300, 1, 4, 16, 32, torch.float16, True),
]


def sample(batch, tokens, groups, heads, state, head, dtype, with_init, seed=None):
    seed = fresh_seed() if seed is None else seed
    spec = Mamba2ProblemSpec(batch_size=batch, num_tokens=tokens, num_groups=groups, num_heads=heads,
                             state_size=state, head_size=head, chunk_size=128, dtype=dtype, device="cuda", seed=seed)
    inputs = spec.get_sample_inputs(with_reference=True, with_backward=False)
    if not with_init:  # the references again, from a zero state
        inputs = dict(inputs, init_state=None)
        inputs.update(spec._references(inputs))
    return spec, inputs


def chained_run(inputs, per_segment):
    x, a, b, c, d, dt, init, chunk = values(check_forward_args(**forward_inputs(inputs), limits=limits.CUTILE))
    batch, tokens, heads, head_size = x.shape
    config = chained_config(choose_config(batch, tokens, b.shape[2], heads, head_size, b.shape[3], chunk),
                            per_segment)
    stages = run_stages(x, a, b, c, d, dt, init, chunk, config)
    assert stages.config.chained
    return stages.out, stages.final_state


def _case_params():
    """Every case at the first chained segment length; the long rows (2048 tokens and more, ~40 s
    of compiling each) at the other lengths only under the stress marker."""
    for per_segment in CHAINED_SEGMENTS + (1,):
        for case in CASES:
            long_row = case[1] >= 2048 and per_segment != CHAINED_SEGMENTS[0]
            yield pytest.param(per_segment, *case, marks=[pytest.mark.stress] if long_row else [])


@pytest.mark.parametrize("per_segment,batch,tokens,groups,heads,state,head,dtype,with_init", list(_case_params()))
def test_chained_path_matches_reference(batch, tokens, groups, heads, state, head, dtype, with_init, per_segment):
    spec, inputs = sample(batch, tokens, groups, heads, state, head, dtype, with_init)
    with poisoned_outputs():
        out, final_state = chained_run(inputs, per_segment)
        torch.cuda.synchronize()
        for _ in range(5):  # the workspace is clean after each launch: the same bits again
            again, again_final = chained_run(inputs, per_segment)
    tol = TOLERANCE[dtype]
    assert rel_err(out, inputs["out"]) < tol, f"out, seed={spec.seed}"
    assert rel_err(final_state, inputs["final_state"]) < tol, f"final_state, seed={spec.seed}"
    assert torch.equal(out, again) and torch.equal(final_state, again_final), f"seed={spec.seed}"


def test_two_streams_at_once_each_get_their_own_answer():
    cases = [sample(1, 2048, 1, 32, 128, 64, torch.bfloat16, True) for _ in range(2)]
    alone = [chained_run(inputs, 4) for _, inputs in cases]
    streams = [torch.cuda.Stream() for _ in cases]
    for stream in streams:
        stream.wait_stream(torch.cuda.current_stream())
    together = [[] for _ in cases]
    for _ in range(10):  # interleaved launches on two streams
        for i, ((_, inputs), stream) in enumerate(zip(cases, streams)):
            with torch.cuda.stream(stream):
                together[i].append(chained_run(inputs, 4))
    torch.cuda.synchronize()
    for (spec, _), want, got in zip(cases, alone, together):
        for out, final_state in got:
            assert torch.equal(out, want[0]) and torch.equal(final_state, want[1]), f"seed={spec.seed}"


def test_a_settled_chained_choice_is_captured_and_replays_the_eager_bits(tmp_path, monkeypatch):
    """The plain op with the one-launch path saved for its bucket: the eager call takes it, a
    CUDA graph captures it with a workspace of its own, and each replay gives the eager bits,
    also replayed on a second stream while the eager path runs on the first."""
    from tilegym_mamba2.ssd.chained_prefill import _workspaces
    monkeypatch.setenv("TILEGYM_MAMBA2_CACHE_DIR", str(tmp_path))
    monkeypatch.setenv("TILEGYM_MAMBA2_TUNE", "all")  # the one-launch path is taken only where asked for
    plan.forget()
    _workspaces.clear()
    spec, inputs = sample(1, 2048, 1, 32, 128, 64, torch.bfloat16, True)
    base = choose_config(1, 2048, 1, 32, 64, 128, 128)
    ConfigCache().put(bucket_key(torch.cuda.get_device_name(), torch.bfloat16, 1, 2048, 32, 1, 64, 128),
                      chained_config(base, 4))
    args = forward_inputs(inputs)
    eager = [t.clone() for t in tilegym_mamba2.mamba2_chunk_forward(**args)]
    assert len(_workspaces) == 1, "the eager call did not take the one-launch path"
    for t, want, name in zip(eager, (inputs["out"], inputs["final_state"]), ("out", "final_state")):
        assert rel_err(t, want) < TOLERANCE[torch.bfloat16], f"{name}, seed={spec.seed}"
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        captured = tilegym_mamba2.mamba2_chunk_forward(**args)
    assert len(_workspaces) == 1, "the capture used a stream's workspace"
    side = torch.cuda.Stream()
    for _ in range(3):
        for t in captured:
            t.fill_(float("nan"))
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            graph.replay()
        again = tilegym_mamba2.mamba2_chunk_forward(**args)  # on the first stream, at the same time
        torch.cuda.synchronize()
        assert all(torch.equal(e, c) for e, c in zip(eager, captured)), f"replay, seed={spec.seed}"
        assert all(torch.equal(e, a) for e, a in zip(eager, again)), f"eager, seed={spec.seed}"
    plan.forget()
