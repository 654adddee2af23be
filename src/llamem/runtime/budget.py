"""Token-budget batching: as many sequences per micro-batch as the card holds at their padded length.

A fixed batch size has to be safe for the longest sequence, so a batch of short ones leaves most
of the card empty. Here a micro-batch of `b` sequences padded to `L` tokens may hold up to
`max_tokens` >= b x L tokens, padding included, and the budget comes from the estimate.

Why a token count bounds memory, and which shape is the worst. Activations, logits and the
loss's temporaries grow with b x L. Some terms grow with L alone at a fixed product: the RoPE
tables (b x L x head_dim), and with eager attention the b x heads x L^2 probabilities. The
analytic engine is monotone in L at a fixed product b x L for both attention kinds (checked in
tests/test_runtime_budget.py; for sdpa the spread is under 1 %, for eager it is large). So of
shapes with exactly T tokens the longest sequence is the worst. But the sampler's shapes are
b x L with b = floor(T / L): a shorter L can pack more tokens (T = 1000 with L = 600 is one
sequence, 600 tokens; with L = 500 it is two, 1000 tokens). `token_budget` therefore takes the
worst estimate over every shape the sampler can produce (every padded length from `seq_min` to
`seq_max`, each with the most sequences that fit in T) and returns the largest T for which
that worst case fits. Which figure is held against the card: see `llamem.runtime.batch`.

The collator pads on the right and by default passes no attention mask. With causal attention a
real token never attends to a later position, so right padding changes nothing for real tokens,
and labels of -100 keep the padding out of the loss. A padding mask makes transformers build a
b x 1 x L x L mask and leaves sdpa's causal kernel: measured on a tiny Llama (batch 16, 128
tokens) the step's peak grew by 9 %, which the estimate does not count.

The budget assumes the training loop drops the model's output before backward
(`model(**batch).loss.backward()`, as the Trainer does). A loop that keeps it
(`out = model(**batch); out.loss.backward()`) holds the logits (T x vocab in the compute dtype),
the cache's K and V and the loss until the next forward has returned: pass `keeps_outputs=True`
(see `llamem.runtime.batch`). In the forward phase the previous batch's output is counted at the
full budget of T tokens, since any earlier batch may have had that many.
"""

from __future__ import annotations

import dataclasses
import math
import operator
from dataclasses import dataclass

import torch
from torch.utils.data import Sampler

from llamem.errors import DoesNotFit
from llamem.runtime.batch import (
    DEFAULT_CUDA_MARGIN,
    InvalidArgument,
    Predictor,
    card_problems,
    is_count,
    largest_true,
    output_problems,
    sizing_hint,
)
from llamem.units import format_bytes
from llamem.workload import MAX_BATCH, MAX_TOKENS, with_changes

LABEL_PAD_ID = -100
"""What torch's cross-entropy ignores (transformers' `labels` convention)."""


@dataclass(frozen=True, slots=True)
class TokenBudget:
    max_tokens: int
    """Tokens per micro-batch, padding included: b x padded length may not exceed it."""
    worst_batch: int
    worst_length: int
    """The shape (sequences x padded length) with the highest estimate at `max_tokens`."""
    peak_bytes: int
    """The estimate of that shape, in `figure`."""
    budget_bytes: int
    figure: str
    """"allocated" under a CpuMemoryTracker, else "device" (see `llamem.runtime.batch`)."""


def max_tokens_per_batch(model, *, device_bytes: int | None = None, seq_max: int, task: str = "train",
                         optimizer=None, tracker=None, autocast_dtype: str | None = None, seq_min: int = 1,
                         pad_to_multiple_of: int | None = None, margin: float | None = None,
                         keeps_outputs: bool = False) -> int:
    """The largest tokens per micro-batch (padding included) that fit the card at every shape the
    sampler can produce with sequences of `seq_min` to `seq_max` tokens. See `token_budget`."""
    return token_budget(model, device_bytes=device_bytes, seq_max=seq_max, task=task, optimizer=optimizer,
                        tracker=tracker, autocast_dtype=autocast_dtype, seq_min=seq_min,
                        pad_to_multiple_of=pad_to_multiple_of, margin=margin, keeps_outputs=keeps_outputs).max_tokens


