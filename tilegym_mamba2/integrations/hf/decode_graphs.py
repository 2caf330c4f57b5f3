"""Decoding a Hugging Face Mamba-2 model in CUDA graphs.

A patched model's decode step runs kernels of microseconds under milliseconds of Python (HF's
modules and one launch per op per layer), so ``generate()`` is host-bound. Here the whole step,
embedding to logits with every layer's conv and SSM cache updated in place, is captured once
per batch-size bucket and replayed: the host then costs one input copy and one replay per token.

- **Prefill stays eager**: a prompt's lengths and masks change per call. The first call with a
  cache marks it; the calls after it on one token with that cache are decode steps.
- **Static cache per bucket.** A graph replays fixed addresses, so each bucket owns a cache of its
  batch size. At a generation's first decode step the live cache's states are copied into it and
  the live cache is pointed at those rows (views), so HF and the caller see every update; when
  another generation takes the bucket, the previous one's cache gets its own copy back first. A
  batch below its bucket runs in the bucket's first rows; the rows past it compute on stale
  states that nothing reads (decode rows are independent).
- **What runs in the graph** is the model's own forward on the static cache, the mixers patched
  onto our kernels, with ``cache_position`` a CPU tensor: HF's "is this a decode step" test reads
  it on the host while the graph is captured, not while it replays.
- **Memory**: per bucket captured (lazily, on first use) one cache of the bucket's batch size
  (layers x batch x (conv_dim x kernel + heads x head_dim x state) in the cache's dtype) and the
  step's activations, from one memory pool that every bucket shares.

Not graphed (the eager path runs): training, autograd recording, inputs_embeds, more than one new
token, batch above the largest bucket, output_hidden_states, labels, non-CUDA models. Hybrids are
refused: their attention layers' KV caches grow by concatenation every step, and a graph replays
fixed shapes and addresses.
"""
import inspect
import sys

import torch

BUCKETS = (1, 2, 4, 8, 16, 32, 64)
_PREFILLED = "_tilegym_mamba2_prefilled"
_RUNNER = "_tilegym_mamba2_decode_graphs"


def enable_decode_graphs(model, buckets=BUCKETS):
    """Decode steps of ``model`` (a Mamba2ForCausalLM on CUDA) through CUDA graphs, one per batch
    bucket (a batch runs in the smallest bucket that holds it). ``model.generate`` keeps its
    interface. Calling it again replaces the buckets; ``disable_decode_graphs`` frees the graphs."""
    if type(model).__name__ != "Mamba2ForCausalLM":
        raise ValueError(f"decode graphs take a transformers Mamba2ForCausalLM, got {type(model).__name__} "
                         "(a hybrid's attention layers grow their KV cache every step, which a graph cannot replay)")
    if next(model.parameters()).device.type != "cuda":
        raise ValueError("decode graphs need the model on a CUDA device (model.cuda())")
    disable_decode_graphs(model)
    runner = DecodeGraphs(model, buckets)
    setattr(model, _RUNNER, runner)
    model.forward = runner


def disable_decode_graphs(model):
    runner = model.__dict__.pop(_RUNNER, None)
    if runner is not None:
        runner.release()
        del model.forward


class DecodeGraphs:
    """``model.forward`` with decode steps replayed from graphs (see the module's docstring).
    ``use_graphs=False`` runs the same static-cache step without capturing it (the CPU tests)."""

    def __init__(self, model, buckets=BUCKETS, use_graphs=True):
        self.model = model
        self.eager = type(model).forward.__get__(model)
        # generate() reads the forward's parameters (whether to pass logits_to_keep, say).
        self.__signature__ = inspect.signature(self.eager)
        self.buckets = sorted(set(int(b) for b in buckets))
        if not self.buckets or self.buckets[0] < 1:
            raise ValueError(f"buckets must be positive batch sizes, got {tuple(buckets)}")
        self.use_graphs = use_graphs
        self.steps = {}
        self.pool = None

    def release(self):
        for step in self.steps.values():
            step.unbind()
        self.steps.clear()

    def __call__(self, *args, **kwargs):
        input_ids = kwargs.get("input_ids", args[0] if args else None)
        cache_params = kwargs.get("cache_params")
        if len(args) > 1 or not self._is_decode_step(input_ids, cache_params, kwargs):
            out = self.eager(*args, **kwargs)
            cache = getattr(out, "cache_params", None)
            if cache is not None and kwargs.get("use_cache", True) and not torch.is_grad_enabled():
                setattr(cache, _PREFILLED, True)
            return out
        batch = input_ids.shape[0]
        bucket = next(b for b in self.buckets if b >= batch)
        step = self.steps.get(bucket)
        if step is None:
            step = self.steps[bucket] = _Step(self, bucket, cache_params)
        logits = step.run(input_ids, cache_params)
        return self._output(logits, cache_params)

    def _is_decode_step(self, input_ids, cache, kwargs):
        return (input_ids is not None and (input_ids.is_cuda or not self.use_graphs) and input_ids.ndim == 2
                and input_ids.shape[1] == 1 and input_ids.shape[0] <= self.buckets[-1]
                and cache is not None and getattr(cache, _PREFILLED, False)
                and kwargs.get("inputs_embeds") is None and kwargs.get("labels") is None
                and not kwargs.get("output_hidden_states") and kwargs.get("return_dict", True) is not False
                and not self.model.training and not torch.is_grad_enabled())

    def _output(self, logits, cache):
        output_class = sys.modules[type(self.model).__module__].Mamba2CausalLMOutput
        return output_class(logits=logits, cache_params=cache)


