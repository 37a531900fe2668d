"""The reward model of the fsdp backend: ``rl.reward_model.RewardModel`` (its tokenizer
handling, truncation, microbatching and metrics) over a frozen FSDP2-sharded transformers
``*ForSequenceClassification`` (any family), scoring each sequence at its last token as
transformers pools. Every rank runs as many forwards as the rank with the most microbatches
(the shards are all-gathered in each)."""

from __future__ import annotations

import torch

from parallel_models.rl.backends.fsdp import models as fm
from parallel_models.rl.backends.fsdp.forward import (forward_packed_order, packed_sequences_supported,
                                             synced_count)
from parallel_models.rl.backends.fsdp.offload import FSDPOffloader
from parallel_models.rl.rewards.model import RewardModel


class FSDPRewardModel(RewardModel):
    """``FSDPRewardModel(path, ..., dtype="bfloat16")``: the arguments of ``RewardModel``; the
    reward model is sharded over all ranks (``replicate``: HSDP replicas)."""

    def __init__(self, path: str, *args, replicate: int = 1, **kwargs):
        self._replicate = replicate
        super().__init__(path, *args, **kwargs)

    def _build_model(self, path: str, arch: str, dtype):
        if self.pp > 1:
            raise ValueError("the fsdp reward model runs without pipeline parallelism")
        name = {torch.float32: "float32", torch.bfloat16: "bfloat16",
                torch.float16: "float16"}.get(dtype, dtype) or "float32"
        model = fm.shard_model(fm.load_value_model(path), fm.device_mesh(self._replicate),
                               dtype=name, trainable=False)
        self._packed = packed_sequences_supported(model)
        return [model], model.config

    def _make_offloader(self):
        return FSDPOffloader(self.chunks[0])

    @torch.no_grad()
    def _forward_scores(self, mbs: list[dict]) -> list[torch.Tensor]:
        model = self.chunks[0]
        outs = []
        for i in range(synced_count(len(mbs), mbs[0]["input_ids"].device)):
            mb = mbs[min(i, len(mbs) - 1)]
            values = forward_packed_order(model, mb, self._packed)
            if i < len(mbs):
                outs.append(values[mb["cu_seqlens"][1:].long() - 1].float())
        return outs
