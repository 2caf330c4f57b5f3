"""Expert layers a CUDA graph can capture: the mixture-of-experts hybrids' decode step in graphs.

transformers' expert layers route tokens by their counts per expert, read on the host (5.3's
GraniteMoeHybrid router calls ``.tolist()``; the eager experts of every release loop over the
experts that were hit, a ``nonzero`` then an ``.item()`` per expert), which a capture cannot hold:
the counts of the captured step would be replayed for every later token. While a graph is being
captured, the expert layers of a model given to ``enable_decode_graphs`` run ``routed_experts``
instead: the same router and the same expert functions, with the choice of experts made on the
device (gathers by the router's indices) and a fixed amount of work per token. Outside a capture
(prefill, eager decode, training) the layers run transformers' own forward unchanged.

Two layouts are known: the experts modules of transformers' ``use_experts_implementation``
(NemotronH from 5.3, GraniteMoeHybrid from 5.17: ``forward(hidden_states, top_k_index,
top_k_weights)`` over ``gate_up_proj`` or ``up_proj`` and ``down_proj``), and 5.3's
GraniteMoeHybridMoE (a ``router`` whose ``layer`` gives the logits, ``input_linear`` and
``output_linear`` holding [experts, out, in] weights). A module that looks like experts but is
neither is refused, naming its class.
"""
import types

import torch

_EAGER = "_tilegym_mamba2_eager_forward"  # on a module we gave a capture-safe forward: its own
# Gathering a pair's expert weights writes a copy that the matmul reads again: about 3 reads of an
# expert per (token, expert) pair, against 1 per expert when every expert runs on every token.
GATHER_COST = 3


def routed_experts(x, top_k_index, top_k_weights, up, down, activate, *, up_bias=None, down_bias=None,
                   transposed=False):
    """sum_k top_k_weights[t, k] * down_e(activate(up_e(x_t))) with e = top_k_index[t, k], for
    x [tokens, in]; up, down [experts, out, in] ([experts, in, out] when ``transposed``); biases
    [experts, out]. No host read and the same work for every routing, so a graph can replay it.

    With few (token, expert) pairs each pair gathers its expert's weights (the experts a step uses,
    read about GATHER_COST times); with more, every expert runs on every token and the router's
    weights (zero where not chosen) mix them, reading each expert once."""
    tokens, top_k = top_k_index.shape
    experts = up.shape[0]
    if GATHER_COST * tokens * top_k <= experts:
        index = top_k_index.reshape(-1)
        pairs = x.repeat_interleave(top_k, dim=0)  # [tokens * top_k, in], pair (t, k) at t * top_k + k
        hidden = _per_pair(pairs, up[index], transposed)
        if up_bias is not None:
            hidden = hidden + up_bias[index]
        out = _per_pair(activate(hidden), down[index], transposed)
        if down_bias is not None:
            out = out + down_bias[index]
        # Summed in the weights' dtype, as transformers' experts sum (fp32 for NemotronH's router).
        acc = torch.promote_types(out.dtype, top_k_weights.dtype)
        weighted = out.to(acc) * top_k_weights.reshape(-1, 1).to(acc)
        return weighted.view(tokens, top_k, -1).sum(dim=1)
    mixing = torch.zeros(tokens, experts, dtype=top_k_weights.dtype, device=x.device)
    mixing.scatter_add_(1, top_k_index, top_k_weights)  # a token's weight for each expert, 0 if not chosen
    hidden = _all_experts(x.expand(experts, -1, -1), up, transposed)  # [experts, tokens, out]
    if up_bias is not None:
        hidden = hidden + up_bias[:, None]
    out = _all_experts(activate(hidden), down, transposed)
    if down_bias is not None:
        out = out + down_bias[:, None]
    acc = torch.promote_types(out.dtype, top_k_weights.dtype)
    return torch.einsum("eto,te->to", out.to(acc), mixing.to(acc))


def _per_pair(inputs, weights, transposed):
    """[pairs, in] through [pairs, out, in] (or [pairs, in, out]) -> [pairs, out]."""
    if transposed:
        return torch.bmm(inputs[:, None], weights)[:, 0]
    return torch.bmm(weights, inputs[:, :, None])[..., 0]


