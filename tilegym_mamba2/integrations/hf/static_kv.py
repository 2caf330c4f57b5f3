"""A hybrid's cache in fixed buffers, so that its decode step can be replayed from a CUDA graph.

Hugging Face's hybrid caches (transformers 5.3: Bamba's and GraniteMoeHybrid's
HybridMambaAttentionDynamicCache, NemotronHHybridDynamicCache, Zamba2HybridDynamicCache) keep
per layer a conv and an SSM state (fixed shapes, updated in place) and, for attention layers, keys
and values that grow by concatenation every step. Here the keys and values live in buffers of a
maximum length: a step writes its token's key and value in place at the write position (a device
tensor set before each replay), and attention reads the whole buffer through an additive mask that
admits the written positions the generation's attention mask keeps. A graph then replays the same
addresses every step.

``StaticHybridCache.from_live`` builds the bucket's cache from a live one (a shallow copy of the
object, so every other attribute and method is HF's, with new buffers at the bucket's batch size and
``update`` writing in place); ``bind`` moves a generation's cache in and points it at the rows it
uses; ``unbind`` gives it tensors of its own back, keys and values cut to their length.
"""
import copy

import torch


def is_hybrid_cache(cache) -> bool:
    """transformers 5.3's hybrid caches: per-layer key/value lists beside per-layer mamba states."""
    return all(hasattr(cache, name) for name in ("key_cache", "value_cache", "conv_states", "ssm_states"))


def _layers(states):
    return states.keys() if isinstance(states, dict) else range(len(states))


def kv_length(cache) -> int:
    """Tokens in the cache's attention layers (0 where it has none yet)."""
    return next((k.shape[2] for k in cache.key_cache if k.ndim == 4), 0)


class StaticHybridCache:
    """The buffers of one bucket (``batch`` rows, keys and values of ``max_len`` tokens) and the
    per-step inputs a graph reads: the write position, the kept positions, the position ids."""

    def __init__(self, live, batch: int, max_len: int):
        self.batch, self.max_len = batch, max_len
        self.cache = copy.copy(live)
        self.cache.has_previous_state = True  # the mixers' decode branch
        self.mamba_layers = [(name, i) for name in ("conv_states", "ssm_states")
                             for i in _layers(getattr(live, name)) if getattr(live, name)[i].ndim >= 3]
        self.attention_layers = [i for i, k in enumerate(live.key_cache) if k.ndim == 4]
        for name in ("conv_states", "ssm_states", "key_cache", "value_cache"):
            setattr(self.cache, name, copy.copy(getattr(live, name)))  # containers of our own
        for name, i in self.mamba_layers:
            state = getattr(live, name)[i]
            getattr(self.cache, name)[i] = state.new_zeros((batch, *state.shape[1:]))
        for i in self.attention_layers:
            for name in ("key_cache", "value_cache"):
                k = getattr(live, name)[i]
                getattr(self.cache, name)[i] = k.new_zeros((batch, k.shape[1], max_len, k.shape[3]))
        device = live.key_cache[self.attention_layers[0]].device if self.attention_layers else None
        self.position = torch.zeros(1, dtype=torch.long, device=device)        # where this step writes
        self.kept = torch.ones(batch, max_len, dtype=torch.bool, device=device)  # the attention mask's ones
        self.position_ids = torch.zeros(batch, 1, dtype=torch.long, device=device)
        self.slots = torch.arange(max_len, device=device)
        self.cache.update = self._update  # an instance attribute: the class's method stays HF's
        self.live, self.live_batch, self.length = None, 0, 0

    def _update(self, key_states, value_states, layer_idx, cache_kwargs=None):
        keys, values = self.cache.key_cache[layer_idx], self.cache.value_cache[layer_idx]
        keys.index_copy_(2, self.position, key_states)
        values.index_copy_(2, self.position, value_states)
        return keys, values

    def mask(self, dtype) -> torch.Tensor:
        """[batch, 1, 1, max_len] additive mask: 0 where a key may be read (written, and kept by the
        generation's mask), the dtype's lowest value elsewhere. Computed inside the graph."""
        readable = self.kept & (self.slots <= self.position)
        return torch.where(readable, 0.0, torch.finfo(dtype).min).to(dtype)[:, None, None, :]

    def fits(self) -> bool:
        """Whether the next step's token has a slot."""
        return self.length < self.max_len

    # ------------------------------------------------------------------ binding a generation's cache

    def bind(self, live, batch):
        self.unbind()
        self.length = kv_length(live)
        if self.length >= self.max_len:
            raise ValueError(f"a cache of {self.length} tokens does not fit {self.max_len}")
        for name, i in self.mamba_layers:
            rows = getattr(self.cache, name)[i][:batch]
            rows.copy_(getattr(live, name)[i])
            getattr(live, name)[i] = rows
        for i in self.attention_layers:
            for name in ("key_cache", "value_cache"):
                getattr(self.cache, name)[i][:batch, :, :self.length].copy_(getattr(live, name)[i])
        self.kept.fill_(True)  # rows past the batch read their own slots: never an all-masked row
        self.live, self.live_batch = live, batch
        self._point_live_at_rows()

    def _point_live_at_rows(self):
        for i in self.attention_layers:
            for name in ("key_cache", "value_cache"):
                getattr(self.live, name)[i] = getattr(self.cache, name)[i][:self.live_batch, :, :self.length]

    def unbind(self):
        """The bound cache gets its own tensors back, with the states and tokens it has reached."""
        if self.live is None:
            return
        for name, i in self.mamba_layers:
            getattr(self.live, name)[i] = getattr(self.live, name)[i].clone()
        for i in self.attention_layers:
            for name in ("key_cache", "value_cache"):
                getattr(self.live, name)[i] = getattr(self.live, name)[i].clone()
        self.live = None

    def bound_to(self, live, batch) -> bool:
        if live is not self.live or batch != self.live_batch:
            return False
        name, i = self.mamba_layers[0]
        return getattr(live, name)[i].data_ptr() == getattr(self.cache, name)[i].data_ptr()

    def set_step(self, attention_mask, position_ids):
        """The step's inputs, copied into the buffers the graph reads (no host synchronization)."""
        self.position.fill_(self.length)
        if attention_mask is not None:
            self.kept[:self.live_batch, :attention_mask.shape[1]].copy_(attention_mask.bool())
        if position_ids is not None:
            self.position_ids[:self.live_batch].copy_(position_ids[:, -1:])
        else:  # what the eager model uses without position ids: the cache position, every row
            self.position_ids.fill_(self.length)

    def advance(self):
        self.length += 1
        self._point_live_at_rows()
