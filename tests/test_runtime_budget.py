"""Token-budget batching: the budget from the estimate, the sampler's batches, the padding
collator, and a skewed dataset trained batch by batch under a CpuMemoryTracker with no OOM and
several times the tokens per step of the fixed batch that is safe for the longest sample."""

from __future__ import annotations

import math
import warnings

import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

from llamem.analytic import estimate  # noqa: E402
from llamem.errors import DoesNotFit, LlamemError  # noqa: E402
from llamem.model import load_model  # noqa: E402
from llamem.runtime import (  # noqa: E402
    CpuMemoryTracker,
    PaddingCollator,
    TokenBudgetBatchSampler,
    infer_workload,
    token_budget,
    token_budget_dataloader,
)
from llamem.runtime.batch import InvalidArgument, Predictor  # noqa: E402
from llamem.runtime.budget import padded_lengths  # noqa: E402
from llamem.workload import build_workload, with_changes  # noqa: E402

MiB = 2**20
VOCAB, CAPACITY = 512, 24 * MiB


def _model():
    warnings.filterwarnings("ignore")
    torch.manual_seed(0)
    config = transformers.LlamaConfig(vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                      num_attention_heads=4, num_key_value_heads=2)
    return transformers.LlamaForCausalLM(config)


def _skewed_lengths() -> list[int]:
    """180 short samples (8-32 tokens) and 20 long ones (128-256)."""
    generator = torch.Generator().manual_seed(0)
    short = torch.randint(8, 33, (180,), generator=generator).tolist()
    long = torch.randint(128, 257, (20,), generator=generator).tolist()
    return short + long


