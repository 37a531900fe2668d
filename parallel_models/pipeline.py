"""Pipeline parallelism: layer assignment, per-rank model chunks, and running batches through
megatron-core's schedules (1F1B, interleaved 1F1B with virtual chunks).

Virtual stage ``v = chunk * pp_size + pp_rank`` owns the ``v``-th run of consecutive layers,
as megatron-core's interleaved schedule expects: with PP=2, VPP=2 and 8 layers, rank 0 holds
layers 0-1 and 4-5, rank 1 holds 2-3 and 6-7.

Stages and groups are those of the chunks' ``ParallelLayout``. megatron-core's schedules (and its
DDP's grad finalization) read its own globals, i.e. the training layout: a model built in another
layout runs through them only without pipeline stages and, to train, not at all.
"""

from __future__ import annotations

import dataclasses
import functools
import inspect
from typing import Any, Callable

import torch
import torch.distributed as dist
from megatron.core.pipeline_parallel import get_forward_backward_func

from parallel_models import cpu_shim
from parallel_models.config import ConfigError
from parallel_models.distributed import layout_or_training, training_layout
from parallel_models.parallel_layout import layout_of


@dataclasses.dataclass(frozen=True)
class Stage:
    pp_rank: int
    vpp_chunk: int
    layer_ids: tuple[int, ...]
    pre_process: bool   # holds the embedding
    post_process: bool  # holds the final norm and the head


