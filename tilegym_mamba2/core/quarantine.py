"""Packed sequences on kernels that apply sequence boundaries as zero weights.

The cuTile kernels keep sequences apart inside their matmuls by weights that are exactly 0
between sequences. For finite values that is exact, but 0 * NaN = NaN and 0 * inf = NaN: one
sequence's non-finite value would reach every sequence that shares a chunk with it. Selecting
per sequence inside the matmuls would need one pass per sequence of a chunk; instead the
backend quarantines around its kernels, on the device and with no read on the host:

1. each sequence holding a non-finite input (a token's x, dt, B, C, z or dout, its initial
   state, the gradient of its end state) is marked;
2. the kernels run on the inputs with every non-finite value replaced by 0;
3. every output, state and gradient of a marked sequence is set to NaN, and the gradients
   of the parameters all sequences share (A, D, dt_bias) are NaN when any sequence is marked.

So a non-finite input never passes silently and never reaches another sequence; the other
sequences' results are those of finite inputs. Calls without packing do not come here.

Most calls hold no non-finite value at all, and for them the three steps are pure cost: on a
large packed call they read and write every token's tensors several times more than the kernels
do (docs/design.md, Decisions: the quarantine's fast path). So a call first sums each input once
in fp32 (one read, nothing written) and reads the sums back in one transfer, next to the one its
packing checks already make; when every sum is finite the kernels run on the inputs as given. A
sum overflows to inf only for values near fp32's limit: such a call takes the quarantine, which
is right for any input.
"""
import dataclasses

import torch

from .packing import per_sequence_init, seq_idx_from_cu_seqlens


def _nonfinite_tokens(t):
    """t [batch, tokens, ...] -> [batch, tokens] bool: a token holds a NaN or inf."""
    finite = torch.isfinite(t)
    return ~(finite.flatten(2).all(2) if t.ndim > 2 else finite)


def _nonfinite_rows(t):
    """t [rows, ...] -> [rows] bool."""
    return ~torch.isfinite(t).flatten(1).all(1)


def cleaned(t):
    """t with NaN and inf replaced by 0 (None stays None)."""
    return None if t is None else torch.nan_to_num(t, nan=0.0, posinf=0.0, neginf=0.0)


def all_finite(*tensors) -> bool:
    """True when no tensor (None skipped) holds a NaN or inf, or an fp32 sum past fp32's range."""
    sums = [t.sum(dtype=torch.float32) for t in tensors if t is not None]
    return not sums or bool(torch.stack(sums).isfinite().all())


class NothingMarked:
    """The quarantine of a call whose inputs are all finite: nothing to poison."""
    per_sequence_init = False

    @staticmethod
    def _unchanged(t, *_):
        return t

    poison_tokens = poison_row_firsts = poison_row_lasts = poison_sequences = poison_shared = _unchanged


class Quarantine:
    """Which packed sequences hold a non-finite input, and NaN for everything they produce.

    Keys number the sequences: with cu_seqlens (batch 1) a sequence's key is its index, as
    initial_states and varlen states count them; with seq_idx alone each run of equal ids in a
    row gets its own key."""

    def __init__(self, seq_idx, cu_seqlens, batch, tokens, device):
        if seq_idx is None:
            seq_idx = seq_idx_from_cu_seqlens(cu_seqlens, tokens)
        if cu_seqlens is not None:
            self.keys = seq_idx.long()
        else:
            starts = torch.zeros(batch, tokens, dtype=torch.long, device=device)
            starts[:, 1:] = seq_idx[:, 1:] != seq_idx[:, :-1]
            self.keys = starts.cumsum(1) + torch.arange(batch, device=device)[:, None] * tokens
        self.first_is_zero = seq_idx[:, 0] == 0  # a row's initial state belongs to its sequence 0
        self.marks = torch.zeros(batch * tokens, dtype=torch.int32, device=device)
        self.per_sequence_init = False  # set by quarantine_layer

    def _mark(self, keys, flags):
        self.marks.index_add_(0, keys.reshape(-1), flags.reshape(-1).to(torch.int32))

    def mark_tokens(self, *tensors):
        """Tensors [batch, tokens, ...] (None skipped)."""
        for t in tensors:
            if t is not None:
                self._mark(self.keys, _nonfinite_tokens(t))

    def mark_row_firsts(self, t):
        """t [batch, ...]: each row's first sequence's (a row's initial states)."""
        if t is not None:
            self._mark(self.keys[:, 0], _nonfinite_rows(t) & self.first_is_zero)

    def mark_row_lasts(self, t):
        """t [batch, ...]: each row's last sequence's (the gradient of the final states)."""
        if t is not None:
            self._mark(self.keys[:, -1], _nonfinite_rows(t))

    def mark_sequences(self, t):
        """t [num_sequences, ...], with cu_seqlens (per-sequence initial states, dvarlen_states)."""
        if t is not None:
            self._mark(torch.arange(t.shape[0], device=t.device), _nonfinite_rows(t))

    def _poison(self, t, marked):
        if t is None:
            return None
        marked = marked.reshape(marked.shape + (1,) * (t.ndim - marked.ndim))
        return torch.where(marked, torch.full((), float("nan"), dtype=t.dtype, device=t.device), t)

    @property
    def _marked(self):
        return self.marks > 0

    def poison_tokens(self, t):
        return self._poison(t, self._marked[self.keys])

    def poison_row_firsts(self, t):
        return self._poison(t, self._marked[self.keys[:, 0]] & self.first_is_zero)

    def poison_row_lasts(self, t):
        return self._poison(t, self._marked[self.keys[:, -1]])

    def poison_sequences(self, t):
        return None if t is None else self._poison(t, self._marked[:t.shape[0]])

    def poison_shared(self, t):
        return self._poison(t, self._marked.any())


def quarantine_layer(args, dout=None, dfinal_states=None, dvarlen_states=None):
    """For the layer op's checked arguments (validation.ScanCombinedArgs) with packed sequences,
    and in the backward the output gradients: -> (a Quarantine with every sequence marked whose
    inputs hold a non-finite value, the arguments with those values replaced by 0, the gradients
    (dout, dfinal_states, dvarlen_states) likewise). ``quarantine.per_sequence_init``: the initial
    states are one per sequence (with cu_seqlens) rather than one per row. A call whose inputs
    are all finite gets NothingMarked and its arguments as they are."""
    x = args.x
    grads = (dout, dfinal_states, dvarlen_states)
    if all_finite(x, args.dt, args.B, args.C, args.z, args.initial_states, *grads):
        return NothingMarked(), args, grads
    quarantine = Quarantine(args.seq_idx, args.cu_seqlens, x.shape[0], x.shape[1], x.device)
    quarantine.mark_tokens(x, args.dt, args.B, args.C, args.z, dout)
    quarantine.per_sequence_init = per_sequence_init(args.initial_states, args.cu_seqlens, x.shape[0])
    if quarantine.per_sequence_init:
        quarantine.mark_sequences(args.initial_states)
    else:
        quarantine.mark_row_firsts(args.initial_states)
    quarantine.mark_row_lasts(dfinal_states)
    quarantine.mark_sequences(dvarlen_states)
    clean = dataclasses.replace(args, x=cleaned(x), dt=cleaned(args.dt), B=cleaned(args.B), C=cleaned(args.C),
                          z=cleaned(args.z), initial_states=cleaned(args.initial_states))
    return quarantine, clean, tuple(map(cleaned, grads))