@pytest.mark.parametrize("attn", ["sdpa", "eager"])
def test_the_estimate_grows_with_the_length_at_a_fixed_token_count(attn):
    """At b x L = 8192 tokens the longest sequence is the worst shape (the module's premise)."""
    spec = load_model("debug")
    w = build_workload("train", batch=1, seq=64, attn=attn)
    peaks = [estimate(spec, with_changes(w, batch=8192 // n, seq=n)).peak_allocated_bytes
             for n in (64, 128, 256, 512, 1024, 2048, 4096, 8192)]
    assert peaks == sorted(peaks)
    spread = peaks[-1] / peaks[0] - 1
    assert spread < 0.01 if attn == "sdpa" else spread > 1


def test_padded_lengths():
    assert padded_lengths(3, 10, None) == [10, 9, 8, 7, 6, 5, 4, 3]
    assert padded_lengths(3, 10, 4) == [12, 8, 4]


def test_skewed_lengths_train_without_oom_at_several_times_the_tokens():
    model = _model()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4, foreach=True)
    lengths = _skewed_lengths()
    generator = torch.Generator().manual_seed(1)
    data = [{"input_ids": torch.randint(0, VOCAB, (n,), generator=generator)} for n in lengths]
    with CpuMemoryTracker(CAPACITY, history=False) as tracker:
        tracker.track(model)
        budget = token_budget(model, tracker=tracker, seq_max=max(lengths), seq_min=min(lengths),
                              optimizer=optimizer, autocast_dtype="fp32")
        inferred = infer_workload(model, optimizer=optimizer, batch=1, seq=max(lengths), task="train",
                                  autocast_dtype="fp32")
        fixed = Predictor(inferred.spec, inferred.workload, "allocated").largest(CAPACITY, 1024)
        sampler = TokenBudgetBatchSampler(lengths, budget.max_tokens, shuffle=True, seed=0)
        peaks = [_train(model, optimizer, tracker, PaddingCollator()([data[i] for i in batch])) for batch in sampler]
        # The fixed batch is the real edge for the longest sample: one more OOMs.
        longest = {"input_ids": torch.zeros(max(lengths), dtype=torch.long)}
        assert _fits(model, optimizer, tracker, [longest] * fixed)
        assert not _fits(model, optimizer, tracker, [longest] * (fixed + 1))
    assert (budget.max_tokens, budget.worst_batch, budget.worst_length, fixed) == (1495, 13, 115, 5)
    assert max(peaks) <= CAPACITY and max(peaks) >= 0.99 * CAPACITY
    # Tokens per step: the same real tokens in 7 budget steps as in ceil(200 / 5) = 40 fixed ones.
    ratio = math.ceil(len(lengths) / fixed) / len(sampler)
    assert len(sampler) == 7 and ratio >= 1.5
    assert round(ratio, 2) == 5.71


def _train(model, optimizer, tracker, inputs: dict) -> int:
    tracker.reset_peak()
    loss = model(**inputs).loss
    loss.backward()
    del loss, inputs
    torch.nn.utils.clip_grad_norm_(list(model.parameters()), 1.0, foreach=True)
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    return tracker.peak_bytes


def _fits(model, optimizer, tracker, features: list[dict]) -> bool:
    failed = False
    try:
        _train(model, optimizer, tracker, PaddingCollator()(features))
    except torch.OutOfMemoryError:
        failed = True
    model.zero_grad(set_to_none=True)
    return not failed


def test_every_batch_is_within_the_budget_and_every_sample_is_used_once():
    lengths = _skewed_lengths()
    for multiple in (None, 8):
        sampler = TokenBudgetBatchSampler(lengths, 1000, pad_to_multiple_of=multiple)
        batches = list(sampler)
        assert sorted(i for b in batches for i in b) == list(range(len(lengths)))
        assert all(len(b) * sampler.padded(max(lengths[i] for i in b)) <= 1000 for b in batches)
        assert len(batches) == len(sampler)


def test_shuffle_follows_seed_and_epoch_and_keeps_the_count():
    lengths = _skewed_lengths()
    sampler = TokenBudgetBatchSampler(lengths, 1000, shuffle=True, seed=3)
    first, again = list(sampler), list(sampler)
    sampler.set_epoch(1)
    later = list(sampler)
    assert first == again and first != later
    assert len(first) == len(later) == len(sampler)
    assert sorted(i for b in later for i in b) == list(range(len(lengths)))


def test_drop_last_drops_a_batch_that_could_have_held_more():
    lengths = [10] * 7
    assert [len(b) for b in TokenBudgetBatchSampler(lengths, 30)] == [3, 3, 1]
    assert [len(b) for b in TokenBudgetBatchSampler(lengths, 30, drop_last=True)] == [3, 3]
    assert len(TokenBudgetBatchSampler(lengths, 30, drop_last=True)) == 2


def test_a_sample_longer_than_the_budget_is_a_clear_error():
    with pytest.raises(LlamemError, match=r"2 samples are longer than max_tokens=100 \(the longest: index 2, 300 "
                                          r"tokens, 300 padded\): truncate sequences to 100 tokens"):
        TokenBudgetBatchSampler([50, 120, 300], 100)
    with pytest.raises(LlamemError, match="104 padded"):
        TokenBudgetBatchSampler([99, 101], 100, pad_to_multiple_of=8)


def test_the_collator_pads_right_and_masks_labels():
    out = PaddingCollator(pad_token_id=7, pad_to_multiple_of=4)([{"input_ids": [1, 2, 3]}, {"input_ids": [4]}])
    assert out["input_ids"].tolist() == [[1, 2, 3, 7], [4, 7, 7, 7]]
    assert out["labels"].tolist() == [[1, 2, 3, -100], [4, -100, -100, -100]]
    assert "attention_mask" not in out
    masked = PaddingCollator(attention_mask=True)([{"input_ids": [1, 2]}, {"input_ids": [3]}])
    assert masked["attention_mask"].tolist() == [[1, 1], [1, 0]]


def test_a_sequence_that_does_not_fit_alone():
    model = _model()
    with CpuMemoryTracker(2 * MiB) as tracker:
        tracker.track(model)
        with pytest.raises(DoesNotFit, match="one sequence of 256 tokens does not fit in 2.00 MiB") as caught:
            token_budget(model, tracker=tracker, seq_max=250, autocast_dtype="fp32", pad_to_multiple_of=8)
    # The command sizes the padded length; the model has no hub id, so its config must be written first.
    assert ("write the model's config with `llamem.runtime.infer_workload(model).write_config('config.json')` and "
            "run `llamem estimate --config config.json --task train --batch 1 --seq 256 --precision fp32 --optimizer "
            "adamw --ac none`") in str(caught.value)
    assert str(caught.value).endswith("Assumed, not read from the model: optimizer: none given (AdamW assumed). "
                                      "Pass optimizer= if the step runs otherwise.")


@pytest.mark.parametrize(("arguments", "message"), [
    ({"device_bytes": -1}, (r"device_bytes must be from 1 B to 1 PiB \(llamem.units.MAX_SIZE_BYTES\), got -1: "
                            r"pass the card's memory in bytes, e.g. llamem.units.parse_size\('24GiB'\)")),
    ({"device_bytes": 10**30}, "device_bytes must be from 1 B to 1 PiB"),
    ({"device_bytes": 2**30, "margin": 1}, "margin is the fraction of the card kept free: from 0 to below 1"),
    ({"device_bytes": 2**30, "seq_max": 0}, "seq_max must be a positive integer \\(tokens\\), got 0"),
    ({"device_bytes": 2**30, "seq_min": -3}, "seq_min must be a positive integer \\(tokens\\), got -3"),
    ({"device_bytes": 2**30, "seq_min": True}, "seq_min must be a positive integer \\(tokens\\), got True"),
    ({"device_bytes": 2**30, "seq_min": 300}, "seq_min=300 is above seq_max=256: give the dataset's shortest"),
    ({"device_bytes": 2**30, "pad_to_multiple_of": 0}, "pad_to_multiple_of must be a positive integer"),
    ({"device_bytes": 2**30, "keeps_outputs": 1}, "keeps_outputs must be True or False, got 1"),
    ({"device_bytes": 2**30, "task": "infer", "keeps_outputs": True}, "drop it for task='infer'"),
])
def test_bad_budget_arguments_name_the_fix(arguments, message):
    with pytest.raises(InvalidArgument, match=message):
        token_budget(_model(), **{"seq_max": 256, **arguments})


@pytest.mark.parametrize(("lengths", "message"), [
    ([2.9, 3.5, 16.7], (r"lengths\[0\] is 2.9 \(float\): lengths are whole token counts, one int per sample: "
                        r"pass len\(sample\['input_ids'\]\)")),
    (["a"], r"lengths\[0\] is 'a' \(str\)"),
    ([3, True], r"lengths\[1\] is True \(bool\)"),
    (torch.tensor([3.0, 4.0]), r"lengths\[0\] is tensor\(3.\) \(Tensor\)"),
    (None, "lengths must be a sequence of token counts, one int per sample"),
    ([3, 0], r"1 samples have no tokens \(first: index 1, length 0\): drop empty samples first"),
])
def test_lengths_that_are_not_token_counts_are_refused(lengths, message):
    with pytest.raises(InvalidArgument, match=message):
        TokenBudgetBatchSampler(lengths, 16)


def test_whole_numbers_of_any_integer_type_are_lengths():
    assert list(TokenBudgetBatchSampler(torch.tensor([3, 4, 5]), 8)) == [[0, 1], [2]]


@pytest.mark.parametrize("max_tokens", [True, 0, 16.0, "16"])
def test_max_tokens_must_be_a_positive_integer(max_tokens):
    with pytest.raises(InvalidArgument, match=f"max_tokens must be a positive integer \\(tokens per batch, "
                                              f"padding included\\), got {max_tokens!r}"):
        TokenBudgetBatchSampler([1, 1, 1], max_tokens)


def test_a_dataset_without_input_ids_names_the_field_and_lengths():
    with pytest.raises(InvalidArgument, match=r"dataset\[0\] has no 'input_ids' \(its fields: text\): tokenize the "
                                              r"dataset first, or pass lengths= \(each sample's token count\)"):
        token_budget_dataloader([{"text": "x"}], 64)
    with pytest.raises(InvalidArgument, match=r"dataset\[1\] has no 'input_ids' \(it is a str\)"):
        token_budget_dataloader([{"input_ids": [1]}, "text"], 64)
    loader = token_budget_dataloader([{"text": "x"}], 64, lengths=[1])
    with pytest.raises(InvalidArgument, match="feature 0 has no 'input_ids' .*or pass collate_fn= for its fields"):
        list(loader)


def test_a_loop_that_keeps_its_outputs_trains_within_the_kept_budget():
    """`out = model(**batch); out.loss.backward()` keeps the logits, cache and loss alive: at the
    default budget the skewed dataset runs out of memory, at the keeps_outputs budget it does not."""
    model = _model()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4, foreach=True)
    lengths = _skewed_lengths()
    generator = torch.Generator().manual_seed(1)
    data = [{"input_ids": torch.randint(0, VOCAB, (n,), generator=generator)} for n in lengths]
    with CpuMemoryTracker(CAPACITY, history=False) as tracker:
        tracker.track(model)
        arguments = {"tracker": tracker, "seq_max": max(lengths), "seq_min": min(lengths), "optimizer": optimizer,
                     "autocast_dtype": "fp32"}
        default = token_budget(model, **arguments)
        kept = token_budget(model, keeps_outputs=True, **arguments)
        peak = _kept_loop(model, optimizer, tracker, data, TokenBudgetBatchSampler(lengths, kept.max_tokens))
        with pytest.raises(torch.OutOfMemoryError):
            _kept_loop(model, optimizer, tracker, data, TokenBudgetBatchSampler(lengths, default.max_tokens))
    assert (kept.max_tokens, kept.worst_batch, kept.worst_length, kept.peak_bytes) == (1286, 6, 214, 25_138_688)
    assert peak <= CAPACITY


