"""Batches: which token windows each rank trains (and validates) on at each step.

Training reads the data in epochs, as Megatron-LM's GPT dataset does: an epoch cuts the tokens
into consecutive windows of seq_len + 1 tokens (a window's last token is the next one's first)
and visits every window once, in a shuffled order. Each epoch shifts the cut by a seeded offset
below seq_len and reshuffles, so a small corpus is not memorised at fixed boundaries. Sample j
of the run (the samples of the steps before, plus the row) is a pure function of (seed, j): the
global batch of a step is the same whatever the layout, and a resume needs only the step and
the samples read so far (`DataPosition`, in the checkpoint), which also set the step's global
batch under a ramp-up (`train.batch_rampup`, config/rampup.py). The shuffle is a keyed permutation,
kept whole for an epoch of up to ORDER_CACHED windows, else computed per sample. Every rank
works out the step's window starts (a few integers) but reads only the rows of its own dp share,
so data loading does not grow with dp (a loss mask's count, below, reads the whole batch's masks:
one byte a token). A blend of sources (data/blend.py) sends each sample to
one source by weight (`route`), and each source numbers its own samples and runs its own
epochs. Validation reads the held-out windows in order. The tokens come from data/sources.py; a
source with a loss mask (fine-tuning examples) is read as packs of whole examples instead of
cuts of its stream (data/packing.py).
"""

from __future__ import annotations

from fractions import Fraction
from pathlib import Path

import numpy as np
import torch

from tetrad.config import counted
from tetrad.config.rampup import BatchRamp
from tetrad.data.blend import blend_parts
from tetrad.data.packing import ExamplePacks, fewest_tokens
from tetrad.data.shards import end_of_document
from tetrad.data.sources import TokenStream, load_blend
from tetrad.model.documents import Documents, document_positions
from tetrad.model.layers import IGNORED_LABEL
from tetrad.train.checkpoint.store import CheckpointError, read_extras

MASK64 = (1 << 64) - 1
ORDER_CACHED = 1 << 22  # windows; an epoch's order then takes 32 MB and a fraction of a second once


