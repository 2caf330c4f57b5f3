"""A hybrid's cache in fixed buffers, so that its decode step can be replayed from a CUDA graph.

Hugging Face's hybrid caches keep per layer a conv and an SSM state (fixed shapes, updated in place)
and, for attention layers, keys and values that grow by concatenation every step. Two structures:
transformers 5.3's per-model classes (HybridMambaAttentionDynamicCache, NemotronHHybridDynamicCache,
Zamba2HybridDynamicCache: per-layer lists ``key_cache``, ``value_cache``, ``conv_states``,
``ssm_states``) and the DynamicCache of later versions (one object per layer: ``keys`` / ``values``
for attention, ``conv_states`` / ``recurrent_states`` for mamba, tensors before 5.17 and dicts of
them from 5.17 on). Here the keys and values live in buffers of a maximum length: a step writes its
token's key and value in place at the write position (a device tensor set before each replay), and
attention reads the whole buffer through an additive mask that admits the written positions the
generation's attention mask keeps. A graph then replays the same addresses every step.

``StaticHybridCache`` builds the bucket's cache from a live one (shallow copies of the cache and
its per-layer objects, so every other attribute and method is HF's, with new buffers at the
bucket's batch size and ``update`` writing in place); ``bind`` moves a generation's cache in and
points it at the rows it uses; ``unbind`` gives it tensors of its own back, keys and values cut to
their length.
"""
import copy

import torch


def _get(holder, key):
    return holder[key] if isinstance(holder, (list, dict)) else getattr(holder, key)


def _set(holder, key, value):
    if isinstance(holder, (list, dict)):
        holder[key] = value
    else:
        setattr(holder, key, value)


def cache_slots(cache):
    """(mamba, attention): the cache's state tensors as (holder, key), and its attention layers as
    (layer index, (holder, key) of the keys, of the values); the same order for a cache and its
    static copy."""
    mamba, attention = [], []
    if hasattr(cache, "key_cache"):  # transformers 5.3: per-layer lists (or dicts) on the cache
        for name in ("conv_states", "ssm_states"):
            states = getattr(cache, name)
            mamba += [(states, i) for i in (states.keys() if isinstance(states, dict) else range(len(states)))
                      if states[i].ndim >= 3]
        attention = [(i, (cache.key_cache, i), (cache.value_cache, i))
                     for i, keys in enumerate(cache.key_cache) if keys.ndim == 4]
        return mamba, attention
    for i, layer in enumerate(getattr(cache, "layers", ())):  # a DynamicCache: an object per layer
        for name in ("conv_states", "recurrent_states"):
            states = getattr(layer, name, None)
            if isinstance(states, dict):  # 5.17 on: a state per index
                mamba += [(states, k) for k, t in states.items() if torch.is_tensor(t) and t.ndim >= 3]
            elif torch.is_tensor(states) and states.ndim >= 3:  # before 5.17: one tensor
                mamba.append((layer, name))
        if torch.is_tensor(getattr(layer, "keys", None)) and layer.keys.ndim == 4:
            attention.append((i, (layer, "keys"), (layer, "values")))
    return mamba, attention


def _own_containers(cache):
    """A shallow copy of ``cache`` whose containers of tensors are its own (the tensors shared)."""
    static = copy.copy(cache)
    if hasattr(cache, "key_cache"):
        for name in ("conv_states", "ssm_states", "key_cache", "value_cache"):
            setattr(static, name, copy.copy(getattr(cache, name)))
        return static
    static.layers = [copy.copy(layer) for layer in cache.layers]
    for layer in static.layers:
        for name, value in vars(layer).items():
            if isinstance(value, dict):
                setattr(layer, name, dict(value))
    return static


def kv_length(cache) -> int:
    """Tokens in the cache's attention layers (0 where it has none yet)."""
    _, attention = cache_slots(cache)
    return _get(*attention[0][1]).shape[2] if attention else 0