def token_budget(model, *, device_bytes: int | None = None, seq_max: int, task: str = "train", optimizer=None,
                 tracker=None, autocast_dtype: str | None = None, seq_min: int = 1,
                 pad_to_multiple_of: int | None = None, margin: float | None = None,
                 keeps_outputs: bool = False) -> TokenBudget:
    """`max_tokens_per_batch` with the worst shape and its estimate. `device_bytes` defaults to
    the tracker's capacity; under a tracker the allocated peak is held against it, else the
    device figure less `margin` (3 % by default, as the batch finder). The budget assumes the
    loop drops the model's output before backward (`model(**batch).loss.backward()`); pass
    `keeps_outputs=True` for `out = model(**batch); out.loss.backward()` (see the module)."""
    from llamem.runtime.infer import infer_workload

    _check_budget_arguments(device_bytes, margin, seq_min, seq_max, pad_to_multiple_of, task, keeps_outputs)
    figure = "allocated" if tracker is not None else "device"
    capacity = device_bytes or (tracker.capacity_bytes if tracker is not None else None)
    if not capacity:
        raise InvalidArgument("no card size: pass device_bytes= (e.g. llamem.units.parse_size('24GiB')), or a "
                              "CpuMemoryTracker with a capacity_bytes")
    margin = (0.0 if figure == "allocated" else DEFAULT_CUDA_MARGIN) if margin is None else margin
    budget = int(capacity * (1 - margin))
    inferred = infer_workload(model, optimizer=optimizer, batch=1, seq=seq_max, task=task,
                              autocast_dtype=autocast_dtype)
    if inferred.workload is None:
        raise InvalidArgument(f"cannot size a token budget for this model: {inferred.problem}")
    predictor = Predictor(inferred.spec, inferred.workload, "allocated", keeps_outputs=keeps_outputs)
    lengths = padded_lengths(seq_min, seq_max, pad_to_multiple_of)
    worst = _worst_case_search(predictor, lengths, figure, budget)
    if worst is None:
        longest = dataclasses.replace(inferred, workload=with_changes(inferred.workload, seq=lengths[0]))
        raise DoesNotFit(f"one sequence of {lengths[0]} tokens does not fit in {format_bytes(budget)}: lower "
                         f"seq_max, checkpoint activations, or use LoRA.{sizing_hint(longest, keeps_outputs)}")
    return TokenBudget(max_tokens=worst[0], worst_batch=worst[2], worst_length=worst[3], peak_bytes=worst[1],
                       budget_bytes=budget, figure=figure)


def _check_budget_arguments(device_bytes, margin, seq_min, seq_max, pad_to_multiple_of, task, keeps_outputs) -> None:
    """Every problem at once, each with its fix."""
    problems = card_problems(device_bytes, margin) + output_problems(keeps_outputs, task)
    for name, value in (("seq_min", seq_min), ("seq_max", seq_max), ("pad_to_multiple_of", pad_to_multiple_of)):
        if not is_count(value) and not (value is None and name == "pad_to_multiple_of"):
            problems.append(f"{name} must be a positive integer (tokens), got {value!r}")
    if is_count(seq_min) and is_count(seq_max) and seq_min > seq_max:
        problems.append(f"seq_min={seq_min} is above seq_max={seq_max}: give the dataset's shortest and longest "
                        "sequence")
    if problems:
        raise InvalidArgument("; ".join(problems))


def padded_lengths(seq_min: int, seq_max: int, multiple: int | None) -> list[int]:
    """Every padded length a batch can have, longest first."""
    step = multiple or 1
    top = math.ceil(seq_max / step) * step
    bottom = math.ceil(seq_min / step) * step
    return list(range(top, bottom - 1, -step))


def _worst_case_search(predictor, lengths: list[int], figure: str, budget_bytes: int):
    """(tokens, worst peak, batch, length) for the largest token count whose worst shape fits, or
    None when a single sequence of the longest length does not. The allocated figure is searched
    first (fast); the device figure adds the allocator's fragmentation and the CUDA context, is
    never below it, and is searched under the allocated answer. Token counts stop where a shape
    of the shortest length would pass llamem's largest batch (MAX_BATCH) or MAX_TOKENS."""
    longest = lengths[0]
    limit = min(MAX_TOKENS, MAX_BATCH * lengths[-1]) - longest + 1

    def fits(k: int, device: bool) -> bool:
        return _worst_shape(predictor, longest + k - 1, lengths, device)[0] <= budget_bytes

    top = largest_true(lambda k: fits(k, False), limit)
    if top and figure == "device":
        top = largest_true(lambda k: fits(k, True), top)
    if top == 0:
        return None
    tokens = longest + top - 1
    return (tokens, *_worst_shape(predictor, tokens, lengths, figure == "device"))


def _worst_shape(predictor, tokens: int, lengths: list[int], device: bool = False) -> tuple[int, int, int]:
    """(peak, batch, length) of the highest estimate among the shapes floor(tokens / L) x L. The
    estimate grows with the batch at a fixed length, so for each batch only its longest length
    counts: walking the lengths from the longest, a batch already seen is skipped."""
    worst, seen = (0, 0, 0), set()
    for length in lengths:
        batch = tokens // length
        if batch == 0 or batch in seen:
            continue
        seen.add(batch)
        # With a kept output, the previous batch's (up to `tokens` tokens) is alive in this forward.
        worst = max(worst, (predictor.allocated_bytes(batch, seq=length, previous_tokens=tokens), batch, length))
    if device:
        worst = (_device_bytes(predictor, worst, tokens), worst[1], worst[2])
    return worst


