"""`--compile`: the training step under `torch.compile`, traced on fake tensors.

The model's forward is compiled with AOT autograd, inductor's decompositions and the partitioner
inductor uses (`min_cut_rematerialization_partition(compiler="inductor")`, the
`aot_eager_decomp_partition` backend), so autograd keeps exactly what the compiled graph saves:
the partitioner saves matmul and attention outputs and recomputes cheap pointwise chains in
backward. The partitioned forward and backward graphs then run node by node under the storage
tracer, which counts every storage their ops make.

Two things differ from an eager trace:

- Categories. Module hooks do not fire inside a compiled graph, so each graph node is labelled from
  the module stack dynamo records on it (`nn_module_stack`, `fwd_nn_module_stack` in backward):
  forward nodes of the decoder make activations, those of the head and the loss make logits;
  backward nodes of the decoder make temporaries (recomputed forward nodes: activations), those of
  the head and the loss logits. What the forward graph saves for backward is thus counted as
  activations (or logits), as in eager.
- Fusion. Inductor fuses chains of pointwise ops into one kernel that materialises only the chain's
  end; the eager replay of the partitioned graph would materialise every link. The trace counts a
  node's output when inductor must materialise it: a graph output (what backward gets saved and
  what the graph returns), the output of a matmul, attention, reduction or any op that is not
  pointwise, and a pointwise result read by such an op (through views). The pointwise links in
  between are not counted; they are still tallied apart, so the report can say what counting them
  too (the eager replay, an upper bound) would add at the peak.
"""

from __future__ import annotations

import functools
import weakref
from importlib import import_module

import torch

from llamem.trace.tracer import COPY_OPS, StorageTracer, rounded
from llamem.workload import Workload

FUSABLE_OPS = {
    torch.ops.aten.cat.default, torch.ops.aten.full.default, torch.ops.aten.scalar_tensor.default,
    torch.ops.prims.iota.default, torch.ops.aten.constant_pad_nd.default, torch.ops.aten.embedding.default,
    torch.ops.aten.gather.default, torch.ops.aten.index.Tensor, torch.ops.aten.arange.start_step,
    torch.ops.aten.slice_scatter.default, torch.ops.aten.select_scatter.default,
}
"""Ops inductor lowers to pointwise loops (besides those tagged pointwise): fused like them."""
SCATTER_OPS = {
    torch.ops.aten.scatter.value, torch.ops.aten.scatter.src, torch.ops.aten.scatter_add.default,
    torch.ops.aten.index_put.default, torch.ops.aten._unsafe_masked_index_put_accumulate.default,
}
"""Ops whose output inductor initialises from their first input in the same kernel: that input is fused."""
DTYPE_CASTS = COPY_OPS | {torch.ops.prims.convert_element_type.default}
"""A cast of a weight is a weight copy (autocast's, decomposed to convert_element_type in the graph)."""


class CompiledTracer(StorageTracer):
    """The storage tracer for compiled graphs: off while dynamo and AOT autograd compile (their
    fake tensors are not the program's), on while the compiled graphs run. `counting` is cleared
    for a node inductor fuses: its output is tallied apart (`fused_*`), not counted."""

    def __init__(self) -> None:
        super().__init__()
        self.counting = True
        self.fused_live_bytes = 0
        self.fused_live: set[int] = set()
        self.unfused_peak_bytes = 0
        """The peak had every fused intermediate been materialised too (the eager replay)."""

    @classmethod
    def ignore_compile_internals(cls) -> bool:
        return True

    def _track(self, tensor: torch.Tensor, category: str, op: str = "") -> None:
        if self.counting:
            super()._track(tensor, category, op)
        else:
            self._tally_fused(tensor)
        self.unfused_peak_bytes = max(self.unfused_peak_bytes, self.current_bytes + self.fused_live_bytes)

    def _tally_fused(self, tensor: torch.Tensor) -> None:
        storage = tensor.untyped_storage()
        key = id(storage)
        if key in self.live or key in self.fused_live or storage.nbytes() == 0:
            return
        size = rounded(storage.nbytes())
        self.fused_live.add(key)
        self.fused_live_bytes += size
        weakref.finalize(storage, self._free_fused, key, size)

    def _free_fused(self, key: int, size: int) -> None:
        self.fused_live.discard(key)
        self.fused_live_bytes -= size

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func in DTYPE_CASTS and func not in COPY_OPS and args and isinstance(args[0], torch.Tensor):
            # Give the decomposed cast the rule COPY_OPS has: a cast of a weight is a weight copy.
            source = self.live.get(id(args[0].untyped_storage()))
            if source is not None and source in self.weight_record_ids:
                saved, self.category = self.category, "weights/autocast_copies"
                try:
                    return super().__torch_dispatch__(func, types, args, kwargs)
                finally:
                    self.category = saved
        return super().__torch_dispatch__(func, types, args, kwargs)


# Which graph nodes inductor materialises ---------------------------------------------------------
def _is_view(node: torch.fx.Node) -> bool:
    target = node.target
    return isinstance(target, torch._ops.OpOverload) and bool(target.is_view)