def pipeline_layout(num_layers: int, pp_size: int, vpp_size: int | None = None,
                    layers_per_stage: list[int] | None = None) -> list[list[Stage]]:
    """Which layers each (pp_rank, chunk) holds: ``layout[pp_rank][chunk]``.

    ``layers_per_stage`` (one count per virtual stage, in virtual-stage order) overrides the even
    split; without it ``num_layers`` must divide evenly.
    """
    vpp = vpp_size or 1
    n_stages = pp_size * vpp
    if layers_per_stage is None:
        if num_layers % n_stages:
            raise ConfigError(
                f"num_layers ({num_layers}) is not divisible by pipeline_parallel_size ({pp_size})"
                f" x virtual_pipeline_parallel_size ({vpp}); pass layers_per_stage=[...] with "
                f"{n_stages} counts to split unevenly")
        layers_per_stage = [num_layers // n_stages] * n_stages
    layers_per_stage = list(layers_per_stage)
    if len(layers_per_stage) != n_stages or sum(layers_per_stage) != num_layers or \
            min(layers_per_stage) < 0:
        raise ConfigError(f"layers_per_stage={layers_per_stage} must have {n_stages} non-negative "
                          f"counts (PP {pp_size} x VPP {vpp}) summing to num_layers ({num_layers})")
    starts = [sum(layers_per_stage[:v]) for v in range(n_stages)]
    layout = []
    for rank in range(pp_size):
        row = []
        for chunk in range(vpp):
            v = chunk * pp_size + rank
            row.append(Stage(rank, chunk, tuple(range(starts[v], starts[v] + layers_per_stage[v])),
                             pre_process=v == 0, post_process=v == n_stages - 1))
        layout.append(row)
    return layout


def format_pipeline_layout(num_layers: int, pp_size: int, vpp_size: int | None = None,
                           layers_per_stage: list[int] | None = None) -> str:
    """A readable table of the layout (for logs and ``--help`` style output)."""
    lines = []
    for row in pipeline_layout(num_layers, pp_size, vpp_size, layers_per_stage):
        for st in row:
            extra = ("embedding " if st.pre_process else "") + ("norm+head" if st.post_process else "")
            layers = f"{st.layer_ids[0]}-{st.layer_ids[-1]}" if st.layer_ids else "none"
            lines.append(f"pp_rank {st.pp_rank} chunk {st.vpp_chunk}: layers {layers} {extra}".rstrip())
    return "\n".join(lines)


def stage_of_this_rank(num_layers: int, vpp_chunk: int | None = None,
                       layers_per_stage: list[int] | None = None, layout=None) -> Stage:
    """This rank's stage (chunk ``vpp_chunk``) in ``layout`` (default: the training layout)."""
    layout = layout_or_training(layout)
    pp = layout.pipeline_parallel_size
    vpp = layout.virtual_pipeline_parallel_size or 1
    chunk = 0 if vpp_chunk is None else vpp_chunk
    if not 0 <= chunk < vpp:
        raise ConfigError(f"vpp_chunk={vpp_chunk} out of range for virtual_pipeline_parallel_size {vpp}")
    if vpp > 1 and vpp_chunk is None:
        raise ConfigError("virtual pipeline parallel is on: build each chunk with vpp_chunk=i, or "
                          "use parallel_models.pipeline.build_pipeline_chunks")
    return pipeline_layout(num_layers, pp, vpp, layers_per_stage)[
        layout.pipeline_parallel_rank][chunk]


def build_pipeline_chunks(cls, path: str, **kwargs) -> list[torch.nn.Module]:
    """All model chunks of this rank (one per virtual stage) loaded from ``path``.

    ``cls`` is a PP variant class, e.g. ``LlamaForCausalLMRmPadPP``.
    """
    vpp = layout_or_training(kwargs.get("layout")).virtual_pipeline_parallel_size or 1
    return [cls.from_pretrained(path, vpp_chunk=c if vpp > 1 else None, **kwargs) for c in range(vpp)]


# ---- microbatch keys (README: "Pipeline microbatch keys") -------------------------------------
# given to the model chunk where its forward takes them (and to the loss/output function)
MODEL_INPUT_KEYS = ("input_ids", "cu_seqlens", "position_ids", "max_seqlen", "attention_mask",
                    "full_vocab")
# given only to the loss/output function: the per-sample tensors of a PPO batch
# (parallel_models.rl.roles.model_roles) that the package's losses and output functions read
LOSS_DATA_KEYS = ("sequences", "prompt_lengths", "response_mask", "old_log_probs",
                  "ref_log_probs", "advantages", "returns", "values", "rollout_log_probs",
                  "rollout_is_weights")


def check_microbatch_keys(microbatches, extra_keys=()) -> None:
    """Every microbatch is a dict whose keys are all accepted: :data:`MODEL_INPUT_KEYS`,
    :data:`LOSS_DATA_KEYS` or ``extra_keys`` (data a caller's own loss function reads). An
    unknown key would otherwise be dropped without a word (a misspelled ``full_vocab`` at TP>1
    returns this rank's vocab slice), so it raises a ``ValueError`` naming the accepted keys."""
    import difflib

    accepted = set(MODEL_INPUT_KEYS) | set(LOSS_DATA_KEYS) | set(extra_keys)
    for i, mb in enumerate(microbatches):
        if not isinstance(mb, dict):
            raise TypeError(f"microbatch {i} is a {type(mb).__name__}; expected a dict of "
                            "model inputs and loss data")
        unknown = sorted(k for k in mb if k not in accepted)
        if unknown:
            hints = [f"{k!r} (did you mean {close[0]!r}?)" if (close := difflib.get_close_matches(
                str(k), sorted(accepted), n=1)) else repr(k) for k in unknown]
            raise ValueError(
                f"microbatch {i} has unknown key(s) {', '.join(hints)}. Accepted keys: model "
                f"inputs {', '.join(MODEL_INPUT_KEYS)} (given to the model where its forward "
                f"takes them); loss data {', '.join(LOSS_DATA_KEYS)}"
                + (f", {', '.join(sorted(map(str, extra_keys)))}" if extra_keys else "")
                + " (given to the loss/output function only); pass extra_keys=(...) to "
                "forward_backward/forward_only for other data your function reads")


# ---- running batches through the schedules ---------------------------------------------------


class _ScheduleView(torch.nn.Module):
    """Lets megatron's schedules find the megatron config of an unwrapped chunk (they read
    ``.config``, which on our models is the HF-derived ModelConfig)."""

    def __init__(self, module):
        super().__init__()
        self.module = module
        self.config = module.mp_config

    def forward(self, *args, **kwargs):
        return self.module(*args, **kwargs)


def _schedule_chunks(chunks):
    return [c if hasattr(c, "ddp_config") else _ScheduleView(c) for c in chunks]


def _unwrap(model):
    while not hasattr(model, "head_kind"):
        model = model.module
    return model


def _forward_step(data_iterator, model, *, fn, with_loss: bool):
    batch = next(data_iterator)
    inner = _unwrap(model)
    params = inspect.signature(inner.forward).parameters
    inputs = {k: v for k, v in batch.items() if k in MODEL_INPUT_KEYS and k in params}
    output = model(**inputs)
    if not inner.post_process:
        return output, None

    def loss_func(out):
        if with_loss:
            loss, num_tokens, metrics = fn(out, batch)
            return loss, num_tokens, metrics
        result = fn(out, batch)
        head = getattr(out, "hidden", None)  # under CP: this rank's hidden (no logits)
        if head is None:
            head = out.logits if hasattr(out, "logits") else out.values
        zero = head.sum() * 0.0
        return zero, {"output": result}

    return output, loss_func


def _run(chunks, microbatches, fn, forward_only: bool, with_loss: bool, extra_keys=()):
    if not microbatches:
        raise ValueError("no microbatches")
    check_microbatch_keys(microbatches, extra_keys)
    chunks = list(chunks) if isinstance(chunks, (list, tuple)) else [chunks]
    sched = _schedule_chunks(chunks)
    config = sched[0].config
    config.calculate_per_token_loss = with_loss  # global token-mean loss (see forward_backward)
    if with_loss and not forward_only:
        from megatron.core.distributed import finalize_model_grads

        ddp = all(hasattr(c, "ddp_config") for c in chunks)
        config.finalize_model_grads_func = finalize_model_grads if ddp else _finalize_plain
    else:
        config.finalize_model_grads_func = None
    n_tokens = max(_token_count(mb) for mb in microbatches)
    models = [_unwrap(c) for c in chunks]
    layout = models[0].parallel_layout
    if layout is not training_layout() and (layout.pipeline_parallel_size > 1
                                            or not forward_only):
        raise ValueError(f"a model built in {layout} runs through megatron-core's schedules, "
                         "which use the training layout's groups: only forward-only without "
                         "pipeline stages")
    interleaved = len(chunks) > 1
    if interleaved:
        # megatron's interleaved schedule mixes forward and backward p2p in one call, which
        # does not work with per-microbatch shapes: pad every microbatch to one token count
        tp = models[0].tp if models[0].sequence_parallel else 1
        n_tokens = -(-n_tokens // tp) * tp
        for m in models:
            m.pad_tokens_to = n_tokens
        config.variable_seq_lengths = False
    # rows the stages' messages carry beyond the tokens (the MoE load-balancing totals while
    # router logits are recorded), per TP rank: the fixed shape of the interleaved schedule
    extra = max(getattr(m, "pipeline_extra_rows", lambda: 0)() for m in models)
    if extra:
        extra *= models[0].tp if models[0].sequence_parallel else 1
    seq_length = n_tokens + extra
    iterators = [iter(microbatches) for _ in chunks]
    step = functools.partial(_forward_step, fn=fn, with_loss=with_loss)
    try:
        with cpu_shim.cuda_to_cpu():
            results = get_forward_backward_func()(
                forward_step_func=step,
                data_iterator=iterators if interleaved else iterators[0],
                model=sched if interleaved else sched[0],
                num_microbatches=len(microbatches),
                seq_length=seq_length,
                micro_batch_size=1,
                forward_only=forward_only,
            )
    finally:
        for m in models:
            m.pad_tokens_to = None
        config.variable_seq_lengths = True
    return results


def _token_count(mb: dict) -> int:
    if "attention_mask" in mb and mb["attention_mask"] is not None:
        return int(mb["attention_mask"].sum())
    return int(mb["input_ids"].numel())


def _finalize_plain(model, num_tokens=None, *args, **kwargs):
    """Without megatron DDP: sum tied-embedding and sequence-parallel grads, scale by tokens."""
    from parallel_models.utils.grads import allreduce_sequence_parallel_grads, allreduce_tied_embedding_grads

    chunks = [_unwrap(m) for m in model]
    for c in chunks:
        allreduce_sequence_parallel_grads(c)
    allreduce_tied_embedding_grads(chunks)
    layout = chunks[0].parallel_layout
    cp = layout.context_parallel_size
    if cp > 1:  # each CP rank holds CP x its tokens' share of one gradient (context_parallel.py)
        from parallel_models.context_parallel import expert_grads_need_cp_reduction

        experts_too = expert_grads_need_cp_reduction(layout)
        for c in chunks:
            for p in c.parameters():  # (routed experts: megatron marks them allreduce=False)
                if p.grad is not None and (experts_too or getattr(p, "allreduce", True)):
                    dist.all_reduce(p.grad, group=layout.cp_group)
    if num_tokens is not None:
        dist.broadcast(num_tokens, src=layout.pipeline_last_rank, group=layout.pp_group)
        dist.all_reduce(num_tokens, group=layout.dp_group)
        scale = 1.0 / max(int(num_tokens) * cp, 1)  # every CP rank counted the same tokens
        for c in chunks:
            for p in c.parameters():
                if p.grad is not None:
                    p.grad.mul_(scale)


def forward_backward(chunks, microbatches: list[dict], loss_fn: Callable, *,
                     forward_only: bool = False, extra_keys=()) -> list[dict]:
    """Forward and backward of a batch split into microbatches, through all pipeline stages.

    ``loss_fn(output, microbatch) -> (loss_sum, num_tokens, metrics)`` runs on the last stage;
    gradients end up as those of ``sum(loss_sum) / sum(num_tokens)`` over the whole batch (and
    data-parallel replicas), i.e. a global token mean. Returns the per-microbatch ``metrics``,
    broadcast to every pipeline stage. Microbatch keys: see :func:`check_microbatch_keys`
    (``extra_keys``: more data keys ``loss_fn`` reads).
    """
    results = _run(chunks, microbatches, loss_fn, forward_only, with_loss=True,
                   extra_keys=extra_keys)
    layout = layout_of(chunks)
    return broadcast_from_last_stage(results if layout.is_pipeline_last_stage() else None, layout)


def forward_only(chunks, microbatches: list[dict], output_fn: Callable | None = None, *,
                 extra_keys=()) -> list[Any]:
    """Run microbatches forward through all stages; returns ``output_fn(output, microbatch)``
    (default: the logits or values) per microbatch, on every rank of the pipeline group.
    Microbatch keys: see :func:`check_microbatch_keys` (``extra_keys``: more data keys
    ``output_fn`` reads)."""
    fn = output_fn or (lambda out, mb: out.logits if hasattr(out, "logits") else out.values)
    with torch.no_grad():
        results = _run(chunks, microbatches, fn, forward_only=True, with_loss=False,
                       extra_keys=extra_keys)
    layout = layout_of(chunks)
    local = [r["output"] for r in results] if layout.is_pipeline_last_stage() else None
    return broadcast_from_last_stage(local, layout)


def broadcast_from_last_stage(obj, layout=None):
    """Send a (nested list/dict of) tensors from the last pipeline stage to the whole PP group
    (of ``layout``, default the training layout)."""
    layout = layout_or_training(layout)
    if layout.pipeline_parallel_size == 1:
        return obj
    group = layout.pp_group
    src = layout.pipeline_last_rank
    device = torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else \
        torch.device("cpu")
    leaves, spec = [], None
    if layout.is_pipeline_last_stage():
        flat, spec = torch.utils._pytree.tree_flatten(obj)
        leaves = flat
        meta = [(tuple(t.shape), t.dtype) if torch.is_tensor(t) else ("obj", t) for t in flat]
        payload = [spec, meta]
    else:
        payload = [None, None]
    dist.broadcast_object_list(payload, src=src, group=group)
    spec, meta = payload
    out = []
    for i, m in enumerate(meta):
        if m[0] == "obj":
            out.append(m[1])
            continue
        t = leaves[i].detach().to(device).contiguous() if leaves else torch.empty(m[0], dtype=m[1], device=device)
        dist.broadcast(t, src=src, group=group)
        out.append(t)
    return torch.utils._pytree.tree_unflatten(out, spec)


def train_step(state, microbatches: list[dict], loss_fn: Callable) -> dict:
    """One optimizer step over ``microbatches`` (``state``: ``utils.optimizer.build_optimizer``'s
    TrainState): :func:`forward_backward` (a global token-mean loss), then the optimizer's
    clipping and update. Returns the metrics averaged over microbatches, grad_norm and lr."""
    from parallel_models.utils.optimizer import optimizer_step, zero_grads

    zero_grads(state)
    metrics = forward_backward(state.chunks, microbatches, loss_fn)
    out = optimizer_step(state)
    for key in (metrics[0] if metrics else {}):
        vals = [m[key] for m in metrics]
        out[key] = float(sum(float(v) for v in vals) / len(vals))
    return out
