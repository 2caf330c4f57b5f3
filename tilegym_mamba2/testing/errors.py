"""The relative error that every check of this package (tests, fuzz, the main command, bench)
measures, with one rule for non-finite values."""
import torch


def relative_error(got: torch.Tensor, ref: torch.Tensor) -> float:
    """‖got − ref‖ / ‖ref‖ in float64 (‖ref‖ at least 1e-30). A NaN or inf in ``got`` (an
    unwritten element, an overflow) gives inf: infinitely wrong, so that it fails every tolerance
    and wins every max() (a NaN would lose to any number there)."""
    got = got.detach().double()
    ref = ref.detach().double().to(got.device)
    if not torch.isfinite(got).all():
        return float("inf")
    return ((got - ref).norm() / ref.norm().clamp_min(1e-30)).item()
