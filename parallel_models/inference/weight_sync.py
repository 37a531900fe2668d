"""Weight sync from the training layout (TP x PP x EP, each DP replica on its own) into the rollout
engine's model (TP' only, :mod:`rollout_layout`), in-process and bucketed. The gather runs over
the groups of the actor's ``ParallelLayout``, the scatter cuts the rollout model's shards by its
own layout's TP' rank; no process-wide state is switched.

For each bucket of HF tensors (consecutive entries of the weight map's ``global_jobs``, all on
one pipeline stage, at most ``bucket_bytes`` unless one tensor alone is larger):

1. the TP ranks of the stage that owns them all-gather each shard (into a reused scratch
   buffer) and merge it back to the HF tensors with the weight rule (``rule.merge``), written
   into the reused bucket buffer;
   (MoE: a routed expert by the ranks of the EP rank that holds it, over its expert-TP group,
   then broadcast from there over the expert-parallel group);
2. the bucket is broadcast over the pipeline group, so every rank of the replica holds it;
3. each rank cuts its TP' shard out of the bucket with the same rule (``rule.shard``, read
   from the bucket through a slice reader) and copies it into the rollout model.

No rank holds more than its shards, one bucket and one gathered tensor (plus the merge's
temporaries of that tensor). The buffers are kept for the next sync. All transforms are the
weight rules' (``checkpoint_utils/weight_rules.py``), so the result equals what
``from_pretrained`` of a ``save_pretrained`` of the actor loads, bit for bit. Communication stays
inside each training model-parallel group (and, for routed experts, the expert-parallel group,
which spans data-parallel replicas); data-parallel replicas sync their own ranks.
"""

from __future__ import annotations

import dataclasses
import time

import torch
import torch.distributed as dist

from parallel_models.llama.checkpoint_utils.collective_save import device_of, weight_map_of
from parallel_models.llama.checkpoint_utils.saver import StagePlacement
from parallel_models.llama.checkpoint_utils.weight_map import WeightMapping
from parallel_models.parallel_layout import layout_of

DEFAULT_BUCKET_BYTES = 512 * 2**20


class TensorReader:
    """The loader's ``WeightReader`` (what the weight rules read: ``read(name, dim, start,
    end)``, ``.shape``, ``.dtype``, ``keys()``) over HF tensors held in memory (views of a
    bucket buffer, or tensors streamed to the rollout server)."""

    def __init__(self, tensors: dict[str, torch.Tensor], folder: str = "<memory>"):
        self.tensors = tensors
        self.folder = folder

    def keys(self):
        return self.tensors.keys()

    def __contains__(self, name):
        return name in self.tensors

    def __call__(self, name, dim, start, end):
        t = self.tensors[name]
        return t if dim is None else t.narrow(dim, start, end - start)

    def shape(self, name):
        return list(self.tensors[name].shape)

    def dtype(self, name):
        return self.tensors[name].dtype


@dataclasses.dataclass
class _Job:
    mapping: WeightMapping
    layer: int | None
    slots: list[tuple[str, int, tuple[int, ...]]]  # (HF name, offset in the bucket, shape)


@dataclasses.dataclass
class _Bucket:
    stage: int
    jobs: list[_Job]
    numel: int


