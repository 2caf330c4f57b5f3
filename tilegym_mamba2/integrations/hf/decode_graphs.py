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
  (layers x batch x (conv_dim x kernel + heads x head_dim x state) in the cache's dtype; a
  hybrid's attention layers add 2 x batch x KV heads x slots x head size each) and the step's
  activations, from one memory pool that every bucket shares.

- **Mixture-of-experts hybrids** (GraniteMoeHybrid with experts, NemotronH with "moe" layers): while a
  step is captured their expert layers route on the device (experts.py); prefill and eager steps run
  transformers' own expert code.
- **Hybrids** (Bamba, GraniteMoeHybrid, NemotronH, Zamba2; FalconH1 from transformers 5.17):
  the bucket's cache keeps the attention layers' keys and values in buffers of a maximum length
  (static_kv.py), written in place at the step's position and read through a mask built in the
  graph from the generation's attention mask. The length is ``max_cache_len`` when given (a step
  past it runs eagerly), else twice the tokens of the cache it first takes, rounded up to a power of
  two, at least 256; a generation that reaches it gets a new bucket cache of twice its tokens,
  rounded up likewise (and, on a GPU, a new capture).

Not graphed (the eager path runs): training, autograd recording, inputs_embeds, more than one new
token, batch above the largest bucket, output_hidden_states, labels, non-CUDA models.
"""
import contextlib
import inspect

import torch

from ...core.tensors import pow2_at_least
from .experts import capture_safe_experts, eager_experts, expert_layers
from .static_kv import StaticHybridCache, _get, _set, cache_slots, kv_length

BUCKETS = (1, 2, 4, 8, 16, 32, 64)
# The hybrids, each with its cache class under transformers 5.3 (None: FalconH1 is patched from 5.17
# on); later versions keep every hybrid's states in a DynamicCache of per-layer objects.
HYBRIDS = {"BambaForCausalLM": "HybridMambaAttentionDynamicCache",
           "GraniteMoeHybridForCausalLM": "HybridMambaAttentionDynamicCache",
           "NemotronHForCausalLM": "NemotronHHybridDynamicCache", "Zamba2ForCausalLM": "Zamba2HybridDynamicCache",
           "FalconH1ForCausalLM": None}
MIN_KV_SLOTS = 256
_PREFILLED = "_tilegym_mamba2_prefilled"
_RUNNER = "_tilegym_mamba2_decode_graphs"


def enable_decode_graphs(model, buckets=BUCKETS, max_cache_len=None):
    """Decode steps of ``model`` (a Mamba2ForCausalLM, or a hybrid of HYBRIDS, on CUDA) through CUDA
    graphs, one per batch bucket (a batch runs in the smallest bucket that holds it).
    ``model.generate`` keeps its interface. ``max_cache_len``: the hybrids' key/value slots per
    sequence (see the module's docstring). Calling it again replaces the buckets;
    ``disable_decode_graphs`` frees the graphs."""
    check_graphable(model, graphs=True)
    if next(model.parameters()).device.type != "cuda":
        raise ValueError("decode graphs need the model on a CUDA device (model.cuda())")
    disable_decode_graphs(model)
    runner = DecodeGraphs(model, buckets, max_cache_len=max_cache_len)
    setattr(model, _RUNNER, runner)
    model.forward = runner
    capture_safe_experts(model)  # expert layers route on the device while a step is captured


def check_graphable(model, graphs=True):
    """Raises ValueError naming why ``model``'s decode step cannot be run on a static cache (or,
    with ``graphs``, captured)."""
    name = type(model).__name__
    if name == "Mamba2ForCausalLM":
        return
    if name not in HYBRIDS:
        raise ValueError(f"decode graphs take a transformers Mamba2ForCausalLM or one of {', '.join(sorted(HYBRIDS))}, "
                         f"got {name}")
    import transformers
    import transformers.cache_utils
    per_model_cache = HYBRIDS[name] is not None and HYBRIDS[name] in vars(inspect.getmodule(type(model)))
    if not per_model_cache and not hasattr(transformers.cache_utils, "LinearAttentionLayer"):
        raise ValueError(f"decode graphs for {name} are built on transformers 5.3's hybrid caches and on the "
                         f"per-layer DynamicCache of later versions; transformers {transformers.__version__} has "
                         f"neither")
    attention = getattr(model.config, "_attn_implementation", None)
    if attention not in ("sdpa", "eager"):
        raise ValueError(f"decode graphs read the key/value buffers through a mask: attn_implementation 'sdpa' or "
                         f"'eager', got {attention!r}")
    if graphs:
        # Looked for in the modules, not the config: NemotronH's config counts experts (8 by default,
        # from transformers 5.17) whether or not a layer uses them. A layout not known is refused here.
        expert_layers(model)


def disable_decode_graphs(model):
    runner = model.__dict__.pop(_RUNNER, None)
    if runner is not None:
        runner.release()
        del model.forward
    eager_experts(model)


class DecodeGraphs:
    """``model.forward`` with decode steps replayed from graphs (see the module's docstring).
    ``use_graphs=False`` runs the same static-cache step without capturing it (the CPU tests)."""

    def __init__(self, model, buckets=BUCKETS, use_graphs=True, max_cache_len=None):
        self.model = model
        self.eager = type(model).forward.__get__(model)
        # generate() reads the forward's parameters (whether to pass logits_to_keep, say).
        self.__signature__ = inspect.signature(self.eager)
        self.buckets = sorted(set(int(b) for b in buckets))
        if not self.buckets or self.buckets[0] < 1:
            raise ValueError(f"buckets must be positive batch sizes, got {tuple(buckets)}")
        if max_cache_len is not None and int(max_cache_len) < 1:
            raise ValueError(f"max_cache_len must be a positive number of tokens, got {max_cache_len}")
        self.max_cache_len = None if max_cache_len is None else int(max_cache_len)
        self.use_graphs = use_graphs
        self.hybrid = type(model).__name__ in HYBRIDS
        self.steps = {}
        self.pool = None
        # The decode step's output: the type the eager forward returned (until it has run, the
        # usual one of the model's family).
        if type(model).__name__ == "Mamba2ForCausalLM":
            # The cache's keyword and output field: ``cache_params`` until 5.23, ``cache`` from 5.24.
            self.cache_field = "cache" if "cache" in self.__signature__.parameters else "cache_params"
            self.output_type = inspect.getmodule(type(model)).Mamba2CausalLMOutput
        else:
            from transformers.modeling_outputs import CausalLMOutputWithPast
            self.output_type, self.cache_field = CausalLMOutputWithPast, "past_key_values"

    def release(self):
        for step in self.steps.values():
            step.unbind()
        self.steps.clear()

    def __call__(self, *args, **kwargs):
        input_ids = kwargs.get("input_ids", args[0] if args else None)
        cache = next((kwargs[k] for k in ("cache", "cache_params", "past_key_values") if kwargs.get(k) is not None),
                     None)
        step = None
        if len(args) <= 1 and self._is_decode_step(input_ids, cache, kwargs):
            step = self._step_for(input_ids.shape[0], cache)
        if step is None:
            out = self.eager(*args, **kwargs)
            if not hasattr(out, "logits"):  # return_dict=False: a tuple, which a step never returns
                return out
            self.output_type = type(out)
            self.cache_field = next(k for k in ("cache", "cache_params", "past_key_values") if hasattr(out, k))
            cache = getattr(out, self.cache_field, None)
            if cache is not None and kwargs.get("use_cache", True) and not torch.is_grad_enabled():
                setattr(cache, _PREFILLED, True)
            return out
        logits = step.run(input_ids, cache, kwargs)
        return self.output_type(logits=logits, **{self.cache_field: cache})

    def _step_for(self, batch, cache):
        """The bucket's step, built on first use; None where this step must run eagerly (a
        hybrid's cache past ``max_cache_len``)."""
        bucket = next(b for b in self.buckets if b >= batch)
        step = self.steps.get(bucket)
        if not self.hybrid:
            if step is None:
                step = self.steps[bucket] = _Step(self, bucket, cache)
            return step
        length = step.static.length if step is not None and step.static.bound_to(cache, batch) else kv_length(cache)
        if step is not None and length < step.static.max_len:
            return step
        if self.max_cache_len is not None:
            if length >= self.max_cache_len:
                if step is not None:
                    step.unbind()
                return None
            max_len = self.max_cache_len
        else:
            max_len = max(MIN_KV_SLOTS, pow2_at_least(2 * (length + 1)))
        if step is not None:  # a generation outgrew the buckets' slots: a longer cache, captured again
            step.unbind()
        step = self.steps[bucket] = _HybridStep(self, bucket, cache, max_len)
        return step

    def _is_decode_step(self, input_ids, cache, kwargs):
        return (input_ids is not None and (input_ids.is_cuda or not self.use_graphs) and input_ids.ndim == 2
                and input_ids.shape[1] == 1 and input_ids.shape[0] <= self.buckets[-1]
                and cache is not None and getattr(cache, _PREFILLED, False)
                and kwargs.get("inputs_embeds") is None and kwargs.get("labels") is None
                and not kwargs.get("output_hidden_states") and not kwargs.get("output_attentions")
                and kwargs.get("return_dict", True) is not False
                and not self.model.training and not torch.is_grad_enabled())


class _Step:
    """One bucket of a Mamba2ForCausalLM: its static inputs and cache, its graph, and the live
    cache bound to them."""

    def __init__(self, runner, bucket, like_cache):
        model = runner.model
        self.runner, self.bucket = runner, bucket
        device = next(model.parameters()).device
        self.ids = torch.zeros(bucket, 1, dtype=torch.long, device=device)
        # The bucket's cache: HF's own class at the bucket's batch size, its states allocated by
        # one eager prefill of a few tokens (transformers 5.17 allocates them on first use).
        with torch.no_grad():
            prefill = torch.zeros(bucket, 4, dtype=torch.long, device=device)
            self.cache = getattr(runner.eager(input_ids=prefill, use_cache=True), runner.cache_field)
        self.live, self.live_batch = None, 0
        self.graph = self.logits = None
        if runner.use_graphs:
            self._capture()

    def _forward(self):
        # cache_position on the CPU: transformers 5.3 reads cache_position[0] > 0 on the host to
        # pick its decode branch, which a capture must not wait for (5.17 takes a Python flag).
        return self.runner.eager(input_ids=self.ids, **{self.runner.cache_field: self.cache}, use_cache=True,
                                 cache_position=torch.ones(1, dtype=torch.long), attention_mask=None).logits

    def _capture(self):
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with _current_stream_as_default(), torch.cuda.stream(side):
            for _ in range(2):  # compiles the kernels and records their launch plans
                self._forward()
        torch.cuda.current_stream().wait_stream(side)
        if self.runner.pool is None:
            self.runner.pool = torch.cuda.graph_pool_handle()
        self.graph = torch.cuda.CUDAGraph()
        with _current_stream_as_default(), torch.cuda.graph(self.graph, pool=self.runner.pool):
            self.logits = self._forward()

    def _replay(self):
        if self.graph is not None:
            self.graph.replay()
            return self.logits
        return self._forward()

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

    def run(self, input_ids, cache, kwargs):
        batch = input_ids.shape[0]
        if cache is not self.live or batch != self.live_batch or not _views_of(cache, self.cache):
            self.bind(cache, batch)
        self.ids[:batch].copy_(input_ids)
        # A copy: the next replay overwrites the graph's output, and generate may keep scores.
        return self._replay()[:batch].clone()


class _HybridStep(_Step):
    """One bucket of a hybrid: the static cache of static_kv.py and the step's inputs it holds."""

    def __init__(self, runner, bucket, like_cache, max_len):
        self.runner, self.bucket = runner, bucket
        self.ids = torch.zeros(bucket, 1, dtype=torch.long, device=next(runner.model.parameters()).device)
        self.static = StaticHybridCache(like_cache, bucket, max_len)
        self.dtype = runner.model.dtype
        self.graph = self.logits = None
        if runner.use_graphs:
            self._capture()

    def _forward(self):
        static = self.static
        return self.runner.eager(input_ids=self.ids, past_key_values=static.cache, use_cache=True,
                                 attention_mask=static.mask(self.dtype), position_ids=static.position_ids,
                                 cache_position=torch.ones(1, dtype=torch.long)).logits

    def unbind(self):
        self.static.unbind()

    def run(self, input_ids, cache, kwargs):
        batch = input_ids.shape[0]
        static = self.static
        if not static.bound_to(cache, batch):
            static.bind(cache, batch)
        self.ids[:batch].copy_(input_ids)
        static.set_step(kwargs.get("attention_mask"), kwargs.get("position_ids"))
        logits = self._replay()[:batch].clone()
        static.advance()
        return logits


@contextlib.contextmanager
def _current_stream_as_default():
    """NemotronH's blocks run under ``torch.cuda.stream(torch.cuda.default_stream())`` on CUDA
    (transformers 5.3), which a capture on its own stream cannot follow: while ours warms up and
    captures, the default stream is reported as the current one. Restored on exit."""
    default_stream = torch.cuda.default_stream
    torch.cuda.default_stream = lambda device=None: torch.cuda.current_stream(device)
    try:
        yield
    finally:
        torch.cuda.default_stream = default_stream


def _slots(cache):
    """The cache's state tensors as (holder, key, batch dimension): transformers 5.3's
    Mamba2Cache stacks the layers ([layers, batch, ...] attributes); later versions' DynamicCache
    keeps [batch, ...] tensors per layer object (static_kv.cache_slots walks them)."""
    if hasattr(cache, "ssm_states"):
        return [(cache, "conv_states", 1), (cache, "ssm_states", 1)]
    return [(holder, key, 0) for holder, key in cache_slots(cache)[0]]


def _views_of(cache, static):
    # The first state stands for all: bind() sets them together (one check keeps the host short).
    (holder, key, _), (static_holder, static_key, _) = _slots(cache)[0], _slots(static)[0]
    return _get(holder, key).data_ptr() == _get(static_holder, static_key).data_ptr()
