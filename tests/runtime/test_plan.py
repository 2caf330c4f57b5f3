"""Launch plans (runtime/plan.py) on the CPU: a repeated call skips the checks and the config
lookup, launches exactly what the first call launched, and bad input still meets the checks.

Launches are recorded, not run. The checks' CUDA-only part (the device type and its compute
capability) is stood in for, so CPU tensors pass where CUDA tensors would; every other check runs.
"""
import pytest
import torch

pytest.importorskip("cuda.tile")

from tilegym_mamba2.runtime import limits  # noqa: E402
from tilegym_mamba2.runtime import plan  # noqa: E402
from tilegym_mamba2.runtime.launch import recording_launches  # noqa: E402


@pytest.fixture(autouse=True)
def cpu_as_cuda(monkeypatch):
    """CPU tensors pass the cutile backend's device checks; no tuning (it would time on a GPU)."""
    check_device = limits.check_cuda_device
    monkeypatch.setattr(limits, "_capability", lambda index: (9, 0))
    monkeypatch.setattr(limits, "check_cuda_device",
                        lambda device: check_device(torch.device("cuda", 0) if device.type == "cpu" else device))
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: "NVIDIA H200")
    monkeypatch.setenv("TILEGYM_MAMBA2_TUNE", "0")
    plan.forget()
    yield
    plan.forget()


def forward_inputs(batch=2, tokens=300, groups=2, heads=4, head_size=32, state_size=64, chunk_size=64, init=True,
                   dtype=torch.bfloat16, seed=0):
    gen = torch.Generator().manual_seed(seed)

    def randn(*shape, dtype=dtype):
        return torch.randn(shape, generator=gen).to(dtype)

    return dict(x=randn(batch, tokens, heads, head_size), a=-torch.rand(heads, generator=gen) - 0.5,
                b=randn(batch, tokens, groups, state_size), c=randn(batch, tokens, groups, state_size),
                d=randn(heads, dtype=torch.float32), dt=torch.rand(batch, tokens, heads, generator=gen) * 0.1,
                init_state=randn(batch, heads, head_size, state_size, dtype=torch.float32) if init else None,
                chunk_size=chunk_size)


def layer_inputs(options=(), batch=1, tokens=300, heads=4, head_size=32, state_size=64, groups=1, seed=1):
    f = forward_inputs(batch, tokens, groups, heads, head_size, state_size, init=False, seed=seed)
    kw = dict(x=f["x"], dt=f["dt"], A=f["a"], B=f["b"], C=f["c"], chunk_size=128)
    if "D" in options:
        kw["D"] = f["d"]
    if "D_channel" in options:
        kw["D"] = torch.randn(heads, head_size)
    if "z" in options:
        kw["z"] = torch.randn_like(f["x"])
    if "dt_bias" in options:
        kw["dt_bias"] = torch.randn(heads)
    if "softplus" in options:
        kw["dt_softplus"] = True
    if "limit" in options:
        kw["dt_limit"] = (0.001, 0.1)
    if "init" in options:
        kw["initial_states"] = torch.randn(batch, heads, head_size, state_size)
    if "final" in options:
        kw["return_final_states"] = True
    if "cu" in options:
        kw["cu_seqlens"] = torch.tensor([0, 17, tokens - 40, tokens], dtype=torch.int32)
        kw["return_varlen_states"] = True
    return kw


def forward(**kw):
    from tilegym_mamba2.backends.cutile import mamba2_chunk_forward
    return mamba2_chunk_forward(**kw)


def layer(**kw):
    from tilegym_mamba2.backends.cutile import mamba_chunk_scan_combined
    return mamba_chunk_scan_combined(**kw)


def recorded(op, kw, inputs):
    """op(**kw)'s launches, each as (kernel, described args): a tensor by its layout, and by
    which input it is when it is one (outputs are new on every call)."""
    names = {t.data_ptr(): name for name, t in inputs.items() if isinstance(t, torch.Tensor)}

    def describe(arg):
        if not isinstance(arg, torch.Tensor):
            return type(arg), arg
        return (tuple(arg.shape), arg.stride(), arg.dtype, arg.device, arg.storage_offset(),
                names.get(arg.data_ptr(), "new"))

    with recording_launches() as launches:
        op(**kw)
    return [(kernel, tuple(map(describe, args))) for kernel, args in launches]


def counting_checks(monkeypatch):
    """Counts full checks of either op."""
    import tilegym_mamba2.backends.cutile as backend
    calls = []
    for module, name in ((backend, "check_forward_args"), (backend, "check_scan_combined_args")):
        original = getattr(module, name)
        monkeypatch.setattr(module, name, lambda *a, _original=original, **k: calls.append(1) or _original(*a, **k))
    return calls