class BucketGatherer:
    """The actor's weights as HF tensors, bucket by bucket, on every rank of each training
    model-parallel group (steps 1 and 2 above). ``for bucket, tensors in gatherer.buckets_iter()``
    on every rank together; ``tensors``: HF name -> view of the reused bucket buffer, valid
    until the next bucket. Groups: those of the layout the chunks were built in."""

    def __init__(self, chunks, bucket_bytes: int = DEFAULT_BUCKET_BYTES):
        chunks = list(chunks) if isinstance(chunks, (list, tuple)) else [chunks]
        first = chunks[0]
        self.config = first.config
        self.chunks = chunks
        self.head_kind = first.head_kind
        self.bucket_bytes = int(bucket_bytes)
        self.dtype = first.dtype
        self.device = device_of(chunks)
        self.weight_map = weight_map_of(chunks)
        self.placement = StagePlacement(chunks, self.config, self.device)
        layout = self.layout = layout_of(chunks)
        self.tp = layout.tensor_parallel_size
        self.tp_group = layout.tp_group
        self.pp_group = layout.pp_group
        # MoE: a routed expert lives on one EP rank, split over its expert-TP group
        self.ep = layout.expert_parallel_size
        self.ep_rank = layout.expert_parallel_rank
        self.etp = layout.expert_tensor_parallel_size if self.config.is_moe else 1
        self.etp_group = layout.expert_tp_group if self.config.is_moe else None
        self.ep_group = layout.ep_group if self.ep > 1 else None
        self.buckets = self._plan(self.weight_map.global_jobs(self.config, self.head_kind))
        self._bucket_buf: torch.Tensor | None = None
        self._scratch: torch.Tensor | None = None

    # ---- planning -----------------------------------------------------------------------------
    def _plan(self, jobs) -> list[_Bucket]:
        esize = torch.empty((), dtype=self.dtype).element_size()
        buckets: list[_Bucket] = []
        for mapping, layer in jobs:
            stage = self.placement.stage_of(mapping, layer)
            shapes = mapping.rule.hf_shapes(self.config)
            numel = sum(int(torch.Size(s).numel()) for s in shapes)
            b = buckets[-1] if buckets else None
            full = b is not None and b.jobs and (b.numel + numel) * esize > self.bucket_bytes
            if b is None or b.stage != stage or full:
                b = _Bucket(stage, [], 0)
                buckets.append(b)
            slots, off = [], b.numel
            for name, shape in zip(mapping.hf_names(layer), shapes):
                slots.append((name, off, tuple(shape)))
                off += int(torch.Size(shape).numel())
            b.jobs.append(_Job(mapping, layer, slots))
            b.numel = off
        return buckets

    @property
    def buffer_bytes(self) -> int:
        """Bytes of the buffers kept between syncs (bucket + gather scratch)."""
        return sum(t.numel() * t.element_size() for t in (self._bucket_buf, self._scratch)
                   if t is not None)

    def _buffers(self) -> tuple[torch.Tensor, torch.Tensor | None]:
        if self._bucket_buf is None:
            most = max(b.numel for b in self.buckets)
            self._bucket_buf = torch.empty(most, dtype=self.dtype, device=self.device)
            gathered = [self._split(j.mapping)[0]
                        * self.placement.param(j.mapping, j.layer, self.config).numel()
                        for b in self.buckets if b.stage == self.placement.pp_rank
                        for j in b.jobs if j.mapping.rule.split_over_tp and self._holds(j)]
            if max(self.tp, self.etp) > 1 and gathered:
                self._scratch = torch.empty(max(gathered), dtype=self.dtype, device=self.device)
        return self._bucket_buf, self._scratch

    def flat(self, bucket: _Bucket) -> torch.Tensor:
        """The bucket's tensors back to back (in ``bucket.jobs`` / slot order): a view of the
        reused bucket buffer, valid while ``buckets_iter`` is at that bucket."""
        return self._buffers()[0][: bucket.numel]

    # ---- the sync -------------------------------------------------------------------------------
    def _split(self, mapping: WeightMapping):
        """(size, group) of the TP split of ``mapping``'s parameter: the expert-TP group for a
        routed expert, the TP group otherwise."""
        return (self.etp, self.etp_group) if mapping.expert is not None else (self.tp,
                                                                              self.tp_group)

    def _owner(self, job: _Job) -> int | None:
        """The EP rank holding a routed expert's job (None: not a routed expert)."""
        return None if job.mapping.expert is None else job.mapping.expert_owner(self.config,
                                                                                 self.ep)

    def _holds(self, job: _Job) -> bool:
        """Whether this rank (on the job's stage) holds a shard of the job's parameter."""
        owner = self._owner(job)
        return owner is None or owner == self.ep_rank

    def _gather_merged(self, job: _Job, scratch) -> list[torch.Tensor]:
        """The HF tensors of one job from this stage's TP (expert-TP) shards (every rank of that
        group gets them)."""
        shard = self.placement.param(job.mapping, job.layer, self.config).detach()
        rule = job.mapping.rule
        n, group = self._split(job.mapping)
        if not rule.split_over_tp or n == 1:
            return rule.merge([shard], self.config)
        gathered = scratch[: n * shard.numel()].view(n * shard.shape[0], *shard.shape[1:])
        # straight into the scratch buffer (a list all_gather stages a flat copy on gloo)
        dist.all_gather_into_tensor(gathered, shard.contiguous(), group=group)
        return rule.merge(list(gathered.chunk(n, dim=0)), self.config)

    def _share_experts(self, bucket: _Bucket, flat: torch.Tensor) -> None:
        """EP > 1: every EP rank of the stage gets the routed experts the others hold (one
        broadcast per run of consecutive jobs of one owner, from that owner)."""
        runs: list[list] = []  # [owner, start, end]
        for job in bucket.jobs:
            owner = self._owner(job)
            if owner is None:
                continue
            start = job.slots[0][1]
            end = job.slots[-1][1] + int(torch.Size(job.slots[-1][2]).numel())
            if runs and runs[-1][0] == owner and runs[-1][2] == start:
                runs[-1][2] = end
            else:
                runs.append([owner, start, end])
        for owner, start, end in runs:
            dist.broadcast(flat[start:end], src=dist.get_global_rank(self.ep_group, owner),
                           group=self.ep_group)

    @torch.no_grad()
    def buckets_iter(self):
        """Yield ``(bucket, {HF name: tensor})`` for every bucket, in the weight map's order."""
        buf, scratch = self._buffers()
        my_stage = self.placement.pp_rank
        for bucket in self.buckets:
            flat = buf[: bucket.numel]
            if bucket.stage == my_stage:
                for job in bucket.jobs:
                    if not self._holds(job):
                        continue
                    for t, (_, off, shape) in zip(self._gather_merged(job, scratch), job.slots):
                        flat[off: off + t.numel()].view(shape).copy_(t)
                if self.ep > 1:
                    self._share_experts(bucket, flat)
            if self.placement.pp > 1:
                dist.broadcast(flat, src=self.placement.pp_ranks[bucket.stage],
                               group=self.pp_group)
            yield bucket, {name: flat[off: off + int(torch.Size(shape).numel())].view(shape)
                           for job in bucket.jobs for name, off, shape in job.slots}