class _Step:
    """One bucket: its static inputs and cache, its graph, and the live cache bound to them."""

    def __init__(self, runner, bucket, like_cache):
        model = runner.model
        self.runner, self.bucket = runner, bucket
        device = next(model.parameters()).device
        self.ids = torch.zeros(bucket, 1, dtype=torch.long, device=device)
        # The bucket's cache: HF's own class at the bucket's batch size, its states allocated by
        # one eager prefill of a few tokens (transformers 5.17 allocates them on first use).
        with torch.no_grad():
            prefill = torch.zeros(bucket, 4, dtype=torch.long, device=device)
            self.cache = runner.eager(input_ids=prefill, use_cache=True).cache_params
        self.live, self.live_batch = None, 0
        self.graph = self.logits = None
        if runner.use_graphs:
            self._capture()

    def _forward(self):
        # cache_position on the CPU: transformers 5.3 reads cache_position[0] > 0 on the host to
        # pick its decode branch, which a capture must not wait for (5.17 takes a Python flag).
        return self.runner.eager(input_ids=self.ids, cache_params=self.cache, use_cache=True,
                                 cache_position=torch.ones(1, dtype=torch.long), attention_mask=None).logits

    def _capture(self):
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            for _ in range(2):  # compiles the kernels and records their launch plans
                self._forward()
        torch.cuda.current_stream().wait_stream(side)
        if self.runner.pool is None:
            self.runner.pool = torch.cuda.graph_pool_handle()
        self.graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(self.graph, pool=self.runner.pool):
            self.logits = self._forward()

    def bind(self, cache, batch):
        """Moves a generation's cache into the bucket's rows and points it at them."""
        self.unbind()
        for (holder, key, batch_dim), (static_holder, static_key, _) in zip(_slots(cache), _slots(self.cache)):
            rows = _get(static_holder, static_key).narrow(batch_dim, 0, batch)
            rows.copy_(_get(holder, key))
            _set(holder, key, rows)
        self.live, self.live_batch = cache, batch

    def unbind(self):
        """The bound cache gets its own tensors back, with the states it has reached."""
        if self.live is not None:
            for holder, key, _ in _slots(self.live):
                _set(holder, key, _get(holder, key).clone())
            self.live = None

    def run(self, input_ids, cache):
        batch = input_ids.shape[0]
        if cache is not self.live or batch != self.live_batch or not _views_of(cache, self.cache):
            self.bind(cache, batch)
        self.ids[:batch].copy_(input_ids)
        if self.graph is not None:
            self.graph.replay()
            logits = self.logits
        else:
            logits = self._forward()
        # A copy: the next replay overwrites the graph's output, and generate may keep scores.
        return logits[:batch].clone()


def _slots(cache):
    """The cache's state tensors as (holder, key, batch dimension): transformers 5.3's
    Mamba2Cache stacks the layers ([layers, batch, ...] attributes); 5.17's DynamicCache keeps a
    [batch, ...] tensor per layer in dicts keyed by state index."""
    if hasattr(cache, "ssm_states"):
        return [(cache, "conv_states", 1), (cache, "ssm_states", 1)]
    return [(states, 0, 0) for layer in cache.layers for states in (layer.conv_states, layer.recurrent_states)]


def _get(holder, key):
    return holder[key] if isinstance(holder, dict) else getattr(holder, key)


def _set(holder, key, value):
    if isinstance(holder, dict):
        holder[key] = value
    else:
        setattr(holder, key, value)


def _views_of(cache, static):
    # The first state stands for all: bind() sets them together (one check keeps the host short).
    (holder, key, _), (static_holder, static_key, _) = _slots(cache)[0], _slots(static)[0]
    return _get(holder, key).data_ptr() == _get(static_holder, static_key).data_ptr()