FORWARD_CASES = {
    "ragged, with init": {},
    "no init": dict(init=False),
    "one chunk": dict(tokens=40, init=False),
    "one chunk, init": dict(tokens=64),
    "exact chunks, groups 1": dict(tokens=512, groups=1),
    "segments of 2 chunks": dict(batch=1, tokens=2048, heads=32, groups=1, head_size=64, state_size=128),
    "head 64, state 128, fp16": dict(tokens=1000, heads=8, head_size=64, state_size=128, dtype=torch.float16),
    "fp32, state 256": dict(batch=1, tokens=129, heads=16, groups=1, state_size=256, dtype=torch.float32),
}


@pytest.mark.parametrize("case", FORWARD_CASES, ids=list(FORWARD_CASES))
def test_planned_forward_launches_what_the_checked_path_launches(case, monkeypatch):
    kw = forward_inputs(**FORWARD_CASES[case])
    checks = counting_checks(monkeypatch)
    first = recorded(forward, kw, kw)
    assert checks == [1]
    again = recorded(forward, kw, kw)
    assert checks == [1]  # the plan's: no second check
    plan.forget()
    unplanned = recorded(forward, kw, kw)
    assert checks == [1, 1]
    assert first == again == unplanned and len(first) >= 2


LAYER_CASES = {
    "no options": (),
    "D per head, z": ("D", "z"),
    "D per channel, bias, softplus, limit": ("D_channel", "dt_bias", "softplus", "limit"),
    "init, final": ("init", "final", "D"),
    "everything": ("D_channel", "z", "dt_bias", "softplus", "limit", "init", "final"),
}


@pytest.mark.parametrize("case", LAYER_CASES, ids=list(LAYER_CASES))
def test_planned_layer_op_launches_what_the_checked_path_launches(case, monkeypatch):
    kw = layer_inputs(LAYER_CASES[case])
    checks = counting_checks(monkeypatch)
    first = recorded(layer, kw, kw)
    again = recorded(layer, kw, kw)
    assert checks == [1]
    plan.forget()
    assert first == again == recorded(layer, kw, kw) and checks == [1, 1]


def test_packed_sequences_are_checked_every_call(monkeypatch):
    """cu_seqlens' values can change from call to call with the same shapes: no plan skips them."""
    kw = layer_inputs(("cu", "D"))
    checks = counting_checks(monkeypatch)
    first = recorded(layer, kw, kw)
    assert recorded(layer, kw, kw) == first and checks == [1, 1]
    bad = dict(kw, cu_seqlens=torch.tensor([0, 40, 17, 300], dtype=torch.int32))
    with pytest.raises(ValueError, match="cu_seqlens must start at 0, rise strictly"):
        layer(**bad)


def error_of(op, kw):
    with pytest.raises((TypeError, ValueError)) as info:
        with recording_launches():
            op(**kw)
    return type(info.value), str(info.value)


FORWARD_BAD = {
    "b's dtype": lambda kw: dict(kw, b=kw["b"].float()),
    "d's shape": lambda kw: dict(kw, d=kw["d"][:-1]),
    "init_state's shape": lambda kw: dict(kw, init_state=kw["init_state"][:1]),
    "init_state an int tensor": lambda kw: dict(kw, init_state=kw["init_state"].int()),
    "a on another device": lambda kw: dict(kw, a=kw["a"].to("meta")),
    "chunk_size a float": lambda kw: dict(kw, chunk_size=64.0),
    "chunk_size True": lambda kw: dict(kw, chunk_size=True),
    "chunk_size 48": lambda kw: dict(kw, chunk_size=48),
    "x a list": lambda kw: dict(kw, x=kw["x"].tolist()),
    "x's dtype": lambda kw: dict(kw, x=kw["x"].double(), b=kw["b"].double(), c=kw["c"].double()),
    "head_size 24": lambda kw: forward_inputs(head_size=24),
}


def assert_same_error_after_a_plan(op, kw, bad_kw):
    expected = error_of(op, bad_kw)  # no plan yet
    with recording_launches():
        op(**kw)  # settles the plan of the good signature
    assert len(plan._plans) > 0
    assert error_of(op, bad_kw) == expected
    assert error_of(op, bad_kw) == expected  # a failed call leaves no plan