def _is_fusable(node: torch.fx.Node) -> bool:
    target = node.target
    if not isinstance(target, torch._ops.OpOverload):
        return False
    return torch.Tag.pointwise in target.tags or target in FUSABLE_OPS


def _is_reduction(node: torch.fx.Node) -> bool:
    target = node.target
    return isinstance(target, torch._ops.OpOverload) and torch.Tag.reduction in target.tags


def _readers(node: torch.fx.Node) -> list[torch.fx.Node]:
    """The nodes that read `node`'s storage, looking through views of it."""
    out = []
    for user in node.users:
        out += _readers(user) if _is_view(user) else [user]
    return out


def _inlines(reader: torch.fx.Node, node: torch.fx.Node) -> bool:
    """Whether inductor reads `node` inside `reader`'s kernel: pointwise ops and reductions inline
    their inputs, a scatter its first (the buffer it starts from)."""
    if reader.op != "call_function":
        return False
    if _is_fusable(reader) or _is_reduction(reader):
        return True
    return reader.target in SCATTER_OPS and _view_base(reader.args[0]) is node


def _view_base(node):
    while isinstance(node, torch.fx.Node) and _is_view(node):
        node = node.args[0]
    return node


def fused_nodes(graph: torch.fx.Graph) -> set[torch.fx.Node]:
    """Pointwise nodes whose output inductor keeps inside a kernel (every reader inlines it, none is
    the graph's output), and the views of them (which allocate nothing, but would look new)."""
    fused = set()
    for node in graph.nodes:
        if node.op != "call_function":
            continue
        if _is_view(node):
            if _view_base(node) in fused:
                fused.add(node)
            continue
        readers = _readers(node)
        if _is_fusable(node) and readers and all(_inlines(r, node) for r in readers):
            fused.add(node)
    return fused


# Categories inside compiled graphs ---------------------------------------------------------------
def _module_stack(node: torch.fx.Node, backward: bool) -> list[tuple]:
    stack = node.meta.get("fwd_nn_module_stack" if backward else "nn_module_stack") or {}
    return [entry for entry in stack.values() if isinstance(entry, tuple) and len(entry) == 2]


def _in_head(node: torch.fx.Node, backward: bool) -> bool:
    return any(str(name).endswith(("lm_head", "lm_head']")) for name, _type in _module_stack(node, backward))


def _in_decoder(node: torch.fx.Node, backward: bool, decoder_type: type) -> bool:
    return any(isinstance(kind, type) and issubclass(kind, decoder_type) for _name, kind in _module_stack(node, backward))


def node_categories(graph: torch.fx.Graph, backward: bool, decoder_type: type) -> dict[torch.fx.Node, str]:
    """Each node's category. In a graph that holds the head, every node outside the decoder (the
    head's, the loss's) makes logits. The decoder's nodes, and all of a graph without the head (the
    decoder alone, or its part after a graph break, whose root no module stack names), make
    activations in forward and temporaries in backward (a recomputed forward node: activations)."""
    nodes = [n for n in graph.nodes if n.op == "call_function"]
    has_head = any(_in_head(n, backward) for n in nodes)
    out = {}
    for node in nodes:
        if has_head and not _in_decoder(node, backward, decoder_type):
            out[node] = "logits"
        elif backward and node.meta.get("partitioner_tag") != "is_forward":
            out[node] = "temporaries"
        else:
            out[node] = "activations"
    return out


class LabellingInterpreter(torch.fx.Interpreter):
    """Runs a partitioned graph node by node (as the `aot_eager` backends do, freeing each value
    after its last use), labelling each node's allocations and leaving fused ones uncounted."""

    def __init__(self, module, tracer: CompiledTracer, categories: dict, fused: set):
        super().__init__(module)
        self.tracer, self.categories, self.fused = tracer, categories, fused

    def run_node(self, n):
        tracer = self.tracer
        saved = tracer.category, tracer.counting
        tracer.category = self.categories.get(n, saved[0])
        tracer.counting = n not in self.fused
        try:
            return super().run_node(n)
        finally:
            tracer.category, tracer.counting = saved


def _graph_compiler(tracer: CompiledTracer, decoder_type: type, backward: bool):
    def compile_graph(gm: torch.fx.GraphModule, example_inputs):
        categories = node_categories(gm.graph, backward, decoder_type)
        fused = fused_nodes(gm.graph)

        def run(args):
            return LabellingInterpreter(gm, tracer, categories, fused).boxed_run(args)

        run._boxed_call = True
        return run

    return compile_graph