def _all_experts(inputs, weights, transposed):
    """[experts, tokens, in] through [experts, out, in] (or [experts, in, out]) -> [experts, tokens, out]."""
    return torch.bmm(inputs, weights if transposed else weights.transpose(1, 2))


# --- the two layouts ------------------------------------------------------------------------------

def _experts_interface_forward(self, hidden_states, top_k_index, top_k_weights):
    """A ``use_experts_implementation`` experts module's forward, capture-safe while capturing."""
    if not torch.cuda.is_current_stream_capturing():
        return getattr(self, _EAGER)(hidden_states, top_k_index, top_k_weights)
    gated = getattr(self, "has_gate", True)
    up = self.gate_up_proj if gated else self.up_proj
    bias = getattr(self, "has_bias", False)
    activate = self._apply_gate if gated else self.act_fn
    out = routed_experts(hidden_states, top_k_index, top_k_weights, up, self.down_proj, activate,
                         up_bias=(self.gate_up_proj_bias if gated else self.up_proj_bias) if bias else None,
                         down_bias=self.down_proj_bias if bias else None,
                         transposed=getattr(self, "is_transposed", False))
    return out.to(hidden_states.dtype)


def _parallel_experts_moe_forward(self, layer_input):
    """5.3's GraniteMoeHybridMoE forward, capture-safe while capturing: its router's choice (top-k of
    the fp32 logits, softmax over them in the input's dtype), its experts, no ``.tolist()``."""
    if not torch.cuda.is_current_stream_capturing():
        return getattr(self, _EAGER)(layer_input)
    batch, length, width = layer_input.shape
    x = layer_input.reshape(-1, width)
    logits = self.router.layer(x).float()
    top_k_logits, top_k_index = logits.topk(self.router.top_k, dim=1)
    top_k_weights = torch.softmax(top_k_logits, dim=1).type_as(x)

    def activate(hidden):
        first, second = hidden.chunk(2, dim=-1)
        return self.activation(first) * second

    out = routed_experts(x, top_k_index, top_k_weights, self.input_linear.weight, self.output_linear.weight, activate)
    return out.to(layer_input.dtype).view(batch, length, self.input_size)


def _layout(module):
    """The capture-safe forward for ``module``'s layout, None for a module that is not an expert layer,
    or a string saying why an expert-like module is not known."""
    if hasattr(module, "down_proj") and (hasattr(module, "gate_up_proj") or hasattr(module, "up_proj")) \
            and isinstance(getattr(module, "down_proj"), torch.nn.Parameter) and hasattr(module, "num_experts"):
        return _experts_interface_forward
    if all(hasattr(module, name) for name in ("router", "input_linear", "output_linear")):
        if hasattr(module.router, "layer") and hasattr(module.router, "top_k"):
            return _parallel_experts_moe_forward
        return f"{type(module).__name__}'s router has no logits layer and top_k"
    if type(module).__name__.endswith(("MoE", "Experts")) and not hasattr(module, "experts"):
        return f"{type(module).__name__} is an expert layer of a layout the decode graphs do not know"
    return None


def expert_layers(model):
    """[(module, capture-safe forward)] of ``model``'s expert layers; ValueError naming a layer whose
    layout is not known."""
    found, inside = [], ()
    for name, module in model.named_modules():
        if inside and name.startswith(inside):
            continue  # a part of a layer already found (5.3's ParallelExperts inside its MoE)
        layout = _layout(module)
        if isinstance(layout, str):
            raise ValueError(f"decode graphs: {name}: {layout}; decode this model eagerly (cuda_graphs=False)")
        if layout is not None:
            found.append((module, layout))
            inside += (name + ".",)
    return found


def capture_safe_experts(model) -> int:
    """Gives each expert layer of ``model`` its capture-safe forward (the layer's own runs outside a
    capture); -> how many. Idempotent; ``eager_experts`` undoes it."""
    layers = expert_layers(model)
    for module, forward in layers:
        if _EAGER not in module.__dict__:
            setattr(module, _EAGER, module.forward)
            module.forward = types.MethodType(forward, module)
    return len(layers)


def eager_experts(model) -> None:
    for module in model.modules():
        eager = module.__dict__.pop(_EAGER, None)
        if eager is not None:
            del module.forward