@pytest.mark.parametrize("bad", FORWARD_BAD, ids=list(FORWARD_BAD))
def test_bad_forward_input_after_a_plan_gets_the_same_error(bad):
    kw = forward_inputs()
    assert_same_error_after_a_plan(forward, kw, FORWARD_BAD[bad](kw))


LAYER_BAD = {
    "dt_softplus 1": lambda kw: dict(kw, dt_softplus=1),
    "return_final_states 0": lambda kw: dict(kw, return_final_states=0),
    "dt_limit of bools": lambda kw: dict(kw, dt_limit=(False, True)),
    "dt_limit reversed": lambda kw: dict(kw, dt_limit=(0.1, 0.001)),
    "dt_limit of three": lambda kw: dict(kw, dt_limit=(0.0, 0.1, 1.0)),
    "dt_limit with nan": lambda kw: dict(kw, dt_limit=(float("nan"), 1.0)),
    "D's shape": lambda kw: dict(kw, D=kw["D"][:, :-1]),
    "z's shape": lambda kw: dict(kw, z=kw["z"][:, :-1]),
    "dt_bias on another device": lambda kw: dict(kw, dt_bias=kw["dt_bias"].to("meta")),
    "chunk_size 100": lambda kw: dict(kw, chunk_size=100),
    "varlen states without cu_seqlens": lambda kw: dict(kw, return_varlen_states=True),
}


@pytest.mark.parametrize("bad", LAYER_BAD, ids=list(LAYER_BAD))
def test_bad_layer_input_after_a_plan_gets_the_same_error(bad):
    kw = layer_inputs(("D_channel", "z", "dt_bias", "softplus", "limit", "final"))
    bad_kw = LAYER_BAD[bad](kw)
    expected = error_of(layer, bad_kw)
    with recording_launches():  # plans for both values of each flag
        for softplus in (True, False):
            for final in (True, False):
                layer(**dict(kw, dt_softplus=softplus, return_final_states=final))
    assert error_of(layer, bad_kw) == expected


def test_equal_values_of_another_type_are_another_signature():
    """True == 1 == 1.0 and hash alike: the signature keeps their types apart."""
    assert plan.signature(True) != plan.signature(1) != plan.signature(1.0)
    assert plan.signature((0.0, 1.0)) != plan.signature([0.0, 1.0]) != plan.signature((0, 1))
    assert plan.signature(object()) is None and plan.signature((torch.zeros(1),)) is None


def test_a_changed_tuning_switch_is_another_signature(monkeypatch):
    x = torch.zeros(2, 3)
    before = plan.signature(x)
    monkeypatch.setenv("TILEGYM_MAMBA2_TUNE", "1")
    assert plan.signature(x) != before
    monkeypatch.setenv("TILEGYM_MAMBA2_TUNE", "0")
    assert plan.signature(x) == before


def test_nothing_is_remembered_during_graph_capture(monkeypatch):
    """During capture the config is the heuristic's, not a settled choice; the next call outside
    the capture settles it."""
    kw = forward_inputs()
    checks = counting_checks(monkeypatch)
    monkeypatch.setattr(plan, "capturing", lambda: True)
    recorded(forward, kw, kw)
    recorded(forward, kw, kw)
    assert plan._plans == {} and checks == [1, 1]
    monkeypatch.setattr(plan, "capturing", lambda: False)
    recorded(forward, kw, kw)
    recorded(forward, kw, kw)
    assert len(plan._plans) > 0 and checks == [1, 1, 1]


def test_a_planned_call_neither_tunes_nor_looks_the_config_up(monkeypatch):
    """What keeps a planned call capturable: no config lookup, so no timing and no sync."""
    from tilegym_mamba2.ssd import layer as scan_combined
    kw = forward_inputs()
    recorded(forward, kw, kw)
    from tilegym_mamba2.ssd import forward as cutile_forward
    monkeypatch.setattr(cutile_forward, "config_for", lambda *a, **k: pytest.fail("config_for on a planned call"))
    recorded(forward, kw, kw)
    layer_kw = layer_inputs(("D", "z"))
    recorded(layer, layer_kw, layer_kw)
    monkeypatch.setattr(scan_combined, "config_for", lambda *a, **k: pytest.fail("config_for on a planned call"))
    recorded(layer, layer_kw, layer_kw)


def test_plans_are_bounded(monkeypatch):
    monkeypatch.setattr(plan, "MAX_PLANS", 4)
    for i in range(9):
        plan.remember(("key", i), i)
    assert 0 < len(plan._plans) <= 4 and plan.planned(("key", 8)) == 8