def _mix(x, key: int):
    """splitmix64's finaliser of x ^ key: a keyed hash of a uint64 array, or of a Python int."""
    if isinstance(x, int):
        x = (x ^ key) & MASK64
        x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & MASK64
        x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & MASK64
        return x ^ (x >> 31)
    x = x ^ np.uint64(key & MASK64)
    x = (x ^ (x >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
    x = (x ^ (x >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
    return x ^ (x >> np.uint64(31))


def permute(index: np.ndarray, n: int, key: int) -> np.ndarray:
    """A keyed permutation of range(n), applied to `index` (values below n): six Feistel rounds
    over the smallest power-of-two domain holding n, each mixing one half of the bits into the
    other, walked until the value lands below n (the domain is under 2n: a round or two)."""
    bits = max(1, (n - 1).bit_length())
    high_bits = bits // 2
    low = (1 << (bits - high_bits)) - 1
    shift, high = np.uint64(bits - high_bits), np.uint64((1 << high_bits) - 1)
    keys = [_mix(key * 6 + r, 0x5EED) for r in range(6)]
    out = index.astype(np.uint64)
    todo = np.ones(len(out), dtype=bool)
    while todo.any():
        x = out[todo]
        left, right = x >> shift, x & np.uint64(low)
        for r, k in enumerate(keys):
            if r % 2:
                right = right ^ (_mix(left, k) & np.uint64(low))
            else:
                left = left ^ (_mix(right, k) & high)
        out[todo] = (left << shift) | right
        todo = out >= np.uint64(n)
    return out


class Windows:
    """One source's windows of seq_len + 1 tokens: in shuffled epochs, or in order (offset 0). A
    source with a loss mask is read as packs of whole fine-tuning examples (data/packing.py),
    shuffled alike: an epoch visits every pack once, with no offset to shift."""

    def __init__(self, tokens: TokenStream, seq_len: int, seed: int, shuffle: bool):
        if len(tokens) < fewest_tokens(tokens, seq_len):
            raise ValueError(f"the data has {counted(len(tokens), 'token')}, fewer than the "
                             f"{fewest_tokens(tokens, seq_len)} a window needs")
        self.tokens, self.seq_len, self.seed, self.shuffle = tokens, seq_len, seed, shuffle
        self.packs = ExamplePacks(tokens, seq_len + 1) if tokens.loss_masks is not None else None
        if self.packs is not None:
            self.per_epoch, self.max_offset, self.stride = len(self.packs), 0, 1
        else:
            usable = len(tokens) - 1  # the last token is only ever a label
            # Windows per epoch: one fewer than fit, so that every epoch's offset leaves room for all.
            self.per_epoch = max(1, usable // seq_len - (1 if shuffle else 0))
            self.max_offset = min(seq_len - 1, usable - self.per_epoch * seq_len) if shuffle else 0
            self.stride = seq_len
        self.cached = (-1, None)  # (epoch, its whole order) when the order is small enough to keep

    def _order(self, epoch: int, key: int, position: np.ndarray) -> np.ndarray:
        """The epoch's shuffled window numbers at these positions. An order of up to ORDER_CACHED
        windows is worked out whole once per epoch and kept (a step then costs a lookup, not the
        permutation's per-call overhead); a larger one per sample, with the same result."""
        if self.per_epoch > ORDER_CACHED:
            return permute(position, self.per_epoch, key).astype(np.int64)
        if self.cached[0] != epoch:
            self.cached = (epoch, permute(np.arange(self.per_epoch), self.per_epoch, key).astype(np.int64))
        return self.cached[1][position]

    def starts(self, samples: np.ndarray) -> np.ndarray:
        """Token offsets of the windows of these sample numbers (counted from the run's start), or
        with packs their pack numbers."""
        n = self.per_epoch
        epoch, position = samples // n, samples % n
        if not self.shuffle:
            return position * self.stride
        starts = np.empty_like(samples)
        for e in range(int(epoch.min()), int(epoch.max()) + 1):
            key = (self.seed * 1_000_003 + e) % 2**63  # any seed in [0, 2**63)
            offset = _mix(key, 0x0FF5E7) % (self.max_offset + 1)
            here = epoch == e
            starts[here] = offset + self._order(e, key, position[here]) * self.stride
        return starts

    def read(self, samples: np.ndarray) -> np.ndarray:
        """The windows of these samples, [len(samples), seq_len + 1] int64."""
        if self.packs is not None:
            return self.packs.read(self.starts(samples))
        return self.tokens.windows(self.starts(samples).tolist(), self.seq_len + 1)

    def counted(self, samples: np.ndarray) -> np.ndarray:
        """Whether the loss counts each label of these samples' windows (the tokens after the
        first), [len(samples), seq_len] bool: the source's loss mask (never a pack's padding)."""
        if self.packs is not None:
            return self.packs.counted(self.starts(samples))[:, 1:]
        return self.tokens.counted(self.starts(samples).tolist(), self.seq_len + 1)[:, 1:]


def _left_share(weights: list[Fraction]) -> Fraction:
    """The first half's share of a blend node's weight (denominator bounded: int64 arithmetic)."""
    mid = len(weights) // 2
    return (sum(weights[:mid]) / sum(weights)).limit_denominator(1 << 20)


def route(samples: np.ndarray, weights: list[Fraction]) -> tuple[np.ndarray, np.ndarray]:
    """(source, number within that source) of each sample of a blend. The sources are halved
    recursively; of a node's first j samples floor(j * share) go to its first half, so every
    source's count stays within a sample or so of its weight at every j, and a sample's place is
    found in O(log sources) without counting the samples before it."""
    source = np.zeros(len(samples), dtype=np.int64)
    index = samples.astype(np.int64)
    todo = [(0, len(weights), np.arange(len(samples)))]
    while todo:
        lo, hi, rows = todo.pop()
        if hi - lo == 1:
            source[rows] = lo
            continue
        share = _left_share(weights[lo:hi])
        j = index[rows]
        before = j * share.numerator // share.denominator
        first = (j + 1) * share.numerator // share.denominator > before
        index[rows] = np.where(first, before, j - before)
        mid = (lo + hi) // 2
        todo += [(lo, mid, rows[first]), (mid, hi, rows[~first])]
    return source, index


def blend_counts(total: int, weights: list[Fraction]) -> list[int]:
    """How many of a blend's first `total` samples each source gives (as `route` sends them)."""
    if len(weights) == 1:
        return [total]
    share, mid = _left_share(weights), len(weights) // 2
    first = total * share.numerator // share.denominator
    return blend_counts(first, weights[:mid]) + blend_counts(total - first, weights[mid:])


class Batches:
    """A run's global batches from one source or a weighted blend of several (Megatron-LM's
    blend: each source keeps its own epochs; a small source with a large weight repeats sooner).
    `ramp`: the global batch of each step (config/rampup.py); global_batch at every step if None.
    `eos`: the token that ends a document, under document masking (train.document_mask, unless
    not `mask_documents`) or position reset (`reset_positions`, train.reset_positions)."""

    def __init__(self, sources: list[tuple[Fraction, TokenStream]], seq_len: int, global_batch: int, seed: int,
                 vocab_size: int, shuffle: bool = True, ramp: BatchRamp | None = None, eos: int | None = None,
                 mask_documents: bool = True, reset_positions: bool = False):
        self.weights = [Fraction(w) for w, _ in sources]
        # Each source its own shuffle: the first keeps the run's seed.
        self.windows = [Windows(tokens, seq_len, seed + (i << 32), shuffle) for i, (_, tokens) in enumerate(sources)]
        self.seq_len, self.global_batch, self.vocab_size, self.eos = seq_len, global_batch, vocab_size, eos
        self.mask_documents, self.reset_positions = mask_documents, reset_positions
        self.ramp = ramp or BatchRamp(global_batch, global_batch)
        self.loss_masked = any(tokens.loss_masks is not None for _, tokens in sources)
        self.origin = (0, 0)  # (step, sample): that step's first sample; later steps follow on

    def first_sample(self, step: int) -> int:
        """The run-wide number of the first sample of `step` (0-based, not before the origin's)."""
        return self.ramp.advance(self.origin[1], step - self.origin[0])

    def size(self, step: int) -> int:
        """The global batch of `step`: the ramp's at the samples read before it."""
        return self.ramp.size_at(self.first_sample(step))

    def continue_from(self, step: int, sample: int) -> None:
        """Start `step` at `sample`: a resume whose global batch differs from the saved run's."""
        self.origin = (step, sample)

    def rows(self, step: int, lo: int, hi: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Rows [lo, hi) of the step's global batch: (inputs, labels), each [hi - lo, seq_len]
        int64 (the windows are worked out for these rows only); a label the source's loss mask
        leaves out (a prompt token) is IGNORED_LABEL."""
        source, index = self._route(step, lo, hi)
        rows = np.empty((hi - lo, self.seq_len + 1), dtype=np.int64)
        counted = np.ones((hi - lo, self.seq_len), dtype=bool) if self.loss_masked else None
        for i, windows in enumerate(self.windows):
            here = source == i
            if here.any():
                rows[here] = windows.read(index[here])
                if counted is not None:
                    counted[here] = windows.counted(index[here])
        rows = torch.from_numpy(rows)
        low, high = (int(v) for v in torch.aminmax(rows))
        if low < 0 or high >= self.vocab_size:
            raise ValueError(f"token id {low if low < 0 else high} in the data is outside [0, model.vocab_size="
                             f"{self.vocab_size}); check data.source or model.vocab_size")
        labels = rows[:, 1:]
        if counted is not None:
            labels = labels.masked_fill(~torch.from_numpy(counted), IGNORED_LABEL)
        return rows[:, :-1], labels

    def loss_tokens(self, step: int) -> int:
        """How many labels of the step's global batch the loss counts (at least one): what the
        step's summed token loss is divided by. Every token's without a loss mask; with one,
        every rank reads the whole batch's masks (one byte a token, no communication), so that
        the mean is over the global batch's counted labels whatever the layout: a mean per
        micro-batch or per rank would weigh a label by how its batch was cut."""
        size = self.size(step)
        if not self.loss_masked:
            return size * self.seq_len
        source, index = self._route(step, 0, size)
        return max(1, sum(int(windows.counted(index[source == i]).sum())
                          for i, windows in enumerate(self.windows) if (source == i).any()))

    def _route(self, step: int, lo: int, hi: int) -> tuple[np.ndarray, np.ndarray]:
        """The source of rows [lo, hi) of the step's global batch, and each row's sample number within it."""
        first = self.first_sample(step)
        return route(np.arange(first + lo, first + hi, dtype=np.int64), self.weights)

    def epochs(self, steps: int) -> list[float]:
        """How many epochs of each source the run has read by step `steps`: from its start, or from
        where a resume under another global batch continued (`continue_from`)."""
        counts = blend_counts(self.first_sample(steps), self.weights)
        return [count / windows.per_epoch for count, windows in zip(counts, self.windows)]

    def eval_batches(self, requested: int) -> int:
        """Validation batches an evaluation of this one source runs: `requested`, but no more
        than its held-out windows fill (at least one, whose rows then wrap round), so a small
        validation set is not read over and over. A blend is evaluated per source (`split`)."""
        windows, = self.windows
        return max(1, min(requested, windows.per_epoch // self.global_batch))

    def split(self) -> list[tuple[Fraction, "Batches"]]:
        """Each source alone, with its weight (one part for a single source): validation
        evaluates a blend's sources apart."""
        if len(self.windows) == 1:
            return [(Fraction(1), self)]
        return [(weight, Batches([(1, w.tokens)], self.seq_len, self.global_batch, w.seed, self.vocab_size,
                                 w.shuffle, eos=self.eos, mask_documents=self.mask_documents,
                                 reset_positions=self.reset_positions)) for weight, w in zip(self.weights, self.windows)]

    def documents(self, inputs: torch.Tensor, device: torch.device) -> Documents | None:
        """The documents of these whole windows (host-side), or None without document masking.
        Every rank (every pipeline stage, every cp rank) derives them from the same rows: no
        communication."""
        if self.eos is None or not self.mask_documents:
            return None
        return Documents.of_windows(inputs, self.eos, device)

    def positions(self, inputs: torch.Tensor) -> torch.Tensor | None:
        """Each token's offset within its document in these whole windows (host-side, [b, S]), or
        None without train.reset_positions: every position runs on through the window."""
        return document_positions(inputs, self.eos) if self.reset_positions else None

    def global_batch_at(self, step: int) -> tuple[torch.Tensor, torch.Tensor]:
        return self.rows(step, 0, self.size(step))

    def microbatches(self, step: int, dp_rank: int, dp: int, micro_batch: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """This DP rank's contiguous share of the step's global batch, cut into micro-batches."""
        per_rank = self.size(step) // dp
        inputs, labels = self.rows(step, dp_rank * per_rank, (dp_rank + 1) * per_rank)
        return list(zip(inputs.split(micro_batch), labels.split(micro_batch)))


class DataPosition:
    """The data's place, for checkpoints: how many samples the steps so far read, so that a resume
    under another train.global_batch continues where the run left off, neither skipping nor
    re-reading any (Megatron-LM keeps consumed_samples for the same reason). The trainer sets
    `step` (steps done) after each step."""

    NAME = "data"  # in a checkpoint: extra.data.step, extra.data.samples

    def __init__(self, batches: Batches):
        self.batches, self.step = batches, 0

    def state_dict(self) -> dict:
        return {"step": self.step, "samples": self.batches.first_sample(self.step)}

    def load_state_dict(self, state: dict) -> None:
        self.step = int(state["step"])
        self.batches.continue_from(self.step, int(state["samples"]))


def split_batches(cfg) -> tuple[Batches, Batches | None]:
    """The training batches and, when `data.val_source` or `data.val_fraction` sets some tokens
    apart, the validation batches (same shapes, in order: batch i of an evaluation is
    `microbatches(i, ...)`, so every evaluation sees the same held-out windows)."""
    d, m, t = cfg.data, cfg.model, cfg.train
    train, val = load_blend(d.source, d.val_source, d.val_fraction)
    # The validation's EOS too (data/checks.py).
    ends = dict(eos=end_of_document(d.source) if t.document_mask or t.reset_positions else None,
                mask_documents=t.document_mask, reset_positions=t.reset_positions)
    return (Batches(train, m.seq_len, t.global_batch, t.seed, m.vocab_size, ramp=BatchRamp.of(t), **ends),
            None if val is None else Batches(val, m.seq_len, t.global_batch, t.seed, m.vocab_size, False, **ends))


def describe(cfg, resume: Path | None = None) -> str:
    """One line for the start of a run: how many epochs of its data (of each source of a blend)
    it trains, and how much of the held-out data an evaluation reads. `resume`: the checkpoint
    the run continues from, whose data place counts the samples read before it."""
    train, val = split_batches(cfg)
    t = cfg.train
    batch = f"{t.batch_rampup[0]}..{t.global_batch} (ramped up)" if t.batch_rampup else t.global_batch
    span = _resumed(train, resume, f"x {batch}", t.steps) or f"{counted(t.steps, 'step')} x {batch}"
    epochs = train.epochs(t.steps)
    if len(epochs) == 1:
        line = (f"tetrad: data: {counted(train.windows[0].per_epoch, 'window')} of {cfg.model.seq_len} tokens an epoch"
                f"{_packed(train.windows[0], t.document_mask)}; {span} = {epochs[0]:.2f} epochs")
    else:
        counts = blend_counts(train.first_sample(t.steps), train.weights)
        parts = ", ".join(f"{100 * float(w):.3g}% {name} ({counted(windows.per_epoch, 'window')} an epoch"
                          f"{_packed(windows, t.document_mask)}: {e:.2f} epochs"
                          f"{'' if count else '; no sample in this run: raise its weight or train longer'})"
                          for (w, name), windows, e, count in zip(blend_parts(cfg.data.source), train.windows,
                                                                  epochs, counts))
        line = f"tetrad: data: {span} windows of {cfg.model.seq_len} tokens from {parts}"
    if val is not None and t.eval_every:
        parts = [batches for _, batches in val.split()]
        used = [part.eval_batches(t.eval_steps) for part in parts]
        held_out = [part.windows[0].per_epoch for part in parts]
        read = sum(min(n * t.global_batch, h) for n, h in zip(used, held_out))
        line += f"; an evaluation reads {read:,} of {counted(sum(held_out), 'held-out window')}"
        notes = ["each source apart"] if len(parts) > 1 else []
        if min(used) < t.eval_steps:
            notes.append(f"{'/'.join(map(str, used))} batch{'es' if max(used) > 1 else ''}; train.eval_steps="
                         f"{t.eval_steps} asks for more than they hold")
        line += f" ({': '.join(notes)})" if notes else ""
    return line


def _resumed(batches: Batches, resume: Path | None, per_step: str, steps: int) -> str | None:
    """A resume under another global batch (or ramp-up) than the one that read its steps: the
    samples read before it, from the checkpoint's data place (which `batches` then continues
    from), and the steps after it, in words. None for a fresh start or a resume whose steps this
    batch would have read alike (and for a checkpoint that cannot say: the resume reports it)."""
    try:
        saved = read_extras(resume, DataPosition.NAME) if resume is not None else {}
    except (CheckpointError, OSError):
        return None
    if "samples" not in saved:
        return None
    step, samples = int(saved["step"]), int(saved["samples"])
    if samples == batches.first_sample(step):
        return None
    batches.continue_from(step, samples)
    return f"{counted(samples, 'sample')} read by step {step}, then {counted(steps - step, 'step')} {per_step}"


def _packed(windows: Windows, document_mask: bool) -> str:
    """What a packed source's windows hold (data/packing.py), for `describe`; '' for others. Where
    a window holds several examples, without document masking they attend to each other."""
    packs = windows.packs
    if packs is None:
        return ""
    cut = f", {packs.truncated:,} cut to seq_len + 1 tokens" if packs.truncated else ""
    mixed = "; they attend to each other: set train.document_mask=true to keep each to itself" \
        if packs.examples > len(packs) and not document_mask else ""
    return (f", each whole fine-tuning examples ({packs.examples:,} in all{cut}; "
            f"{packs.fill():.0%} of the windows' tokens are examples', the rest padding{mixed})")
