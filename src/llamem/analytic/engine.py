"""Assemble per-phase breakdowns from the per-category formulas."""

from __future__ import annotations

from llamem.analytic import activations as act
from llamem.analytic.common import r512
from llamem.analytic.kv_cache import kv_cache_bytes, kv_layer_tensor_bytes, stored_tokens
from llamem.analytic.logits import training_logits
from llamem.analytic.optimizer import gradient_bytes, has_step_temporaries, optimizer_state_bytes
from llamem.analytic.weights import (autocast_copy_bytes, layer_autocast_copy_bytes, lora_tensor_sizes,
                                     model_weight_bytes)
from llamem.dtypes import DTYPE_BYTES
from llamem.model import ModelSpec
from llamem.report import MemoryReport
from llamem.workload import Workload


def estimate(spec: ModelSpec, workload: Workload, teacher: ModelSpec | None = None) -> MemoryReport:
    if workload.task == "distill" and teacher is None:
        from llamem.model import load_model

        teacher = load_model(workload.teacher)
    check_teacher(spec, teacher)
    weights = _weights(spec, workload, teacher)
    if workload.is_training:
        phases = _training_phases(spec, workload, weights, teacher)
    else:
        phases = _inference_phases(spec, workload, weights)
    notes = _notes(spec, workload)
    return MemoryReport(model=spec, workload=workload, engine="analytic", phases=phases, notes=tuple(notes))


def check_teacher(spec: ModelSpec, teacher: ModelSpec | None) -> None:
    if teacher is not None and teacher.vocab_size != spec.vocab_size:
        from llamem.errors import InvalidWorkload

        raise InvalidWorkload([f"distillation compares logits token by token: the teacher's vocabulary "
                               f"({teacher.name}: {teacher.vocab_size}) must equal the student's "
                               f"({spec.name}: {spec.vocab_size}); pick a teacher of the same family"])


def _notes(spec: ModelSpec, workload: Workload) -> list[str]:
    notes = []
    tokens = workload.seq + (workload.new_tokens if workload.task == "infer" else 0)
    if tokens > spec.max_position_embeddings:
        notes.append(f"{tokens} tokens exceed the model's max_position_embeddings "
                     f"({spec.max_position_embeddings}): quality may degrade beyond the trained context")
    return notes


def _weights(spec: ModelSpec, workload: Workload, teacher: ModelSpec | None) -> dict[str, int]:
    key = ("weights",) + _static_key(spec, workload, teacher)
    if key not in _STATIC_CACHE:
        _STATIC_CACHE[key] = _compute_weights(spec, workload, teacher)
    return dict(_STATIC_CACHE[key])


def _compute_weights(spec: ModelSpec, workload: Workload, teacher: ModelSpec | None) -> dict[str, int]:
    quant = workload.quant
    dtype = workload.weight_dtype
    weights, scales = model_weight_bytes(spec, dtype, quant)
    out = {"weights": weights}
    if scales:
        out["weights/quant_scales"] = scales
    if workload.uses_adapters:
        out["weights/adapters"] = sum(lora_tensor_sizes(spec, workload))
    if teacher is not None:
        out["weights/teacher"] = model_weight_bytes(teacher, "bf16")[0]
    return out


def _add(*parts: dict[str, int]) -> dict[str, int]:
    out: dict[str, int] = {}
    get = out.get
    for part in parts:
        for key, value in part.items():
            if value:
                out[key] = get(key, 0) + value
    return out


