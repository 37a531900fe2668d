"""Validator: exact metrics over the whole validation set (per data source), DP=2 equals DP=1,
sample rows decoded from the batch."""

from __future__ import annotations

import torch

from parallel_models.rl.observe.evaluation import Validator


class _Dataset:
    def __init__(self, records, tok):
        self.records = records
        self.ids = [tok(r["prompt"])["input_ids"] for r in records]

    def __len__(self):
        return len(self.records)

    def __getitem__(self, i):
        return {"input_ids": self.ids[i], "record": self.records[i]}


def _records():
    return [{"prompt": f"max {a} {b}=", "ground_truth": str(max(a, b)),
             "data_source": "max" if a % 2 else "other"} for a, b in [(1, 2), (3, 9), (4, 4), (7, 0), (5, 6)]]


def _fake_rollout(tok):
    """Answers every prompt with its first operand (right for 2 of 5 prompts)."""
    def rollout(prompt_ids, records):
        responses = [tok(r["prompt"].split()[1], add_special_tokens=False)["input_ids"] for r in records]
        p = max(len(x) for x in prompt_ids)
        r = max(len(x) for x in responses)
        seq = torch.zeros(len(records), p + r, dtype=torch.long)
        attn = torch.zeros_like(seq)
        rmask = torch.zeros(len(records), r, dtype=torch.long)
        for i, (pi, ri) in enumerate(zip(prompt_ids, responses)):
            seq[i, p - len(pi):p] = torch.tensor(pi)
            seq[i, p:p + len(ri)] = torch.tensor(ri)
            attn[i, p - len(pi):p + len(ri)] = 1
            rmask[i, :len(ri)] = 1
        return {"sequences": seq, "attention_mask": attn, "response_mask": rmask, "records": records}
    return rollout


def _score(tok):
    def score(batch):
        p = batch["sequences"].shape[1] - batch["response_mask"].shape[1]
        texts = [tok.decode(row[p:][m.bool()].tolist()) for row, m in
                 zip(batch["sequences"], batch["response_mask"])]
        return torch.tensor([float(t == r["ground_truth"]) for t, r in zip(texts, batch["records"])]), {}
    return score


def _run(rank, size):
    from parallel_models.tokenizer import build_builtin_tokenizer

    tok = build_builtin_tokenizer()
    v = Validator(_Dataset(_records(), tok), tok, batch_size=2, num_samples=2,
                  dp_rank=rank, dp_size=size)
    return v.run(_fake_rollout(tok), _score(tok))


def test_metrics_are_exact_over_the_set_and_per_source():
    metrics, rows = _run(0, 1)
    # right: (4,4) -> 4 and (7,0) -> 7; "max" source = a odd: (1,2) (3,9) (7,0) (5,6)
    assert metrics["val/accuracy"] == 2 / 5 and metrics["val/reward/mean"] == 2 / 5
    assert metrics["val/max/accuracy"] == 1 / 4 and metrics["val/other/accuracy"] == 1.0
    assert metrics["val/response_length/mean"] == 1.0
    assert rows == [{"prompt": "max 1 2=", "response": "1", "ground_truth": "2", "score": 0.0},
                    {"prompt": "max 3 9=", "response": "3", "ground_truth": "9", "score": 0.0}]


def _dp_worker():
    import torch.distributed as dist

    dist.init_process_group("gloo")
    return _run(dist.get_rank(), dist.get_world_size())[0]


def test_data_parallel_2_equals_1():
    from parallel_models.testing import run_distributed

    single, _ = _run(0, 1)
    for metrics in run_distributed(_dp_worker, 2, timeout=120):
        assert metrics == single