@pytest.mark.parametrize("fast", [True, False], ids=["environ data", "os.environ.get"])
def test_tuning_switches_follow_the_environment(fast, monkeypatch):
    from tilegym_mamba2.runtime import tuning
    if not fast:
        monkeypatch.setattr(tuning, "_environ_data", None)
    seen = []
    for value in ("1", "0", None):
        for name in tuning.SWITCHES:
            if value is None:
                monkeypatch.delenv(name, raising=False)
            else:
                monkeypatch.setenv(name, value + name)
        seen.append(tuning.tuning_switches())
    assert len(set(seen)) == 3 and seen[-1] == (None, None, None)


# ---- the decode-step ops: selective_state_update and causal_conv1d_update ------------------------

def state_update_inputs(form=(), batch=3, heads=4, head_size=16, state_size=32, groups=2, seed=2):
    """Keyword arguments of selective_state_update. By default HF's Mamba-2 call: dt, A, D and
    dt_bias expanded with stride 0 from per-head values, z, softplus. ``form`` changes it."""
    gen = torch.Generator().manual_seed(seed)

    def randn(*shape, dtype=torch.bfloat16):
        return torch.randn(shape, generator=gen).to(dtype)

    h, p, n = heads, head_size, state_size
    kw = dict(state=randn(batch, h, p, n, dtype=torch.float32), x=randn(batch, h, p),
              dt=randn(batch, h, 1).expand(-1, -1, p), A=-randn(h, 1, 1, dtype=torch.float32).abs().expand(-1, p, n),
              B=randn(batch, groups, n), C=randn(batch, groups, n), D=randn(h, 1).expand(-1, p), z=randn(batch, h, p),
              dt_bias=randn(h, 1).expand(-1, p), dt_softplus=True)
    if "per channel" in form:  # dt, dt_bias and D per channel, A per channel
        kw.update(dt=randn(batch, h, p), dt_bias=randn(h, p), D=randn(h, p),
                  A=-randn(h, p, 1, dtype=torch.float32).abs().expand(-1, -1, n))
    if "A per element" in form:
        kw["A"] = -randn(h, p, n, dtype=torch.float32).abs()
    if "B expanded" in form:  # read per element: made dense on every call
        kw["B"] = randn(1, groups, n).expand(batch, -1, -1)
    for name in ("z", "D", "dt_bias"):
        if f"no {name}" in form:
            kw[name] = None
    if "no softplus" in form:
        kw["dt_softplus"] = False
    if "indices" in form:  # a padding row too
        kw["state"] = randn(2 * batch, h, p, n, dtype=torch.float32)
        kw["state_batch_indices"] = torch.tensor([4, -1, 1][:batch], dtype=torch.int32)
    if "without heads" in form:  # mamba_ssm's 3-D form: one head of head_size channels
        kw = state_update_inputs(("per channel",), batch, 1, head_size, state_size, 1, seed)
        kw = {k: v.squeeze(0 if k in ("A", "D", "dt_bias") else 1) if isinstance(v, torch.Tensor) else v
              for k, v in kw.items()}
    return kw


def conv_update_inputs(form=(), batch=3, dim=40, width=4, seed=3):
    """Keyword arguments of causal_conv1d_update: by default HF's decode step (x [batch, dim],
    conv_state [batch, dim, width], bias, silu)."""
    gen = torch.Generator().manual_seed(seed)

    def randn(*shape):
        return torch.randn(shape, generator=gen).to(torch.bfloat16)

    kw = dict(x=randn(batch, dim), conv_state=randn(batch, dim, width), weight=randn(dim, width),
              bias=randn(dim), activation="silu")
    if "tokens" in form:
        kw["x"] = randn(batch, 5, dim).transpose(1, 2)  # [batch, dim, 5], channel-last as HF keeps it
    if "no bias" in form:
        kw.update(bias=None, activation=None)
    if "circular" in form:
        kw.update(conv_state=randn(batch, dim, 8), cache_seqlens=torch.tensor([3, 9, 0][:batch], dtype=torch.int32))
    if "indices" in form:
        kw.update(conv_state=randn(2 * batch, dim, width), conv_state_indices=torch.tensor([5, -1, 0][:batch]))
    return kw


def state_update(**kw):
    from tilegym_mamba2.serving.selective_state_update import selective_state_update
    return selective_state_update(**kw)


def conv_update(**kw):
    from tilegym_mamba2.serving.causal_conv1d_update import causal_conv1d_update
    return causal_conv1d_update(**kw)