def _training_phases(spec: ModelSpec, w: Workload, weights: dict[str, int],
                     teacher: ModelSpec | None) -> dict[str, dict[str, int]]:
    T = w.batch * w.seq
    e = act.compute_bytes(w)
    state, grads, copy_bytes = _static_training_bytes(spec, w)
    copies = {"weights/autocast_copies": copy_bytes}
    inputs = {"inputs": r512(8 * T)}
    train_all = w.task in ("train", "distill")
    # Gradients from earlier micro-batches live through the later ones' forward and backward.
    carried = {"gradients": grads} if w.grad_accum > 1 else {}

    layers = (act.layer_saved_bytes(spec, w, 0), act.layer_saved_bytes(spec, w, 1))
    saved = sum(act.model_saved_bytes(spec, w, layers).values())
    rope = 2 * r512(w.seq * spec.head_dim * (4 if w.mixed else e))
    final_norm = act._norm_saved(T, spec.hidden_size, e, w.mixed, True, train_all)
    final_out = r512((4 if w.mixed else e) * T * spec.hidden_size)
    final_out_saved = final_out if (train_all and not w.mixed) else 0
    if teacher is not None:
        final_out = final_out_saved  # distillation's peak is in the KL, after the model has returned
    head_numel = spec.vocab_size * spec.hidden_size
    head_grad = (r512(DTYPE_BYTES[w.weight_dtype] * head_numel) + r512(DTYPE_BYTES[w.compute_dtype] * head_numel)
                 if train_all else 0)
    logits = training_logits(w, spec.vocab_size, spec.hidden_size, head_trains=train_all and w.mixed,
                             teacher=teacher is not None, head_grad_bytes=head_grad)

    # Without checkpointing, transformers builds a DynamicCache in training too (use_cache defaults to
    # True); it holds every layer's K and V until the output is dropped after the loss. Under autocast
    # its K is an fp32 copy that SDPA does not keep (it keeps a bf16 cast), so it costs extra bytes.
    # (The chunked loss calls the decoder directly and drops its output, cache included, first.)
    cache_extra = (spec.num_layers * r512(4 * T * spec.kv_dim)
                   if (w.mixed and not w.ac_every and w.loss == "full") else 0)
    # With checkpointing (no cache) transformers materialises a boolean causal mask (b, 1, s, s);
    # the checkpoints keep it, and the position ids, until their layer's backward.
    ac_extra = r512(w.batch * w.seq * w.seq) + r512(8 * w.seq) if w.ac_every else 0
    persistent = _add(weights, state, carried, inputs)
    forward = _add(persistent, copies, {"activations": saved + rope + final_norm + final_out + cache_extra + ac_extra,
                                        "logits": logits.forward_peak})
    backward = _add(persistent, _copies_kept_for_backward(spec, w, copies),
                    {"activations": saved + rope + final_norm + final_out_saved + ac_extra,
                                         "logits": logits.backward_peak})
    if w.ac_every:
        backward = _max_total(backward, *_checkpointed_backward(spec, w, persistent, grads, rope,
                                                                sum(layers[1].values())))
    end_of_backward = _add(weights, state, inputs, {"gradients": grads})
    if spec.tie_word_embeddings and train_all:
        # The tied matrix gets two gradients (head, then embedding); AccumulateGrad adds them out of
        # place, so for a moment the head's, the embedding's and their sum are all alive.
        tied = r512(DTYPE_BYTES[w.weight_dtype] * spec.embedding_params)
        # With accumulation, the earlier micro-batches' gradient is added to as well.
        extra = 2 * tied if w.grad_accum > 1 else tied
        end_of_backward = _add(end_of_backward, {"logits": tied, "temporaries": extra})
    if sum(end_of_backward.values()) > sum(backward.values()):
        backward = end_of_backward
    optimizer = _add(weights, state, {"gradients": grads, "temporaries": grads if has_step_temporaries(w) else 0})
    return {"load": dict(weights), "forward": forward, "backward": backward, "optimizer": optimizer}


_STATIC_CACHE: dict[tuple, tuple] = {}


def _static_key(spec: ModelSpec, w: Workload, teacher: ModelSpec | None = None) -> tuple:
    """The workload fields that per-parameter quantities depend on (not batch, not sequence)."""
    return (spec, teacher, w.task, w.precision, w.quant, w.optimizer, w.lora_rank, w.lora_targets)


