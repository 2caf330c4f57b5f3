"""runtime/launch.py on the CPU: what cuTile's launch is handed."""
import pytest
import torch

pytest.importorskip("cuda.tile")

from tilegym_mamba2.runtime import launch  # noqa: E402


def test_launch_passes_the_raw_handle_of_the_arguments_device_stream(monkeypatch):
    """The raw int handle (no Stream object per launch), asked for the first argument's device."""
    calls = []
    monkeypatch.setattr(launch, "_cutile_launch", lambda *a: calls.append(a))
    monkeypatch.setattr(launch, "_raw_stream", lambda index: ("raw", index))
    monkeypatch.setattr(torch.cuda, "current_stream", lambda index=None: pytest.fail("a Stream object was built"))
    x = torch.zeros(4)
    launch.launch((3, 1, 1), "kernel", (x, 7, True))
    assert calls == [(("raw", -1), (3, 1, 1), "kernel", (x, 7, True))]


def test_launch_falls_back_to_the_stream_object_without_the_raw_query(monkeypatch):
    calls = []
    monkeypatch.setattr(launch, "_cutile_launch", lambda *a: calls.append(a))
    monkeypatch.setattr(launch, "_raw_stream", None)
    monkeypatch.setattr(torch.cuda, "current_stream", lambda index=None: ("stream", index))
    launch.launch((1,), "kernel", (torch.zeros(1),))
    assert calls[0][0] == ("stream", -1)


def test_recording_runs_nothing(monkeypatch):
    monkeypatch.setattr(launch, "_cutile_launch", lambda *a: pytest.fail("launched while recording"))
    with launch.recording_launches() as launches:
        launch.launch((1,), "kernel", [1, 2])
    assert launches == [("kernel", (1, 2))]


def test_recording_is_per_thread(monkeypatch):
    """A first call records its replay (other_token_class.py) while other threads' launches run."""
    import threading
    ran = []
    monkeypatch.setattr(launch, "_cutile_launch", lambda *a: ran.append(a[2]))
    monkeypatch.setattr(launch, "_raw_stream", lambda index: index)
    with launch.recording_launches() as launches:
        thread = threading.Thread(target=launch.launch, args=((1,), "elsewhere", (torch.zeros(1),)))
        thread.start()
        thread.join()
        launch.launch((1,), "here", (torch.zeros(1),))
    assert ran == ["elsewhere"] and [kernel for kernel, _ in launches] == ["here"]