def _device_bytes(predictor, worst: tuple[int, int, int], tokens: int) -> int:
    """The worst shape's allocated peak with the fragmentation and CUDA context of the card. The
    fragmentation allowance grows with tokens (`llamem.device`), so it is taken at `tokens` in
    one row, which bounds every shape of at most that many tokens (eager attention and chunked
    prefill are probed by shape: there the worst shape's own allowance is used)."""
    from llamem.device import device_memory, shape_sensitive

    w = predictor.workload
    shaped = with_changes(w, batch=worst[1], seq=worst[2])
    probe = shaped if shape_sensitive(w) else with_changes(w, batch=1, seq=tokens)
    return device_memory(predictor.spec, probe, worst[0]).device_bytes


class TokenBudgetBatchSampler(Sampler):
    """Batches of dataset indices grouped by length, each with len(batch) x padded longest length
    <= max_tokens (padding included). Lengths are sorted and cut greedily; with `shuffle` the
    order of equal lengths and of the batches changes with `seed` and `set_epoch(epoch)` (as
    DistributedSampler), the batches' sizes do not, so `len()` stays fixed.
    `drop_last` drops the last batch when another sequence of its longest length would still fit."""

    def __init__(self, lengths, max_tokens: int, *, shuffle: bool = False, seed: int = 0, drop_last: bool = False,
                 pad_to_multiple_of: int | None = None) -> None:
        if not is_count(max_tokens):
            raise InvalidArgument(f"max_tokens must be a positive integer (tokens per batch, padding included), got "
                                  f"{max_tokens!r}: e.g. max_tokens_per_batch(model, ...)")
        if pad_to_multiple_of is not None and not is_count(pad_to_multiple_of):
            raise InvalidArgument(f"pad_to_multiple_of must be a positive integer, got {pad_to_multiple_of!r}")
        self.lengths = token_counts(lengths)
        self.max_tokens = max_tokens
        self.shuffle, self.seed, self.drop_last = shuffle, seed, drop_last
        self.pad_to_multiple_of = pad_to_multiple_of
        self.epoch = 0
        self._check_lengths()
        self._num_batches = len(self._batches(list(range(len(self.lengths)))))

    def padded(self, length: int) -> int:
        multiple = self.pad_to_multiple_of or 1
        return math.ceil(length / multiple) * multiple

    def _check_lengths(self) -> None:
        bad = [i for i, n in enumerate(self.lengths) if n < 1]
        if bad:
            raise InvalidArgument(f"{len(bad)} samples have no tokens (first: index {bad[0]}, length "
                                  f"{self.lengths[bad[0]]}): drop empty samples first")
        over = [i for i, n in enumerate(self.lengths) if self.padded(n) > self.max_tokens]
        if over:
            longest = max(over, key=lambda i: self.lengths[i])
            raise InvalidArgument(
                f"{len(over)} samples are longer than max_tokens={self.max_tokens} (the longest: index {longest}, "
                f"{self.lengths[longest]} tokens, {self.padded(self.lengths[longest])} padded): truncate sequences "
                f"to {self.max_tokens} tokens, or raise max_tokens if the card holds more")

    def set_epoch(self, epoch: int) -> None:
        self.epoch = epoch

    def _batches(self, tiebreak: list[int]) -> list[list[int]]:
        order = sorted(range(len(self.lengths)), key=lambda i: (self.lengths[i], tiebreak[i]))
        batches: list[list[int]] = []
        current: list[int] = []
        for index in order:
            # Sorted ascending, so the newcomer's padded length is the batch's longest.
            if current and (len(current) + 1) * self.padded(self.lengths[index]) > self.max_tokens:
                batches.append(current)
                current = []
            current.append(index)
        if current and not (self.drop_last and
                            (len(current) + 1) * self.padded(self.lengths[current[-1]]) <= self.max_tokens):
            batches.append(current)
        return batches

    def __iter__(self):
        if not self.shuffle:
            yield from self._batches(list(range(len(self.lengths))))
            return
        generator = torch.Generator().manual_seed(self.seed + self.epoch)
        batches = self._batches(torch.randperm(len(self.lengths), generator=generator).tolist())
        for position in torch.randperm(len(batches), generator=generator).tolist():
            yield batches[position]

    def __len__(self) -> int:
        return self._num_batches


