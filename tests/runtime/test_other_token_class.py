"""runtime/other_token_class.py on the CPU: which token count stands for the other class, the meta
copies a replay runs on, and how a call and the background thread share the compiles (with a
stand-in kernel and signatures; the GPU test runs cuTile's own)."""
import contextlib
import dataclasses
import threading

import pytest
import torch

pytest.importorskip("cuda.tile")

from tilegym_mamba2.core.validation import ForwardArgs, scan_combined_call, values  # noqa: E402
from tilegym_mamba2.runtime import launch, other_token_class as other  # noqa: E402


def test_the_other_classes_have_as_many_chunks_and_every_other_divisibility():
    for tokens in range(2, 5000):
        counts = other.other_class_counts(tokens)
        classes = [other.token_class(n) for n in counts]
        assert sorted(classes + [other.token_class(tokens)]) == [1, 2, 4, 8, 16], tokens
        assert all(n > 0 and -(-n // 64) == -(-tokens // 64) for n in counts), tokens
    assert [other.token_class(n) for n in (1, 6, 12, 40, 48, 8192, 8191)] == [1, 2, 4, 8, 16, 16, 1]


def test_one_token_is_left_to_its_own_calls():
    assert other.other_class_counts(1) == []


def test_meta_copies_move_the_token_axis_of_token_arguments_only():
    x = torch.zeros(2, 48, 4, 8, dtype=torch.bfloat16)
    projected = torch.zeros(2, 48, 100)  # a layer's in_proj output: x is a view of it, rows 4800 apart
    view = projected[..., 10:42].view(2, 48, 4, 8)
    state = torch.zeros(2, 4, 8, 48)  # no token axis, even where a size equals the token count
    args = ForwardArgs(x=x, a=torch.zeros(4), b=view, c=view, d=torch.zeros(4), dt=torch.zeros(2, 48, 4), init_state=state,
                       chunk_size=128)
    meta = other._on_meta("args", args, 48, 47)
    assert type(meta) is ForwardArgs and all(t.device.type == "meta" for t in values(meta) if isinstance(t, torch.Tensor))
    assert meta.x.shape == (2, 47, 4, 8) and meta.x.stride() == (47 * 32, 32, 8, 1) and meta.x.dtype == torch.bfloat16
    assert meta.b.shape == (2, 47, 4, 8) and meta.b.stride() == (47 * 100, 100, 8, 1)
    assert meta.b.storage_offset() == 10 and meta.b.data_ptr() % 16 == view.data_ptr() % 16  # cuTile's alignment bit
    assert meta.dt.shape == (2, 47, 4)
    assert meta.init_state.shape == (2, 4, 8, 48) and meta.a.shape == (4,) and meta.chunk_size == 128
    assert other._on_meta("state", state, 48, 47).shape == state.shape


@dataclasses.dataclass(frozen=True)
class Signature:  # stands in for cuTile's KernelSignature: compared by value, not hashed
    parameters: tuple
    convention: object
    __hash__ = None


class Kernel:
    """Stands in for a ct.kernel: cuTile's dispatcher calls _compile on a miss."""
    def __init__(self):
        self.compiled = []  # (signature, thread name)

    def _compile(self, signature, context, compute_capability=None):
        self.compiled.append((signature, threading.current_thread().name))
        return ("binary", signature.parameters)


@pytest.fixture
def fake_cutile(monkeypatch):
    """Signatures of a launch: each tensor argument's divisibility of its axis 1 by 16."""
    monkeypatch.setattr(other, "KernelSignature", Signature)
    monkeypatch.setattr(other, "get_parameter_constraints_from_pyargs",
                        lambda kernel, args, convention: tuple(a.shape[1] % 16 == 0 for a in args))
    monkeypatch.setattr(other, "_seen", set())
    monkeypatch.setattr(other, "_replayed", set())
    monkeypatch.setattr(other, "_ready", {})
    monkeypatch.setattr(other, "QUIET_S", 0.0)
    kernel = Kernel()

    def replay(x):
        launch.launch((1,), kernel, (x,))
    yield kernel, replay
    assert other.wait_idle(60), "the background thread never finished its queue"


def test_a_call_of_the_other_class_takes_the_background_binary(fake_cutile):
    kernel, replay = fake_cutile
    x = torch.zeros(2, 64, 4)
    before = dict(other.stats)
    assert other.queue_other_class(replay, 64, (9, 0), {"x": x}) == 1
    assert other.queue_other_class(replay, 64, (9, 0), {"x": x}) == 0  # queued once
    assert other.wait_idle(60)
    assert kernel.compiled == [(Signature((False,), other._V1), "tilegym-mamba2-precompile")]
    # What cuTile's dispatcher does on the first launch of 63 tokens:
    assert kernel._compile(Signature((False,), other._V1), None, (9, 0)) == ("binary", (False,))
    assert len(kernel.compiled) == 1 and other.stats["taken"] == before["taken"] + 1
    # Another capability, or the call's own class: the call compiles them itself.
    kernel._compile(Signature((False,), other._V1), None, (10, 0))
    kernel._compile(Signature((True,), other._V1), None, (9, 0))
    assert [thread for _, thread in kernel.compiled[1:]] == [threading.current_thread().name] * 2


def test_a_call_takes_a_compile_the_thread_has_not_started_and_it_runs_once(fake_cutile, monkeypatch):
    kernel, replay = fake_cutile
    monkeypatch.setattr(other, "QUIET_S", 3600.0)
    other._call_compiling(0)  # a call compiled just now: the thread waits
    assert other.queue_other_class(replay, 64, (9, 0), {"x": torch.zeros(2, 64, 4)}) == 1
    kernel._compile(Signature((False,), other._V1), None, (9, 0))
    assert other.wait_idle(60)
    assert [thread for _, thread in kernel.compiled] == [threading.current_thread().name]


def test_a_dimension_of_size_one_is_in_the_signature_as_a_launch_compiles_it(monkeypatch):
    """cuTile's launch makes a dimension of size 1 a constant of its signature, which only calling
    convention v2 conveys, and compiles with v1 where nothing needs v2. Asked for v1 constraints,
    its C extension leaves sizes of 1 out, so a replay of a model with one group (b and c of
    [batch, tokens, 1, state]) queued signatures no launch meets: the stand-in below does as the
    C extension does (cuda.tile 1.7, get_parameter_constraints_from_pyargs)."""
    from cuda.tile.compilation import ArrayConstraint, KernelSignature
    from cuda.tile import bfloat16, int32

    def constraints(kernel, args, convention):
        shapes = convention.version >= 2  # "can_specialize_for_shape" is off below v2
        return [ArrayConstraint(bfloat16, a.ndim, index_dtype=int32, stride_lower_bound_incl=0, alias_groups=(),
                                may_alias_internally=False, shape_constant=[1 if shapes and size == 1 else None for size in a.shape])
                for a in args]
    monkeypatch.setattr(other, "get_parameter_constraints_from_pyargs", constraints)
    grouped = torch.zeros(2, 64, 1, 16, dtype=torch.bfloat16, device="meta")
    signature = other._launch_signature(None, (grouped, grouped[:, :, 0]))
    assert signature.calling_convention.version == 2
    assert [c.shape_constant for c in signature.parameters] == [(None, None, 1, None), (None, None, None)]
    ungrouped = torch.zeros(2, 64, 2, 16, dtype=torch.bfloat16, device="meta")
    assert other._launch_signature(None, (ungrouped,)) == KernelSignature(constraints(None, (ungrouped,), other._V2),
                                                                          other._V1)


def test_a_replay_that_fails_on_meta_tensors_queues_nothing(fake_cutile):
    kernel, _ = fake_cutile

    def replay(x):
        x.tolist()  # reads values: meta tensors have none
    assert other.queue_other_class(replay, 64, (9, 0), {"x": torch.zeros(2, 64, 4)}) == 0


def test_the_switch_and_cpu_tensors(fake_cutile, torch_on_a_gpu_machine, monkeypatch):
    """TILEGYM_MAMBA2_PRECOMPILE=0 queues nothing, nor does a call on CPU tensors; otherwise (the
    switch unset or 1) a GPU call's replay is queued."""
    kernel, replay = fake_cutile
    x = torch.zeros(2, 64, 4)
    monkeypatch.setenv(other.SWITCH, "1")
    other.compile_other_class(replay, x, x=x)  # CPU tensors: no GPU to compile for
    assert other._ready == {}

    class OnGpu:  # what compile_other_class reads of the call's x
        shape, is_cuda, device = x.shape, True, "cuda:0"
    monkeypatch.setenv(other.SWITCH, "0")
    other.compile_other_class(replay, OnGpu(), x=x)
    assert other._ready == {}
    monkeypatch.delenv(other.SWITCH)
    assert other.enabled()  # on unless switched off
    monkeypatch.setenv(other.SWITCH, "1")
    other.compile_other_class(replay, OnGpu(), x=x)
    assert other.wait_idle(60) and [signature for signature, _ in kernel.compiled] == [
        Signature((False,), other._V1)]


# --- the replays of cutile's backend: what they launch is what a call of the other count launches

def _layout(arg):
    return (arg.dtype, tuple(arg.shape), arg.stride()) if isinstance(arg, torch.Tensor) else arg


def _launches(record, describe=_layout):
    """(kernel, each argument described: by default a tensor's dtype, shape and strides, else the
    value) of every launch."""
    with launch.recording_launches() as launches:
        record()
    return [(kernel, tuple(describe(a) for a in args)) for kernel, args in launches]


def _replayed(replay, tokens, to_tokens, describe=_layout, **named):
    return _launches(lambda: replay(**{name: other._on_meta(name, value, tokens, to_tokens)
                                       for name, value in named.items()}), describe)


def _layer_args(tokens, with_z, packed, varlen=False, groups=2, state=128):
    heads, head = 6, 64
    x = torch.zeros(1, tokens, heads, head, dtype=torch.bfloat16)
    b = torch.zeros(1, tokens, groups, state, dtype=torch.bfloat16)
    cu_seqlens = torch.tensor([0, tokens // 3, tokens], dtype=torch.int32) if packed else None
    return scan_combined_call(x, torch.zeros(1, tokens, heads), torch.zeros(heads), b, b.clone(), 128,
                            torch.zeros(heads, head), torch.zeros_like(x) if with_z else None, torch.zeros(heads), None,
                            None, cu_seqlens, True, (0.0, float("inf")), False, varlen)


@pytest.mark.parametrize("tokens", [256, 255, 1000])
def test_the_forward_and_backward_replays_launch_what_the_other_counts_launch(tokens):
    for to in other.other_class_counts(tokens):
        for replay in _plain_replays(tokens):
            expected = _launches(lambda: replay(_plain_args(to)))
            assert expected and _replayed(replay, tokens, to, args=_plain_args(tokens)) == expected


def _plain_args(count):
    from tilegym_mamba2.core.validation import BackwardArgs
    x = torch.zeros(2, count, 8, 64, dtype=torch.bfloat16)
    b = torch.zeros(2, count, 1, 128, dtype=torch.bfloat16)
    return BackwardArgs(x=x, a=torch.zeros(8), b=b, c=b.clone(), d=torch.zeros(8), dt=torch.zeros(2, count, 8),
                        init_state=torch.zeros(2, 8, 64, 128), dout=torch.zeros_like(x),
                        dfinal_state=torch.zeros(2, 8, 64, 128), chunk_size=128)


def _plain_replays(tokens):
    """The plain op's forward and backward replays, as backends/cutile.py gives them."""
    from tilegym_mamba2.backends.cutile import chunk_backward_replay
    from tilegym_mamba2.ssd.forward import run_stages
    from tilegym_mamba2.runtime.tuning import choose_config
    config = choose_config(2, tokens, 1, 8, 64, 128, 128)
    return (lambda args: run_stages(*values(args)[:8], config), chunk_backward_replay)


@pytest.mark.parametrize("with_z, packed, varlen", [(True, False, False), (False, False, False), (True, True, False),
                                                    (False, True, False), (True, True, True)])
def test_the_layer_replay_launches_what_a_training_step_of_the_other_count_launches(with_z, packed, varlen):
    """The forward, and the backward on the gradients autograd passes (dout, zero final-state
    gradients, no varlen ones unless returned), as backends/cutile.py and autograd.py call them.
    With varlen states the backward's per-sequence terms take shapes only on meta tensors
    (backward.sequence_edge_terms), so that step replays too."""
    from tilegym_mamba2.backends import cutile as backend
    from tilegym_mamba2.ssd.layer import run_layer
    from tilegym_mamba2.runtime.tuning import choose_config
    tokens = 500
    config = choose_config(1, tokens, 2, 6, 64, 128, 128)

    def step(args):
        ungated = torch.zeros_like(args.x) if with_z and not packed else None
        run_layer(args, config=config, ungated=ungated)
        dfinal = torch.zeros(1, 6, 64, 128)
        dvarlen = torch.zeros(2, 6, 64, 128) if args.return_varlen_states else None
        backend.scan_combined_backward_kernels(args, torch.zeros_like(args.x), dfinal, dvarlen, checked=True,
                                               ungated=ungated)
    for to in other.other_class_counts(tokens):
        expected = _launches(lambda: step(_layer_args(to, with_z, packed, varlen=varlen)))
        args = _layer_args(tokens, with_z, packed, varlen=varlen)
        ungated = torch.zeros_like(args.x) if with_z and not packed else None
        replayed = _replayed(backend._layer_replay(config, training=True), tokens, to, args=args, ungated=ungated)
        assert expected and replayed == expected, to


@pytest.fixture
def torch_on_a_gpu_machine(monkeypatch):
    """torch.cuda as on a machine with one GPU: get_device_properties refuses any other device,
    a replay's meta tensors' included, as torch does there."""
    from tilegym_mamba2.runtime import tuning

    class Properties:
        multi_processor_count = 132

    def properties(device=None):
        if not isinstance(device, int) and torch.device(device).type != "cuda":
            raise ValueError(f"Expected a cuda device, but got: {device}")
        return Properties()
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: False)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    monkeypatch.setattr(torch.cuda, "get_device_properties", properties)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (9, 0))
    monkeypatch.setattr(torch.cuda, "device", lambda device: contextlib.nullcontext())
    caches = (tuning._gpu_multiprocessor_count, tuning.choose_config)
    for cache in caches:
        cache.cache_clear()
    yield
    for cache in caches:
        cache.cache_clear()


def test_every_replay_runs_where_torch_has_a_gpu(torch_on_a_gpu_machine, monkeypatch):
    """The host code sizes some launches by the GPU's multiprocessors (tuning.choose_config, which
    the backward's scans call with x's device): on meta tensors that must not raise, or no backward
    is ever compiled ahead. Each replay of cutile's backend queues its launches; none fails."""
    from tilegym_mamba2.backends import cutile as backend
    from tilegym_mamba2.runtime.tuning import choose_config
    with pytest.raises(ValueError):
        torch.cuda.get_device_properties(torch.device("meta"))
    queued = []
    monkeypatch.setattr(other, "KernelSignature", Signature)
    monkeypatch.setattr(other, "get_parameter_constraints_from_pyargs", lambda kernel, args, convention: tuple(
        (a.dtype, tuple(a.shape)) if isinstance(a, torch.Tensor) else a for a in args))
    monkeypatch.setattr(other, "_submit", lambda job: queued.append(job) or True)
    monkeypatch.setenv(other.SWITCH, "1")
    failed = other.stats["replays_failed"]

    class OnGpu:  # what compile_other_class reads of the call's x
        shape, is_cuda, device = (2, 256, 8, 64), True, "cuda:0"
    for replay in _plain_replays(256):
        queued.clear()
        other.compile_other_class(replay, OnGpu(), args=_plain_args(256))
        assert queued and other.stats["replays_failed"] == failed
    args = _layer_args(256, with_z=True, packed=False)
    queued.clear()
    other.compile_other_class(backend._layer_replay(choose_config(1, 256, 2, 6, 64, 128, 128), training=True),
                              OnGpu(), args=args, ungated=torch.zeros_like(args.x))
    assert {job.kernel._pyfunc.__name__ for job in queued} >= {"chunk_grads_columns_kernel", "chunk_states_walk_kernel"}
    assert other.stats["replays_failed"] == failed


# --- what cuTile would compile: every count's signatures are among those the replays queue

def _specialization(arg):
    """What cuTile's dispatcher specializes a launch argument on (cuda.tile 1.7, the C extension's
    array specialization bits): for arrays of up to 5 dimensions, each size's divisibility by 16
    and being 1, each stride's by 16 bytes and being 1; the base address's 16-byte alignment; whether elements
    are disjoint. Plain ints are runtime values; constants are their values."""
    if not isinstance(arg, torch.Tensor):
        return "int" if type(arg) is int else arg
    item = arg.element_size()
    dims = tuple((size % 16 == 0, size == 1, stride * item % 16 == 0, stride == 1)
                 for size, stride in zip(arg.shape, arg.stride())) if arg.ndim <= 5 else ()
    ordered = sorted(zip(arg.stride(), arg.shape))
    disjoint = arg.ndim == 0 or (ordered[0][0] > 0 and all(
        stride > 0 and stride >= inner_stride * inner_size
        for (inner_stride, inner_size), (stride, _) in zip(ordered, ordered[1:])))
    return arg.dtype, dims, arg.data_ptr() % 16 == 0, disjoint


def _signatures_of(replay, named, tokens, to):
    return set(_replayed(replay, tokens, to, describe=_specialization, **named))


@pytest.mark.parametrize("heads", [6, 80])
@pytest.mark.parametrize("first, then", [(8192, 5000), (256, 255), (1000, 777), (4096, 3000), (8192, 8002)])
def test_the_replays_cover_every_later_count(heads, first, then):
    """By cuTile's specialization rule, a call of ``then`` tokens after one of ``first`` (same
    dimensions, same config) compiles nothing the replays did not queue: the plain op's forward and
    backward, and the layer op's training step with z, without, and packed. With 6 heads a
    [batch, tokens, heads] fp32 row is 24 tokens bytes, a multiple of 16 only for even counts; a
    packed row's sequence ids, 4 tokens bytes."""
    from tilegym_mamba2.backends import cutile as backend
    from tilegym_mamba2.backends.cutile import chunk_backward_replay
    from tilegym_mamba2.core.validation import BackwardArgs
    from tilegym_mamba2.ssd.forward import run_stages
    from tilegym_mamba2.runtime.tuning import choose_config

    def plain(count):
        x = torch.zeros(2, count, heads, 64, dtype=torch.bfloat16)
        b = torch.zeros(2, count, 1, 128, dtype=torch.bfloat16)
        return {"args": BackwardArgs(x=x, a=torch.zeros(heads), b=b, c=b.clone(), d=torch.zeros(heads),
                                     dt=torch.zeros(2, count, heads), dout=torch.zeros_like(x),
                                     dfinal_state=torch.zeros(2, heads, 64, 128), chunk_size=256)}

    def layer(count, with_z, packed):
        x = torch.zeros(1, count, heads, 64, dtype=torch.bfloat16)
        b = torch.zeros(1, count, 1, 128, dtype=torch.bfloat16)
        cu_seqlens = torch.tensor([0, count // 3, count], dtype=torch.int32) if packed else None
        args = scan_combined_call(x, torch.zeros(1, count, heads), torch.zeros(heads), b, b.clone(), 256,
                                torch.zeros(heads), torch.zeros_like(x) if with_z else None, torch.zeros(heads),
                                None, None, cu_seqlens, True, (0.0, float("inf")), False, False)
        return {"args": args, "ungated": torch.zeros_like(x) if with_z and not packed else None}

    config = choose_config(2, first, 1, heads, 64, 128, 256)
    cases = [(lambda args: run_stages(*values(args)[:8], config), plain), (chunk_backward_replay, plain)]
    cases += [(backend._layer_replay(config, training=True), lambda count, z=z, p=p: layer(count, z, p))
              for z, p in ((True, False), (False, False), (False, True))]
    for replay, inputs in cases:
        queued = set()
        for to in [first] + other.other_class_counts(first):
            queued |= _signatures_of(replay, inputs(first), first, to)
        missing = _signatures_of(replay, inputs(then), then, then) - queued
        assert not missing, [kernel._pyfunc.__name__ for kernel, _ in missing]


def test_a_layer_step_then_a_plain_op_step_compile_no_other_class_themselves(torch_on_a_gpu_machine, monkeypatch):
    """The GPU test's sequence (test_other_token_class_gpu.py: a layer training step of 256 tokens,
    then 255; a plain op step of 200, then 208) with cuTile's dispatcher written out: a call
    compiles, through its kernel's _compile (hooked or not), each signature not compiled before,
    then the backend queues its other classes. The later class's steps compile nothing themselves."""
    from tilegym_mamba2.backends import cutile as backend
    from tilegym_mamba2.runtime.tuning import choose_config
    monkeypatch.setattr(other, "KernelSignature", Signature)
    monkeypatch.setattr(other, "get_parameter_constraints_from_pyargs",
                        lambda kernel, args, convention: tuple(_specialization(a) for a in args))
    for name, value in (("_seen", set()), ("_replayed", set()), ("_ready", {}), ("QUIET_S", 0.0)):
        monkeypatch.setattr(other, name, value)

    def layer(tokens):
        config = choose_config(1, tokens, 1, 6, 64, 64, 128)
        return [(backend._layer_replay(config, training=True),
                 {"args": _layer_args(tokens, True, False, groups=1, state=64), "ungated": None})]

    def plain(tokens):
        return [(replay, {"args": _plain_args(tokens)}) for replay in _plain_replays(tokens)]

    def launches(replay, named, tokens):  # a call's own: its replay at its own count
        return _replayed(replay, tokens, tokens, describe=lambda arg: arg, **named)
    kernels = {kernel for step, tokens in ((layer, 256), (plain, 200)) for replay, named in step(tokens)
               for kernel, _ in launches(replay, named, tokens)}
    compiled = []  # (kernel name, thread) of every compile

    def compile_tile(kernel, signature, context, compute_capability=None):
        compiled.append((kernel._pyfunc.__name__, threading.current_thread().name))
        return "binary", repr(signature)
    monkeypatch.setattr(type(next(iter(kernels))), "_compile", compile_tile)
    in_memory = set()

    def call(step, tokens):
        for replay, named in step(tokens):
            for kernel, args in launches(replay, named, tokens):
                signature = other._launch_signature(kernel, args)
                if (kernel, repr(signature)) not in in_memory:
                    in_memory.add((kernel, repr(signature)))
                    kernel._compile(signature, None, (9, 0))
            other.queue_other_class(replay, tokens, (9, 0), named)
        assert other.wait_idle(60)
    # Hooks hold the compile they wrap: earlier tests' hold cuTile's, this test's the stand-in.
    hooks = {kernel: vars(kernel).pop("_compile", None) for kernel in kernels}
    try:
        for step, first, then in ((layer, 256, 255), (plain, 200, 208)):
            call(step, first)
            del compiled[:]
            taken = other.stats["taken"]
            call(step, then)
            assert other.stats["taken"] > taken, step.__name__
            assert [name for name, thread in compiled if thread == threading.current_thread().name] == [], \
                step.__name__
    finally:
        for kernel, hook in hooks.items():
            vars(kernel).pop("_compile", None)
            if hook is not None:
                kernel._compile = hook