def _static_training_bytes(spec: ModelSpec, w: Workload) -> tuple[dict[str, int], int, int]:
    """Optimizer state, gradients and autocast copies depend on the parameters only: cached,
    because sweeps (planner, batch finder) vary the shape and keep the model."""
    key = ("train",) + _static_key(spec, w)
    if key not in _STATIC_CACHE:
        _STATIC_CACHE[key] = (optimizer_state_bytes(spec, w), gradient_bytes(spec, w), autocast_copy_bytes(spec, w))
    return _STATIC_CACHE[key]


def _copies_kept_for_backward(spec: ModelSpec, w: Workload, copies: dict[str, int]) -> dict[str, int]:
    """Autocast's cache dies with the autocast context; only copies autograd saved survive into
    backward, and a checkpointed layer saves none (its recompute casts again)."""
    if not (w.mixed and w.ac_every):
        return copies
    per_layer = layer_autocast_copy_bytes(spec)
    plain = spec.num_layers - -(-spec.num_layers // w.ac_every)
    return {"weights/autocast_copies": copies["weights/autocast_copies"] - (spec.num_layers - plain) * per_layer}


def _max_total(*candidates: dict[str, int]) -> dict[str, int]:
    return max(candidates, key=lambda c: sum(c.values()))


def _checkpointed_backward(spec: ModelSpec, w: Workload, persistent: dict[str, int], grads: int,
                           rope: int, layer: int) -> list[dict[str, int]]:
    """Backward through checkpointed layers. At layer i: the layers below keep their checkpoint
    inputs (or, unchecked, their saved sets), layer i has its full saved set back (recomputed),
    the gradients of the head and of the layers above exist, and the layer's own backward
    temporaries are alive (a residual-stream gradient and three MLP-sized gradients).
    Memory is linear in i between the ends, so the top and bottom layers are the candidates."""
    T = w.batch * w.seq
    ae = 2 if w.mixed else act.compute_bytes(w)
    L, K = spec.num_layers, w.ac_every
    stream = act.stream_bytes(w, spec)
    bool_mask = r512(w.batch * w.seq * w.seq)  # the model-level causal mask (b, 1, s, s)
    wb = DTYPE_BYTES[w.weight_dtype]
    train_all = w.task in ("train", "distill")
    per_layer_grads = (grads - _head_grad_bytes(spec, w)) // L if train_all else grads // L
    head_grads = r512(wb * spec.lm_head_params) + r512(wb * spec.hidden_size) if train_all else 0
    # The first weight gradient of a layer's backward: down_proj's.
    own_grad = r512(wb * spec.hidden_size * spec.intermediate_size) if train_all else 0
    # A residual-stream gradient and three MLP-sized ones.
    transient = stream + 3 * r512(ae * T * spec.intermediate_size)
    # In pure precision the recompute also rebuilds the layer's residual midpoint h1 (kept as a
    # local of the recomputed forward; under autocast it is already part of the saved set).
    recomputed_h1 = 0 if w.mixed else stream
    # By then down_proj's backward has freed the SwiGLU product it kept.
    current = layer - (r512(ae * T * spec.intermediate_size) if train_all else 0)
    per_layer_copies = 0
    current_copies = 0
    if w.mixed:
        per_layer_copies = layer_autocast_copy_bytes(spec)
        # down_proj's copy goes with its backward, before the worst moment of the layer's.
        current_copies = layer_autocast_copy_bytes(spec, skip=("down_proj",))
    out = []
    for index in (L - 1, 0):
        checkpointed_below = -(-index // K)
        plain_below = index - checkpointed_below
        below = checkpointed_below * stream + plain_below * layer
        grads_now = head_grads + (L - 1 - index) * per_layer_grads + own_grad
        out.append(_add(persistent, {"gradients": grads_now,
                                     "weights/autocast_copies": plain_below * per_layer_copies + current_copies,
                                     "activations": below + current + recomputed_h1 + rope + bool_mask + r512(8 * w.seq),
                                     "temporaries": transient}))
    return out


def _head_grad_bytes(spec: ModelSpec, w: Workload) -> int:
    dtype_bytes = DTYPE_BYTES[w.weight_dtype]
    head = r512(dtype_bytes * spec.lm_head_params) if spec.lm_head_params else 0
    return head + r512(dtype_bytes * spec.embedding_params) + r512(dtype_bytes * spec.hidden_size)


def _prefill_transient(spec: ModelSpec, w: Workload, chunk: int, keys: int) -> int:
    """Largest set of live temporaries inside one layer while a prefill forward runs `chunk` prompt
    tokens against `keys` keys (no autograd)."""
    T = w.batch * chunk
    e = act.compute_bytes(w)
    h, I = spec.hidden_size, spec.intermediate_size
    held = _prefill_held(spec, w, chunk)
    mlp = held + 2 * r512(e * T * h) + 3 * r512(e * T * I)
    norm = held + r512(e * T * h) + 2 * r512(4 * T * h)
    attention = 0
    if w.attn == "eager":
        # Eager attention: the (b, 1, s, s) additive mask for the whole model; per layer the norm
        # output, q, k and v repeated to all heads (GQA), the scores (compute dtype), their fp32
        # upcast and the fp32 softmax.
        probs = w.batch * spec.num_heads * chunk * keys
        mask = r512(e * w.batch * chunk * keys)
        q = spec.q_dim
        repeats = 2 * r512(e * w.batch * keys * q) if spec.gqa_groups > 1 else 0  # repeat_kv copies (GQA only)
        upcast = r512(4 * probs) if e < 4 else 0  # softmax(dtype=float32) on non-fp32 scores
        attention = held + mask + r512(e * T * h) + r512(e * T * q) + repeats + r512(e * probs) + upcast + r512(
            4 * probs)
    return max(mlp, norm, attention)


def _prefill_held(spec: ModelSpec, w: Workload, chunk: int) -> int:
    """LlamaModel keeps `inputs_embeds` referenced through the layer loop, plus RoPE's cos and sin;
    from layer 1 on, the loop variable also keeps the current layer's input."""
    e = act.compute_bytes(w)
    return r512(e * w.batch * chunk * spec.hidden_size) * (2 if spec.num_layers > 1 else 1) + 2 * r512(
        e * chunk * spec.head_dim)


def _chunks(w: Workload) -> tuple[int, int]:
    """(chunk length, last chunk's length) of the prefill."""
    chunk = w.prefill_step
    return chunk, w.seq - (w.seq - 1) // chunk * chunk


def _prefill(spec: ModelSpec, w: Workload) -> dict[str, int]:
    """The prefill's worst moment: inside the last layer, before the head runs (its logits are one
    token). A chunked prefill's is in its first chunk (no mask yet), its last, or the last full-size one."""
    chunk, last = _chunks(w)
    if spec.sliding_window and chunk > spec.sliding_window:
        # A window shorter than the chunk: a plain causal mask no longer says it, so the first chunk
        # already has the explicit mask and what comes with it.
        candidates = _chunk_moments(spec, w, chunk, chunk, first=True)
    else:
        candidates = [{"kv_cache": kv_cache_bytes(spec, w.batch, chunk, w.kv_dtype),
                       "temporaries": _prefill_transient(spec, w, chunk, chunk)}]
    if chunk < w.seq:
        candidates += _chunk_moments(spec, w, last, w.seq)
    if w.seq - last > chunk:
        candidates += _chunk_moments(spec, w, chunk, w.seq - last)
    return max(candidates, key=lambda moment: sum(moment.values()))


def _chunk_moments(spec: ModelSpec, w: Workload, chunk: int, end: int, first: bool = False) -> list[dict[str, int]]:
    """Candidate worst moments of a prefill chunk with an attention mask, ending at prompt position
    `end`."""
    e = act.compute_bytes(w)
    T = w.batch * chunk
    keys = stored_tokens(spec, end, chunk)  # the cache's concatenation with the chunk
    cache = kv_cache_bytes(spec, w.batch, keys, w.kv_dtype)
    # Attention needs an explicit (chunk x keys) bool mask, broadcast over the batch; generate() still
    # holds the previous chunk's last-token logits.
    shared = {} if first else {"logits": r512(e * w.batch * spec.vocab_size)}
    mask = r512(chunk * keys) + r512(8 * chunk)  # and the chunk's cache positions
    held = _prefill_held(spec, w, chunk)
    moments = [{**shared, "kv_cache": cache, "temporaries": _prefill_transient(spec, w, chunk, keys) + mask}]
    # The cache grows by torch.cat: in the last layer, the old V (DynamicLayer; a sliding-window
    # layer also the old K) is still alive beside the new one, with the chunk's projections.
    projections = 2 * r512(e * T * spec.hidden_size) + r512(e * T * spec.q_dim)
    old = kv_layer_tensor_bytes(spec, w.batch, stored_tokens(spec, end - chunk, chunk), w.kv_dtype)
    if not first:
        moments.append({**shared, "kv_cache": cache + _old_tensors_alive(spec) * old,
                        "temporaries": held + projections + mask})
    if w.attn == "sdpa":
        output = r512(e * T * spec.q_dim) + r512(4 * w.batch * spec.num_heads * chunk)
        moments.append({**shared, "kv_cache": cache, "temporaries": (
            held + 2 * r512(e * T * spec.hidden_size) + sum(act.masked_sdpa_sizes(spec, w, chunk, keys)) + mask
            + output)})
    return moments


def _old_tensors_alive(spec: ModelSpec) -> int:
    """Old cache tensors of one layer alive while it grows: DynamicLayer replaces K before making the
    new V; DynamicSlidingWindowLayer makes both before replacing either."""
    return 2 if spec.sliding_window else 1


def _decode_cache(spec: ModelSpec, w: Workload) -> int:
    """The cache at the decode's worst moment: one layer's old and new tensors alive at once, at the
    last step, or at the first for a sliding window (the prompt's storage is still whole)."""
    _chunk, last = _chunks(w)
    final = w.seq + w.new_tokens - 1
    moments = [(stored_tokens(spec, final - 1), stored_tokens(spec, final))]
    if spec.sliding_window:
        moments.append((stored_tokens(spec, w.seq, last), stored_tokens(spec, w.seq + 1)))
    return max(kv_cache_bytes(spec, w.batch, before, w.kv_dtype) + _old_tensors_alive(spec) * (
        kv_layer_tensor_bytes(spec, w.batch, after, w.kv_dtype)) for before, after in moments)


def _inference_phases(spec: ModelSpec, w: Workload, weights: dict[str, int]) -> dict[str, dict[str, int]]:
    inputs = {"inputs": r512(8 * w.batch * w.seq)}
    prefill = _add(weights, inputs, _prefill(spec, w))
    phases = {"load": dict(weights), "prefill": prefill}
    if w.new_tokens > 1:
        final = w.seq + w.new_tokens - 1
        vocab = w.batch * spec.vocab_size
        # Eager attention repeats the whole cached K and V to every query head (GQA only).
        repeated = 0
        if w.attn == "eager" and spec.gqa_groups > 1:
            repeated = 2 * r512(DTYPE_BYTES[w.compute_dtype] * w.batch * spec.q_dim * stored_tokens(spec, final))
        phases["decode"] = _add(weights, inputs, {
            "temporaries": repeated,
            "kv_cache": _decode_cache(spec, w),
            "logits": r512(DTYPE_BYTES[w.compute_dtype] * vocab) + r512(4 * vocab)})
    return phases
