"""STAND-IN for ``torch.npu.NPUGraph`` / ``torch.npu.graph`` in CPU tests: capture records a step once, replay runs
the recording, so every Python value the step read while it was captured stays frozen, as on an Ascend device.

What it models (torch_npu's aclgraph, as stock sglang's ``NPUCudaGraphBackend`` drives it):

- **capture** traces the step with ``make_fx(tracing_mode="real")``: tensor ops become graph nodes, and whatever the
  step computed in Python (lists, ``int``\\ s, branches, shapes) is a constant of the recording. The fused attention op
  (the STAND-IN ``npu_fused_infer_attention_score`` of ``tests/fake_torch_npu.py``, paged form) is recorded as one
  node, ``fake_npu::fia_paged``, with its ``actual_seq_lengths_kv`` host list frozen in it;
- **update** (``NPUGraph.update(cpu_update_input=[...])``): one dict is applied to every recorded fused-attention
  call; a list of several is applied one per record, in capture order (any other count is refused);
- **replay** runs the recording on whatever the tensors it reads hold now (the static buffers, updated in place).

It refuses what would be wrong on the device, naming it:

- a host read during capture (``.item()``, ``.tolist()``, ``bool(tensor)``, ``nonzero``, ...): :class:`HostRead`;
- a tensor the recording reads that was made before capture and is neither a parameter, a static buffer nor a pool
  tensor (the caller lists those): on the device its address is baked into the graph while something else owns it;
- a tensor allocated during capture that outlives it outside the recording (a workspace kept in Python state): on
  the device its memory belongs to the graph's private pool, and a later eager step would write into the graph.
"""

from __future__ import annotations

import contextlib
import gc
import weakref
from typing import Callable, Iterable, Optional

import torch
from torch.fx.experimental.proxy_tensor import make_fx
from torch.utils._python_dispatch import TorchDispatchMode, _disable_current_modes

from fake_torch_npu import _npu_fused_infer_attention_score

UPDATABLE = ("actual_seq_lengths_kv",)
# Position of each updatable argument in the recorded op's schema (below).
_ARGUMENT_INDEX = {"actual_seq_lengths_kv": 5}
# aten ops that read a device value on the host.
_HOST_READ_OPS = {"_local_scalar_dense", "equal", "nonzero", "_unique2", "masked_select", "is_nonzero"}
# aten factory ops: a tensor they make during capture comes from the graph's pool.
_FACTORY_OPS = {"empty", "empty_strided", "zeros", "ones", "full", "new_empty", "new_zeros", "new_full", "arange"}


class HostRead(RuntimeError):
    """A captured step read a device value on the host."""


class NotCaptureSafe(RuntimeError):
    """A captured step reads or keeps a tensor it may not (see the module doc)."""