def counting_serving_checks(monkeypatch):
    """Counts full checks of either decode-step op."""
    from tilegym_mamba2.serving import causal_conv1d_update, selective_state_update
    calls = []
    for module, name in ((selective_state_update, "check_state_update_args"),
                         (causal_conv1d_update, "check_conv_update_args")):
        original = getattr(module, name)
        monkeypatch.setattr(module, name, lambda *a, _original=original, **k: calls.append(1) or _original(*a, **k))
    return calls


SERVING_CASES = {
    "state update, HF's call": (state_update, state_update_inputs, ()),
    "state update, per channel, indices": (state_update, state_update_inputs, ("per channel", "indices")),
    "state update, A per element, no z": (state_update, state_update_inputs, ("A per element", "no z")),
    "state update, no D, no dt_bias, no softplus": (state_update, state_update_inputs,
                                                    ("no D", "no dt_bias", "no softplus")),
    "state update, B expanded": (state_update, state_update_inputs, ("B expanded", "indices")),
    "state update, without heads": (state_update, state_update_inputs, ("without heads",)),
    "conv update, HF's step": (conv_update, conv_update_inputs, ()),
    "conv update, tokens, indices": (conv_update, conv_update_inputs, ("tokens", "indices")),
    "conv update, circular, no bias": (conv_update, conv_update_inputs, ("circular", "no bias")),
}


@pytest.mark.parametrize("case", SERVING_CASES, ids=list(SERVING_CASES))
def test_planned_decode_step_launches_what_the_checked_path_launches(case, monkeypatch):
    op, inputs, form = SERVING_CASES[case]
    kw = inputs(form)
    checks = counting_serving_checks(monkeypatch)
    first = recorded(op, kw, kw)
    again = recorded(op, kw, kw)
    assert checks == [1]  # the plan's: no second check
    plan.forget()
    unplanned = recorded(op, kw, kw)
    assert checks == [1, 1]
    assert first == again == unplanned and len(first) == 1


def test_planned_decode_step_returns_the_output_it_launched():
    """The output of the form without heads (and of x [batch, dim]) is squeezed on a planned call too."""
    for op, kw in ((state_update, state_update_inputs(("without heads",))), (conv_update, conv_update_inputs())):
        with recording_launches() as launches:
            outs = [op(**kw), op(**kw)]
        assert [out.shape for out in outs] == [kw["x"].shape] * 2
        for out, (_, args) in zip(outs, launches, strict=True):
            assert out.data_ptr() in [arg.data_ptr() for arg in args if isinstance(arg, torch.Tensor)]


SERVING_BAD = {
    "state expanded (only its strides differ)":
        (state_update, lambda kw: dict(kw, state=kw["state"][:1].expand_as(kw["state"]))),
    "dt_softplus 1": (state_update, lambda kw: dict(kw, dt_softplus=1)),
    "x's dtype": (state_update, lambda kw: dict(kw, x=kw["x"].double())),
    "B's shape": (state_update, lambda kw: dict(kw, B=kw["B"][:, :1])),
    "A a list": (state_update, lambda kw: dict(kw, A=kw["A"].tolist())),
    "state_batch_indices float": (state_update, lambda kw: dict(kw, state_batch_indices=torch.zeros(3))),
    "state_batch_indices on another device":
        (state_update, lambda kw: dict(kw, state_batch_indices=torch.zeros(3, dtype=torch.int32, device="meta"))),
    "conv_state expanded (only its strides differ)":
        (conv_update, lambda kw: dict(kw, conv_state=kw["conv_state"][:1].expand_as(kw["conv_state"]))),
    "activation relu": (conv_update, lambda kw: dict(kw, activation="relu")),
    "weight's width": (conv_update, lambda kw: dict(kw, weight=kw["weight"][:, :1])),
    "cache_seqlens' shape": (conv_update, lambda kw: dict(kw, cache_seqlens=torch.zeros(2, dtype=torch.int32))),
}


@pytest.mark.parametrize("bad", SERVING_BAD, ids=list(SERVING_BAD))
def test_bad_decode_step_input_after_a_plan_gets_the_same_error(bad):
    op, make_bad = SERVING_BAD[bad]
    kw = state_update_inputs() if op is state_update else conv_update_inputs()
    assert_same_error_after_a_plan(op, kw, make_bad(kw))


def test_no_decode_step_plan_is_remembered_during_graph_capture(monkeypatch):
    checks = counting_serving_checks(monkeypatch)
    monkeypatch.setattr(plan, "capturing", lambda: True)
    for op, kw in ((state_update, state_update_inputs()), (conv_update, conv_update_inputs())):
        recorded(op, kw, kw)
        recorded(op, kw, kw)
    assert plan._plans == {} and checks == [1, 1, 1, 1]
