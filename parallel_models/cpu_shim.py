"""Run megatron-core on a machine without CUDA (gloo ranks on the CPU).

megatron-core assumes a CUDA current device in a few places: ``torch.cuda.current_device()`` used as
a ``device=`` argument (sequence-parallel gathers, pipeline p2p buffers), ``torch.cuda.synchronize``,
``torch.cuda.current_stream`` and the CUDA RNG tracker. This module is the one place that redirects
those to the CPU. ``apply()`` is idempotent and does nothing when CUDA is available, so GPU runs
never see it. ``cuda_to_cpu()`` is a context that also rewrites ``device="cuda"`` / ``.cuda()``
made inside megatron-core code (schedules, DDP buffers, optimizers) to the CPU.
"""

from __future__ import annotations

import contextlib
import threading

import torch
from torch.overrides import TorchFunctionMode

_applied = False
_lock = threading.Lock()


def needed() -> bool:
    return not torch.cuda.is_available()


class _DummyStream:
    """Stands in for a CUDA stream: waits and syncs are no-ops on the CPU."""

    def __init__(self, *args, **kwargs):
        pass

    def wait_stream(self, *args, **kwargs):
        return None

    def wait_event(self, *args, **kwargs):
        return None

    def synchronize(self):
        return None

    def record_event(self, *args, **kwargs):
        return self  # the "event": its synchronize() is a no-op too

    def query(self):
        return True

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False


def apply() -> bool:
    """Patch torch.cuda entry points that megatron-core calls; returns True if patched."""
    global _applied
    if not needed():
        return False
    with _lock:
        if _applied:
            return True
        torch.cuda.current_device = lambda: torch.device("cpu")  # type: ignore[assignment]
        torch.cuda.synchronize = lambda *a, **k: None  # type: ignore[assignment]
        torch.cuda.current_stream = lambda *a, **k: _DummyStream()  # type: ignore[assignment]
        torch.cuda.default_stream = lambda *a, **k: _DummyStream()  # type: ignore[assignment]
        torch.cuda.stream = lambda *a, **k: contextlib.nullcontext()  # type: ignore[assignment]
        # megatron's all-to-all MoE token dispatcher creates a side stream for its
        # device-to-host copies of the token counts
        torch.cuda.Stream = _DummyStream  # type: ignore[assignment,misc]  (a class: annotations use it)
        # megatron's CUDA RNG tracker forks CUDA generator states; on the CPU the CPU generator
        # plays that role (deterministic per rank once seeded).
        torch.cuda.get_rng_state = lambda *a, **k: torch.get_rng_state()  # type: ignore[assignment]
        torch.cuda.set_rng_state = lambda state, *a, **k: torch.set_rng_state(state)  # type: ignore
        torch.cuda.manual_seed = lambda seed: None  # type: ignore[assignment]
        # megatron's RNG tracker reads/writes CUDA generator states through its own helpers
        import megatron.core.tensor_parallel.random as mrandom

        mrandom._get_cuda_rng_state = lambda *a, **k: torch.get_rng_state()
        # megatron's advice to set CUDA_DEVICE_MAX_CONNECTIONS=1 (for sequence parallelism and
        # async grad all-reduce) is about CUDA streams: on the CPU there is nothing to set
        from megatron.core.tensor_parallel.layers import \
            linear_with_grad_accumulation_and_async_allreduce as tp_linear

        tp_linear.warned = True
        mrandom._set_cuda_rng_state = lambda state, *a, **k: torch.set_rng_state(state)
        _patch_moe_token_counts()
        _patch_uneven_first_dim_collectives()
        _applied = True
        return True


