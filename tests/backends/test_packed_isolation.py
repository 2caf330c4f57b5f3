"""One packed sequence's values never reach another's outputs, states or gradients, NaN and inf
included (the pytorch backend, on the CPU): every op with packed sequences or batch slots, a
non-finite value planted in one sequence, the others compared bit for bit with a clean run."""
import pytest
import torch

import tilegym_mamba2

CU = [0, 17, 50, 70]
TOKENS, HEADS, P, N, G = 70, 4, 8, 8, 2


def _layer_inputs(dtype=torch.float32):
    g = torch.Generator().manual_seed(11)

    def r(*shape):
        return torch.randn(*shape, generator=g, dtype=dtype)
    return dict(x=r(1, TOKENS, HEADS, P), dt=r(1, TOKENS, HEADS), A=-torch.rand(HEADS, generator=g, dtype=dtype) - .5,
                B=r(1, TOKENS, G, N), C=r(1, TOKENS, G, N), D=r(HEADS), z=r(1, TOKENS, HEADS, P), dt_bias=r(HEADS))


def _run_layer(inputs, dout, packing):
    leaves = {k: v.clone().requires_grad_() for k, v in inputs.items()}
    out, final = tilegym_mamba2.mamba_chunk_scan_combined(**leaves, chunk_size=16, dt_softplus=True,
                                                          return_final_states=True, backend="pytorch", **packing)
    (out * dout).sum().backward()
    return out.detach(), {k: v.grad for k, v in leaves.items()}


def _sequence_of(token):
    return max(i for i in range(len(CU) - 1) if CU[i] <= token)


PLANTS = [("dout", 52), ("x", 20), ("B", 60), ("C", 5), ("dt", 49), ("z", 17)]


@pytest.mark.parametrize("packing", ["cu_seqlens", "seq_idx"])
@pytest.mark.parametrize("where, token", PLANTS)
@pytest.mark.parametrize("value", [float("nan"), float("inf")])
def test_layer_op_keeps_a_sequences_non_finite_values_to_itself(packing, where, token, value):
    inputs = _layer_inputs()
    dout = torch.randn(1, TOKENS, HEADS, P, generator=torch.Generator().manual_seed(2))
    pack = ({"cu_seqlens": torch.tensor(CU, dtype=torch.int32)} if packing == "cu_seqlens" else
            {"seq_idx": torch.tensor([[_sequence_of(t) for t in range(TOKENS)]], dtype=torch.int32)})
    clean_out, clean_grads = _run_layer(inputs, dout, pack)
    poisoned = dict(inputs)
    if where == "dout":
        dout = dout.clone()
        dout[0, token, 1, 2] = value
    else:
        poisoned[where] = inputs[where].clone()
        poisoned[where][0, token] = value
    out, grads = _run_layer(poisoned, dout, pack)
    hit = _sequence_of(token)
    for s in range(len(CU) - 1):
        if s == hit:
            continue
        part = slice(CU[s], CU[s + 1])
        assert torch.equal(out[:, part], clean_out[:, part]), f"out of sequence {s}"
        for name in ("x", "dt", "B", "C", "z"):
            assert torch.equal(grads[name][:, part], clean_grads[name][:, part]), f"d{name} of sequence {s}"
