"""Validation: generate on a held-out prompt set, score, aggregate over data-parallel ranks, and
keep a few sample generations for the logs.

The trainer calls :meth:`Validator.run` before training (``trainer.val_before_train``) and every
``trainer.test_freq`` steps. Prompt ``i`` of the validation set goes to data-parallel rank
``i % dp``, in chunks of ``batch_size`` prompts; each rank rolls out its share with the
validation sampling settings (greedy unless configured) and scores it with the training reward.
Metrics (``val/...``) are exact over the whole set (sums and counts reduced over DP):

* ``val/reward/mean``, ``val/accuracy`` (share of responses scoring >= ``accuracy_threshold``),
  ``val/response_length/mean``;
* the same per ``data_source`` of the records: ``val/<source>/reward/mean``,
  ``val/<source>/accuracy``.
"""

from __future__ import annotations

from collections import defaultdict
from typing import Callable, Sequence

import torch

from parallel_models.rl.observe.dp_stats import keyed_sums_over_ranks


class Validator:
    def __init__(self, dataset, tokenizer, batch_size: int, num_samples: int = 4,
                 accuracy_threshold: float = 1.0, dp_rank: int = 0, dp_size: int = 1,
                 dp_group=None):
        if batch_size < 1:
            raise ValueError(f"validation batch_size must be >= 1, got {batch_size}")
        self.dataset = dataset
        self.tokenizer = tokenizer
        self.batch_size = batch_size
        self.num_samples = num_samples
        self.accuracy_threshold = accuracy_threshold
        self.dp_rank, self.dp_size, self.dp_group = dp_rank, dp_size, dp_group

    def my_indices(self) -> list[int]:
        return list(range(self.dp_rank, len(self.dataset), self.dp_size))

    def run(self, rollout: Callable[[list[list[int]], list[dict]], object],
            score: Callable[[object], tuple[torch.Tensor, dict]]) -> tuple[dict, list[dict]]:
        """``rollout(prompt_ids, records) -> batch`` (one response per prompt) and
        ``score(batch) -> (scores [rows], metrics)``. Returns (metrics, sample rows)."""
        sums: dict[str, list[float]] = defaultdict(lambda: [0.0, 0.0, 0.0])  # reward, correct, n
        length_sum, rows = 0.0, []
        mine = self.my_indices()
        for start in range(0, len(mine), self.batch_size):
            chunk = mine[start:start + self.batch_size]
            items = [self.dataset[i] for i in chunk]
            prompt_ids = [it["input_ids"] for it in items]
            records = [it["record"] for it in items]
            batch = rollout(prompt_ids, records)
            scores, _ = score(batch)
            scores = scores.detach().float().cpu()
            response_mask = batch["response_mask"].cpu()
            length_sum += float(response_mask.sum())
            for j, rec in enumerate(records):
                s = float(scores[j])
                source = rec.get("data_source")
                for key in [""] + ([str(source)] if source is not None else []):
                    acc = sums[key]
                    acc[0] += s
                    acc[1] += float(s >= self.accuracy_threshold)
                    acc[2] += 1
            if len(rows) < self.num_samples:
                rows.extend(self._sample_rows(batch, records, scores, self.num_samples - len(rows)))
        totals = self._reduce(sums, length_sum)
        return totals, rows

    def _sample_rows(self, batch, records: Sequence[dict], scores, limit: int) -> list[dict]:
        seqs = batch["sequences"].cpu()
        width = seqs.shape[1] - batch["response_mask"].shape[1]
        attn = batch["attention_mask"].cpu()
        response_mask = batch["response_mask"].cpu()
        out = []
        for j in range(min(limit, len(records))):
            prompt = seqs[j, :width][attn[j, :width].bool()].tolist()
            response = seqs[j, width:][response_mask[j].bool()].tolist()
            out.append({"prompt": self.tokenizer.decode(prompt, skip_special_tokens=True),
                        "response": self.tokenizer.decode(response, skip_special_tokens=True),
                        "ground_truth": _text(records[j].get("ground_truth",
                                                             records[j].get("answer"))),
                        "score": float(scores[j])})
        return out

    def _reduce(self, sums: dict[str, list[float]], length_sum: float) -> dict[str, float]:
        local = {k: list(v) for k, v in sums.items()}
        local["__length__"] = [length_sum, 0.0, 0.0]
        merged = keyed_sums_over_ranks(local, self.dp_group, self.dp_size)
        total = merged.pop("__length__")[0]
        out: dict[str, float] = {}
        for key, (reward, correct, n) in sorted(merged.items()):
            if n == 0:
                continue
            prefix = "val" if key == "" else f"val/{key}"
            out[f"{prefix}/reward/mean"] = reward / n
            out[f"{prefix}/accuracy"] = correct / n
        n_all = merged[""][2] if "" in merged else 0
        if n_all:
            out["val/response_length/mean"] = total / n_all
        return out


def _text(value) -> str | None:
    return None if value is None else str(value)


__all__ = ["Validator"]