def _patch_moe_token_counts() -> None:
    """megatron's all-to-all MoE dispatcher turns its split sizes into numpy arrays while
    moving them off the GPU (``maybe_move_tensor_to_cpu(as_numpy=True)``); tensors already on
    the CPU stay tensors, which ``all_to_all_single`` rejects as split sizes. Convert those too."""
    from megatron.core.transformer.moe import moe_utils, token_dispatcher

    original = moe_utils.maybe_move_tensor_to_cpu

    def move(tensor, as_numpy=False, record_stream=False):
        if as_numpy and torch.is_tensor(tensor) and not tensor.is_cuda:
            return tensor.numpy()
        return original(tensor, as_numpy=as_numpy, record_stream=record_stream)

    token_dispatcher.maybe_move_tensor_to_cpu = move


def _patch_uneven_first_dim_collectives() -> None:
    """gloo's all_gather needs equal sizes and it has no list reduce_scatter, but megatron's MoE
    dispatcher (TP > 1) gathers / reduce-scatters token blocks of uneven sizes over the expert
    TP group (``_gather_along_first_dim(output_split_sizes=...)`` and
    ``_reduce_scatter_along_first_dim(input_split_sizes=...)``). On the CPU these run as an
    all-gather of blocks padded to the largest one, and as an all-reduce of the whole tensor
    that keeps this rank's block (same sums)."""
    import torch.distributed as dist
    from megatron.core.tensor_parallel import mappings

    gather, reduce_scatter = mappings._gather_along_first_dim, mappings._reduce_scatter_along_first_dim

    def gather_uneven(input_, group, output_split_sizes=None, use_global_buffer=False):
        if output_split_sizes is None or group.size() == 1:
            return gather(input_, group, output_split_sizes, use_global_buffer)
        sizes = [int(n) for n in output_split_sizes]
        longest = max(sizes)
        padded = input_.new_zeros((longest, *input_.shape[1:]))
        padded[: input_.shape[0]] = input_
        blocks = [torch.empty_like(padded) for _ in sizes]
        dist.all_gather(blocks, padded.contiguous(), group=group)
        return torch.cat([b[:n] for b, n in zip(blocks, sizes)], dim=0)

    def reduce_scatter_uneven(input_, group, input_split_sizes=None, use_global_buffer=False):
        if input_split_sizes is None or group.size() == 1:
            return reduce_scatter(input_, group, input_split_sizes, use_global_buffer)
        total = input_.contiguous().clone()
        dist.all_reduce(total, group=group)
        sizes = [int(n) for n in input_split_sizes]
        start = sum(sizes[: group.rank()])
        return total[start: start + sizes[group.rank()]].clone()

    mappings._gather_along_first_dim = gather_uneven
    mappings._reduce_scatter_along_first_dim = reduce_scatter_uneven


def _to_cpu_device(device):
    if device is None:
        return None
    if isinstance(device, int):
        return torch.device("cpu")
    dev = torch.device(device)
    return torch.device("cpu") if dev.type == "cuda" else device


class _CudaToCpu(TorchFunctionMode):
    """Rewrites tensor factories and moves that name CUDA so megatron code runs on the CPU."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = dict(kwargs or {})
        if func is torch.Tensor.cuda:
            return args[0]
        if func is torch.Tensor.type and len(args) == 1 and not kwargs:
            # megatron's optimizers dispatch on type strings such as 'torch.cuda.FloatTensor'
            name = func(*args)
            return name.replace("torch.", "torch.cuda.", 1) if ".cuda." not in name else name
        if "device" in kwargs:
            kwargs["device"] = _to_cpu_device(kwargs["device"])
        if func in (torch.Tensor.to,) and len(args) > 1 and not isinstance(args[1], torch.Tensor):
            if isinstance(args[1], (str, int, torch.device)) and not isinstance(args[1], bool):
                args = (args[0], _to_cpu_device(args[1]), *args[2:])
        if kwargs.get("pin_memory"):
            kwargs["pin_memory"] = False
        return func(*args, **kwargs)


@contextlib.contextmanager
def cuda_to_cpu():
    """Context in which ``device='cuda'`` and ``.cuda()`` mean the CPU (no-op with CUDA)."""
    if not needed():
        yield
        return
    apply()
    with _CudaToCpu():
        yield