class WeightSync:
    """``WeightSync(actor_chunks, rollout_model, layout, bucket_bytes)``; :meth:`sync` (every
    rank together) copies the actor's current weights into ``rollout_model`` (built in
    ``layout``, a ``ParallelLayout``: its TP' size and rank cut the
    shards)."""

    def __init__(self, chunks, rollout_model, layout, bucket_bytes: int = DEFAULT_BUCKET_BYTES):
        self.gatherer = BucketGatherer(chunks, bucket_bytes)
        if self.gatherer.head_kind != "causal_lm":
            raise TypeError("WeightSync moves a CausalLM's weights")
        self.config = self.gatherer.config
        self.target = rollout_model
        self.layout = layout
        self.target_params = dict(rollout_model.named_parameters())
        self.last_seconds = 0.0

    @property
    def buckets(self):
        return self.gatherer.buckets

    @property
    def buffer_bytes(self) -> int:
        return self.gatherer.buffer_bytes

    @property
    def _bucket_buf(self):
        return self.gatherer._bucket_buf

    @torch.no_grad()
    def sync(self) -> float:
        """Copy the actor's weights into the rollout model; returns the seconds it took."""
        start = time.perf_counter()
        for bucket, tensors in self.gatherer.buckets_iter():
            self._scatter(bucket, tensors)
        if self.target.device.type == "cuda":
            torch.cuda.current_stream().synchronize()
        self.last_seconds = time.perf_counter() - start
        return self.last_seconds

    def _scatter(self, bucket: _Bucket, tensors: dict) -> None:
        """This rank's TP' shard of each tensor of the bucket into the rollout model."""
        layout = self.layout
        reader = TensorReader(tensors)
        for job in bucket.jobs:
            names = tuple(name for name, _, _ in job.slots)
            piece = job.mapping.rule.shard(reader, names, self.config,
                                           layout.tensor_parallel_size, layout.tensor_parallel_rank)
            # the rollout model has every expert (EP = 1): local expert = global expert
            self.target_params[job.mapping.ours_name(job.layer, job.mapping.expert)].copy_(piece)


__all__ = ["BucketGatherer", "TensorReader", "WeightSync", "DEFAULT_BUCKET_BYTES"]