def token_counts(lengths) -> list[int]:
    """The samples' token counts as ints: whole numbers only (ints, numpy or 0-d tensor integers),
    since a truncated 16.7 would let a 17-token sample pass the budget."""
    try:
        values = list(lengths)
    except TypeError:
        raise InvalidArgument(f"lengths must be a sequence of token counts, one int per sample "
                              f"(len(sample['input_ids'])), got {type(lengths).__name__}") from None
    counts = [_whole(value) for value in values]
    if None in counts:
        index = counts.index(None)
        raise InvalidArgument(f"lengths[{index}] is {values[index]!r} ({type(values[index]).__name__}): lengths are "
                              "whole token counts, one int per sample: pass len(sample['input_ids'])")
    return counts


def _whole(value) -> int | None:
    if isinstance(value, bool):  # an int subclass: True is a mistake, not 1 token
        return None
    try:
        return operator.index(value)
    except TypeError:
        return None


@dataclass(frozen=True)
class PaddingCollator:
    """Right-pads `input_ids` to the batch's longest (rounded up to `pad_to_multiple_of`), makes
    `labels` (the ids, or the features' own labels) with -100 on the padding, and adds an
    `attention_mask` only when asked (see the module: it costs memory the estimate does not count)."""

    pad_token_id: int = 0
    pad_to_multiple_of: int | None = None
    attention_mask: bool = False

    def __call__(self, features: list[dict]) -> dict:
        for index, feature in enumerate(features):
            if not _has_input_ids(feature):
                raise InvalidArgument(f"feature {index} has no 'input_ids' ({_keys(feature)}): PaddingCollator pads "
                                      "token ids: tokenize the dataset first, or pass collate_fn= for its fields")
        ids = [torch.as_tensor(f["input_ids"], dtype=torch.long) for f in features]
        labels = [torch.as_tensor(f.get("labels", f["input_ids"]), dtype=torch.long) for f in features]
        multiple = self.pad_to_multiple_of or 1
        length = math.ceil(max(len(i) for i in ids) / multiple) * multiple
        out = {"input_ids": torch.full((len(ids), length), self.pad_token_id, dtype=torch.long),
               "labels": torch.full((len(ids), length), LABEL_PAD_ID, dtype=torch.long)}
        if self.attention_mask:
            out["attention_mask"] = torch.zeros((len(ids), length), dtype=torch.long)
        for row, (sample, label) in enumerate(zip(ids, labels)):
            out["input_ids"][row, :len(sample)] = sample
            out["labels"][row, :len(label)] = label
            if self.attention_mask:
                out["attention_mask"][row, :len(sample)] = 1
        return out


def token_budget_dataloader(dataset, max_tokens: int, *, lengths=None, collate_fn=None, pad_token_id: int = 0,
                            shuffle: bool = True, seed: int = 0, drop_last: bool = False,
                            pad_to_multiple_of: int | None = None, num_workers: int = 0):
    """A DataLoader whose batches hold at most `max_tokens` tokens with padding: the sampler above
    and the padding collator. `lengths` defaults to len(dataset[i]["input_ids"]).

    With a transformers Trainer, override its train dataloader:

        class TokenBudgetTrainer(Trainer):
            def get_train_dataloader(self):
                loader = token_budget_dataloader(self.train_dataset, MAX_TOKENS, seed=self.args.seed)
                return self.accelerator.prepare(loader)
    """
    from torch.utils.data import DataLoader

    if lengths is None:
        lengths = _dataset_lengths(dataset)
    sampler = TokenBudgetBatchSampler(lengths, max_tokens, shuffle=shuffle, seed=seed, drop_last=drop_last,
                                      pad_to_multiple_of=pad_to_multiple_of)
    collate = collate_fn or PaddingCollator(pad_token_id=pad_token_id, pad_to_multiple_of=pad_to_multiple_of)
    return DataLoader(dataset, batch_sampler=sampler, collate_fn=collate, num_workers=num_workers)


def _dataset_lengths(dataset) -> list[int]:
    """len(dataset[i]["input_ids"]) for every sample, or an error naming the field and `lengths=`."""
    try:
        size = len(dataset)
    except TypeError:
        raise InvalidArgument(f"the dataset ({type(dataset).__name__}) has no len(): token budgets sort samples by "
                              "length, so they need a map-style dataset (len() and dataset[i])") from None
    lengths = []
    for index in range(size):
        sample = dataset[index]
        if not _has_input_ids(sample):
            raise InvalidArgument(f"dataset[{index}] has no 'input_ids' ({_keys(sample)}): tokenize the dataset "
                                  "first, or pass lengths= (each sample's token count) and a collate_fn= for its fields")
        lengths.append(len(sample["input_ids"]))
    return lengths


def _has_input_ids(sample) -> bool:
    try:
        len(sample["input_ids"])
    except (KeyError, TypeError, IndexError):
        return False
    return True


def _keys(sample) -> str:
    if hasattr(sample, "keys"):
        return "its fields: " + (", ".join(map(str, sample.keys())) or "none")
    return f"it is a {type(sample).__name__}"