def labelling_backend(tracer: CompiledTracer, decoder_type: type):
    """`aot_eager_decomp_partition` with graphs that run under the tracer's labels."""
    from torch._dynamo.backends.common import aot_autograd
    from torch._functorch import config as functorch_config
    from torch._functorch.partitioners import min_cut_rematerialization_partition

    backend = aot_autograd(
        fw_compiler=_graph_compiler(tracer, decoder_type, backward=False),
        bw_compiler=_graph_compiler(tracer, decoder_type, backward=True),
        decompositions=lambda: import_module("torch._inductor.compile_fx").select_decomp_table(),
        partition_fn=functools.partial(min_cut_rematerialization_partition, compiler="inductor"))

    def compile_fn(gm, example_inputs, **kwargs):
        with functorch_config.patch({"unlift_effect_tokens": True}):
            return backend(gm, example_inputs)

    return compile_fn


# Applying compile ---------------------------------------------------------------------------------
def _unwrapped(model):
    return model.get_base_model() if hasattr(model, "get_base_model") else model


def compile_model(model, workload: Workload, tracer: CompiledTracer) -> None:
    """Compile in place what a user compiles: the whole model's forward (the head and the loss
    with it: `torch.compile(model)`, the Trainer's `torch_compile=True`); with the chunked loss the
    decoder's, the head and loss running per chunk outside it. Compiling `forward` keeps the
    module's own hooks outside the graph; the decoder's mark where the logits start."""
    torch._dynamo.reset()  # a fresh model: no guard of an earlier trace's may match, none may count
    _register_rng_rules()
    decoder = _unwrapped(model).model
    backend = labelling_backend(tracer, type(decoder))
    # Static shapes, as a step's first compilation has them: dynamo's profile-guided automatic dynamic
    # shapes would otherwise remember earlier traces' sizes (across processes) and change the graphs.
    if workload.loss == "chunked":
        decoder.forward = torch.compile(decoder.forward, backend=backend, dynamic=False)
        _mark_logits(decoder, tracer)  # (hooks of a module called inside a compiled graph would break it)
    else:
        model.forward = torch.compile(model.forward, backend=backend, dynamic=False)


def release_compile_cycles() -> None:
    """Free what compiling pinned, once the step that compiled is over (the trace's warmup step).

    While dynamo traces the model, each exception raised in traced code and bubbled out of an inlined
    function (transformers' `getattr(config, "is_causal", True)` on a config without it, and a dozen
    alike) leaves a reference cycle: the exception, its traceback, dynamo's `exception_handler` frame,
    the closure cell holding the exception. Through `f_back` the cycle keeps every frame up to
    `torch.compile`'s `compile_wrapper`, whose local `result` is that call's output: the logits, the
    returned K/V cache and, through the call's arguments, the input ids. Dynamo collects generations 0
    and 1 after compiling (`run_gc_after_compile`); a cycle that an automatic collection has already
    moved to generation 2 waits for Python's next full collection, which in a process holding many
    objects (one that has run other traces) can come after the next step's peak. Whether it moves
    depends on Python's allocation counters, so on what ran before: the same workload traced after
    others kept one step's logits and cache alive through the next step (Llama-2-7B, pure bf16,
    2 x 4096: +756 MiB, 8.4 %). A full collection here makes the measured step independent of that.
    On a GPU the first compiled step's output is pinned the same way, until Python collects it;
    the trace sizes the steady state, after that."""
    import gc

    gc.collect()


def _register_rng_rules() -> None:
    """Checkpointed regions run their random ops through AOT autograd's rng operators, which need a
    rule per dispatch mode: run the op under the tracer, so its output is counted."""
    from torch._prims.rng_prims import run_and_save_rng_state, run_with_rng_state

    if CompiledTracer in run_and_save_rng_state.python_key_table:
        return

    @run_and_save_rng_state.py_impl(CompiledTracer)
    def run_and_save(mode, op, *args, **kwargs):
        with mode:
            return torch.get_rng_state(), op(*args, **kwargs)

    @run_with_rng_state.py_impl(CompiledTracer)
    def run_with(mode, rng_state, op, *args, **kwargs):
        with mode:
            return op(*args, **kwargs)


def _mark_logits(decoder, tracer: CompiledTracer) -> None:
    """Outside a compiled graph (the chunked head and loss), allocations after the decoder are
    logits until backward reaches the decoder's output, as module hooks label them in eager."""

    def enter(module, args):
        tracer.category = "activations"

    def leave(module, args, output):
        tracer.category = "logits"
        hidden = output.last_hidden_state if hasattr(output, "last_hidden_state") else output
        if isinstance(hidden, torch.Tensor) and hidden.requires_grad:
            hidden.register_hook(lambda grad: setattr(tracer, "category", "temporaries"))

    decoder.register_forward_pre_hook(enter)
    decoder.register_forward_hook(leave)


def compile_notes(tracer: CompiledTracer) -> list[str]:
    from llamem.units import format_bytes

    extra = tracer.unfused_peak_bytes - tracer.peak_bytes
    return [("compiled with AOT autograd and inductor's partitioner (aot_eager_decomp_partition); "
             "categories by the graph nodes' module stacks (saved tensors count as activations)"),
            (f"pointwise chains counted as inductor fuses them; counting every link as the eager replay "
             f"of the partitioned graphs would raise the peak by {format_bytes(max(extra, 0))}")]