class StaticHybridCache:
    """The buffers of one bucket (``batch`` rows, keys and values of ``max_len`` tokens) and the
    per-step inputs a graph reads: the write position, the kept positions, the position ids."""

    def __init__(self, live, batch: int, max_len: int):
        self.max_len = max_len
        mamba, attention = cache_slots(live)
        if not mamba or not attention:
            raise ValueError(f"{type(live).__name__}: not a hybrid cache this version knows (no "
                             f"{'mamba states' if not mamba else 'attention keys'} found)")
        self.cache = _own_containers(live)
        if hasattr(self.cache, "key_cache"):
            self.cache.has_previous_state = True  # 5.3's mixers take their decode branch on it
        self.mamba, self.attention = cache_slots(self.cache)
        for holder, key in self.mamba:
            state = _get(holder, key)
            _set(holder, key, state.new_zeros((batch, *state.shape[1:])))
        self.buffers = {}
        for layer, *pair in self.attention:
            for holder, key in pair:
                k = _get(holder, key)
                _set(holder, key, k.new_zeros((batch, k.shape[1], max_len, k.shape[3])))
            self.buffers[layer] = tuple(_get(holder, key) for holder, key in pair)
        device = _get(*self.attention[0][1]).device
        self.position = torch.zeros(1, dtype=torch.long, device=device)        # where this step writes
        self.kept = torch.ones(batch, max_len, dtype=torch.bool, device=device)  # the attention mask's ones
        self.position_ids = torch.zeros(batch, 1, dtype=torch.long, device=device)
        self.slots = torch.arange(max_len, device=device)
        self.cache.update = self._update  # an instance attribute: the class's method stays HF's
        self.live, self.live_batch, self.length = None, 0, 0

    def _update(self, key_states, value_states, layer_idx, *args, **kwargs):
        keys, values = self.buffers[layer_idx]
        keys.index_copy_(2, self.position, key_states)
        values.index_copy_(2, self.position, value_states)
        return keys, values

    def mask(self, dtype) -> torch.Tensor:
        """[batch, 1, 1, max_len] additive mask: 0 where a key may be read (written, and kept by the
        generation's mask), the dtype's lowest value elsewhere. Computed inside the graph."""
        readable = self.kept & (self.slots <= self.position)
        return torch.where(readable, 0.0, torch.finfo(dtype).min).to(dtype)[:, None, None, :]

    # ------------------------------------------------------------------ binding a generation's cache

    def bind(self, live, batch):
        self.unbind()
        self.length = kv_length(live)
        if self.length >= self.max_len:
            raise ValueError(f"a cache of {self.length} tokens does not fit {self.max_len}")
        live_mamba, live_attention = cache_slots(live)
        for (holder, key), (static_holder, static_key) in zip(live_mamba, self.mamba):
            rows = _get(static_holder, static_key)[:batch]
            rows.copy_(_get(holder, key))
            _set(holder, key, rows)
        for (_, *pair), (_, *static_pair) in zip(live_attention, self.attention):
            for (holder, key), (static_holder, static_key) in zip(pair, static_pair):
                _get(static_holder, static_key)[:batch, :, :self.length].copy_(_get(holder, key))
        self.kept.fill_(True)  # rows past the batch read their own slots: never an all-masked row
        self.live, self.live_batch = live, batch
        self.live_attention, self.live_first_state = live_attention, live_mamba[0]
        self._point_live_at_rows()

    def _point_live_at_rows(self):
        for (_, *pair), (_, *static_pair) in zip(self.live_attention, self.attention):
            for (holder, key), (static_holder, static_key) in zip(pair, static_pair):
                _set(holder, key, _get(static_holder, static_key)[:self.live_batch, :, :self.length])

    def unbind(self):
        """The bound cache gets its own tensors back, with the states and tokens it has reached."""
        if self.live is None:
            return
        live_mamba, live_attention = cache_slots(self.live)
        for holder, key in live_mamba + [slot for _, *pair in live_attention for slot in pair]:
            _set(holder, key, _get(holder, key).clone())
        self.live = None

    def bound_to(self, live, batch) -> bool:
        # Every step asks: one state stands for all (bind sets them together), so the host stays short.
        if live is not self.live or batch != self.live_batch:
            return False
        return _get(*self.live_first_state).data_ptr() == _get(*self.mamba[0]).data_ptr()

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