def _kept_loop(model, optimizer, tracker, data: list[dict], sampler) -> int:
    """transformers' no_trainer loop over the sampler's batches; returns the highest peak."""
    peak = 0
    out = None
    try:
        for batch in sampler:
            tracker.reset_peak()
            out = model(**PaddingCollator()([data[i] for i in batch]))
            out.loss.backward()
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
            peak = max(peak, tracker.peak_bytes)
    finally:
        del out
        optimizer.state.clear()
        model.zero_grad(set_to_none=True)
    return peak


def test_the_device_figure_stays_below_the_card():
    budget = token_budget(_model(), device_bytes=2**30, seq_max=256, seq_min=8, autocast_dtype="fp32")
    assert budget.figure == "device" and budget.budget_bytes == int(2**30 * 0.97)
    assert budget.peak_bytes <= budget.budget_bytes


def test_a_trainer_trains_on_token_budget_batches(tmp_path):
    """The documented `get_train_dataloader` override, through accelerate's prepare."""
    model = _model()
    generator = torch.Generator().manual_seed(0)
    data = [{"input_ids": torch.randint(0, VOCAB, (n,), generator=generator)} for n in [8] * 30 + [64] * 4]
    shapes = []

    class TokenBudgetTrainer(transformers.Trainer):
        def get_train_dataloader(self):
            return self.accelerator.prepare(token_budget_dataloader(self.train_dataset, 128, seed=self.args.seed))

        def training_step(self, model, inputs, *args, **kwargs):
            shapes.append(tuple(inputs["input_ids"].shape))
            return super().training_step(model, inputs, *args, **kwargs)

    args = transformers.TrainingArguments(output_dir=str(tmp_path), num_train_epochs=1, report_to=[],
                                          save_strategy="no", use_cpu=True, logging_strategy="no",
                                          disable_tqdm=True)
    TokenBudgetTrainer(model=model, args=args, train_dataset=data).train()
    assert sorted(shapes) == [(2, 64), (2, 64), (14, 8), (16, 8)]