@torch.library.custom_op("fake_npu::fia_paged", mutates_args=())
def fia_paged(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    block_table: torch.Tensor,
    block_size: int,
    actual_seq_lengths_kv: list[int],
    atten_mask: Optional[torch.Tensor],
    num_heads: int,
    num_key_value_heads: int,
    scale: float,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The paged FIA stand-in as one op, so a recording holds each call as one node with its host lengths."""
    out, lse = _npu_fused_infer_attention_score(
        query,
        key,
        value,
        block_table=block_table,
        block_size=block_size,
        actual_seq_lengths_kv=actual_seq_lengths_kv,
        atten_mask=atten_mask,
        num_heads=num_heads,
        num_key_value_heads=num_key_value_heads,
        scale=scale,
        input_layout="BNSD",
        softmax_lse_flag=True,
    )
    return out, lse.clone()


def recordable_fia(query, key, value, *, block_table=None, block_size=0, actual_seq_lengths_kv=None, **kwargs):
    """The paged form (what a captured decode calls: K/V read in place) routed through the recordable op; any other
    call (an eager step's gathered attention) goes to the plain stand-in."""
    if block_table is None:
        return _npu_fused_infer_attention_score(
            query, key, value, actual_seq_lengths_kv=actual_seq_lengths_kv, **kwargs
        )
    if kwargs.pop("input_layout", "BNSD") != "BNSD" or not kwargs.pop("softmax_lse_flag", True):
        raise NotImplementedError("fake NPU graph: only the paged BNSD fused attention call with its LSE is recordable")
    unexpected = set(kwargs) - {"atten_mask", "num_heads", "num_key_value_heads", "scale"}
    if unexpected:
        raise NotImplementedError(f"fake NPU graph: FIA arguments {sorted(unexpected)} are not recordable")
    return fia_paged(
        query,
        key,
        value,
        block_table,
        block_size,
        list(actual_seq_lengths_kv),
        kwargs.get("atten_mask"),
        kwargs["num_heads"],
        kwargs["num_key_value_heads"],
        kwargs["scale"],
    )


@contextlib.contextmanager
def graph_mode(torch_npu):
    """The stand-in torch_npu's paged fused attention routed through the recordable op (warm-ups, capture, replays)."""
    original = torch_npu.npu_fused_infer_attention_score
    torch_npu.npu_fused_infer_attention_score = recordable_fia
    try:
        yield
    finally:
        torch_npu.npu_fused_infer_attention_score = original


class _CaptureWatch(TorchDispatchMode):
    """During capture: refuse host reads; keep a weak reference to every tensor a factory op makes."""

    def __init__(self):
        super().__init__()
        self.allocated: list[weakref.ref] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        name = func.overloadpacket.__name__
        if name in _HOST_READ_OPS:
            raise HostRead(f"aten.{name} read a device value on the host during capture")
        result = func(*args, **(kwargs or {}))
        if name in _FACTORY_OPS and isinstance(result, torch.Tensor):
            self.allocated.append(weakref.ref(result))
        return result

    def __enter__(self):
        def refused_tolist(tensor):
            raise HostRead("Tensor.tolist() read a device value on the host during capture")

        torch.Tensor.tolist = refused_tolist  # shadows the C method until __exit__
        return super().__enter__()

    def __exit__(self, *exc):
        del torch.Tensor.tolist
        return super().__exit__(*exc)


def _storages(tensors: Iterable[torch.Tensor]) -> set[int]:
    return {t.untyped_storage().data_ptr() for t in tensors}


class FakeNPUGraph:
    """One recorded step (``torch.npu.NPUGraph``): :meth:`capture`, then :meth:`update` and :meth:`replay`."""

    def __init__(self):
        self.recording: torch.fx.GraphModule | None = None

    def capture(self, step: Callable[[], object], *, may_read: Iterable[torch.Tensor]):
        """Record ``step`` (a closure over its static inputs, as stock's captured forward is). ``may_read``: the
        parameters, static buffers and pool tensors the recording may read. Returns the capture run's output."""
        watch = _CaptureWatch()
        with watch:
            recording = make_fx(step, tracing_mode="real")()
        with _disable_current_modes():
            output = recording()
        allowed = _storages(may_read)
        for node in recording.graph.nodes:
            if node.op == "get_attr":
                tensor = getattr(recording, node.target)
                if tensor.untyped_storage().data_ptr() not in allowed:
                    raise NotCaptureSafe(
                        f"the recording reads a {tuple(tensor.shape)} {tensor.dtype} tensor made before capture that "
                        "is no parameter, static buffer or pool tensor"
                    )
        kept = _storages(_flat_tensors(output))
        gc.collect()
        for ref in watch.allocated:
            tensor = ref()
            if tensor is not None and tensor.untyped_storage().data_ptr() not in kept:
                raise NotCaptureSafe(
                    f"a {tuple(tensor.shape)} {tensor.dtype} tensor allocated during capture outlives it (on the "
                    "device it belongs to the graph's pool)"
                )
        self.recording = recording
        return output

    def fia_records(self) -> list[torch.fx.Node]:
        return [
            node
            for node in self.recording.graph.nodes
            if node.op == "call_function" and node.target is torch.ops.fake_npu.fia_paged.default
        ]

    def update(self, cpu_update_input: list[dict]) -> None:
        """torch_npu's rule: one dict for every recorded call, or one dict per recorded call in capture order."""
        records = self.fia_records()
        if len(cpu_update_input) == 1:
            updates = cpu_update_input * len(records)
        elif len(cpu_update_input) == len(records):
            updates = cpu_update_input
        else:
            raise ValueError(f"NPUGraph.update: {len(cpu_update_input)} dicts for {len(records)} recorded calls")
        for node, update in zip(records, updates):
            arguments = list(node.args)
            for name, value in update.items():
                if name not in UPDATABLE:
                    raise ValueError(f"NPUGraph.update: {name!r} is not an updatable argument")
                arguments[_ARGUMENT_INDEX[name]] = list(value)
            node.args = tuple(arguments)
        self.recording.recompile()

    def replay(self):
        return self.recording()


def _flat_tensors(output) -> list[torch.Tensor]:
    if isinstance(output, torch.Tensor):
        return [output]
    if isinstance(output, (list, tuple)):
        return [t for item in output for t in _flat_tensors(item)]
    return []
