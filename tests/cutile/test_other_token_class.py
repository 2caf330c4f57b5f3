"""cutile/other_token_class.py on the CPU: which token count stands for the other class, the meta
copies a replay runs on, and how a call and the background thread share the compiles (with a
stand-in kernel and signatures; the GPU test runs cuTile's own)."""
import dataclasses
import threading

import pytest
import torch

pytest.importorskip("cuda.tile")

from tilegym_mamba2.core.validation import ForwardArgs  # noqa: E402
from tilegym_mamba2.cutile import launch, other_token_class as other  # noqa: E402


def test_the_other_class_has_as_many_chunks_and_the_other_divisibility():
    for tokens in range(2, 5000):
        to = other.other_class_tokens(tokens)
        assert (to % 16 == 0) != (tokens % 16 == 0), tokens
        assert to > 1 and -(-to // 64) == -(-tokens // 64), tokens


def test_one_token_is_a_class_of_its_own():
    assert other.other_class_tokens(1) is None


def test_meta_copies_move_the_token_axis_of_token_arguments_only():
    x = torch.zeros(2, 48, 4, 8, dtype=torch.bfloat16)
    projected = torch.zeros(2, 48, 100)  # a layer's in_proj output: x is a view of it, rows 4800 apart
    view = projected[..., 10:42].view(2, 48, 4, 8)
    state = torch.zeros(2, 4, 8, 48)  # no token axis, even where a size equals the token count
    args = ForwardArgs(x, torch.zeros(4), view, view, torch.zeros(4), torch.zeros(2, 48, 4), state, 128)
    meta = other._on_meta("args", args, 48, 47)
    assert type(meta) is ForwardArgs and all(t.device.type == "meta" for t in meta if isinstance(t, torch.Tensor))
    assert meta.x.shape == (2, 47, 4, 8) and meta.x.stride() == (47 * 32, 32, 8, 1) and meta.x.dtype == torch.bfloat16
    assert meta.b.shape == (2, 47, 4, 8) and meta.b.stride() == (47 * 100, 100, 8, 1)
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
    assert kernel.compiled == [(Signature((False,), other._CONVENTION), "tilegym-mamba2-precompile")]
    # What cuTile's dispatcher does on the first launch of 63 tokens:
    assert kernel._compile(Signature((False,), other._CONVENTION), None, (9, 0)) == ("binary", (False,))
    assert len(kernel.compiled) == 1 and other.stats["taken"] == before["taken"] + 1
    # Another capability, or the call's own class: the call compiles them itself.
    kernel._compile(Signature((False,), other._CONVENTION), None, (10, 0))
    kernel._compile(Signature((True,), other._CONVENTION), None, (9, 0))
    assert [thread for _, thread in kernel.compiled[1:]] == [threading.current_thread().name] * 2


def test_a_call_takes_a_compile_the_thread_has_not_started_and_it_runs_once(fake_cutile, monkeypatch):
    kernel, replay = fake_cutile
    monkeypatch.setattr(other, "QUIET_S", 3600.0)
    other._call_compiling(0)  # a call compiled just now: the thread waits
    assert other.queue_other_class(replay, 64, (9, 0), {"x": torch.zeros(2, 64, 4)}) == 1
    kernel._compile(Signature((False,), other._CONVENTION), None, (9, 0))
    assert other.wait_idle(60)
    assert [thread for _, thread in kernel.compiled] == [threading.current_thread().name]


def test_a_replay_that_fails_on_meta_tensors_queues_nothing(fake_cutile):
    kernel, _ = fake_cutile

    def replay(x):
        x.tolist()  # reads values: meta tensors have none
    assert other.queue_other_class(replay, 64, (9, 0), {"x": torch.zeros(2, 64, 4)}) == 0


def test_the_switch_and_cpu_tensors(fake_cutile, monkeypatch):
    """TILEGYM_MAMBA2_PRECOMPILE=0 queues nothing, nor does a call on CPU tensors; otherwise a GPU
    call's replay is queued."""
    kernel, replay = fake_cutile
    x = torch.zeros(2, 64, 4)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (9, 0))
    monkeypatch.setenv(other.SWITCH, "1")
    other.compile_other_class(replay, x, x=x)  # CPU tensors: no GPU to compile for
    assert other._ready == {}

    class OnGpu:  # what compile_other_class reads of the call's x
        shape, is_cuda, device = x.shape, True, "cuda:0"
    monkeypatch.setenv(other.SWITCH, "0")
    other.compile_other_class(replay, OnGpu(), x=x)
    assert other._ready == {}
    monkeypatch.setenv(other.SWITCH, "1")
    other.compile_other_class(replay, OnGpu(), x=x)
    assert other.wait_idle(60) and [signature for signature, _ in kernel.compiled] == [
        Signature((False,), other._CONVENTION)]
