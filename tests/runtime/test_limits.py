"""runtime/limits.py: what each backend takes, and the cuTile device rule's messages."""
import pytest
import torch

from tilegym_mamba2.runtime import limits


def test_the_cutile_rule_refuses_a_cpu_tensor_naming_the_way_out():
    with pytest.raises(ValueError, match='needs CUDA tensors, got tensors on cpu.*backend="pytorch"'):
        limits.CUTILE.check_device(torch.device("cpu"))


def test_an_old_gpu_is_refused_by_its_capability(monkeypatch):
    monkeypatch.setattr(limits, "_capability", lambda index: (7, 5))
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: "Tesla T4")
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    with pytest.raises(ValueError, match="compute capability 8.0 or newer, Tesla T4 is 7.5"):
        limits.check_cuda_device(torch.device("cuda"))


def test_the_backends_limits():
    assert torch.float64 in limits.PYTORCH.input_dtypes and torch.float64 not in limits.CUTILE.input_dtypes
    assert limits.PYTORCH.check_device is None and limits.PYTORCH.head_sizes is None
    assert limits.CUTILE.split_state_sizes == (512,) and limits.CUTILE.serving_max_state == 256
