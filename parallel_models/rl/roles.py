"""PPO roles colocated on the same ranks: actor (trains), reference (frozen actor), critic
(value model, trains) and reward (rule function or a value-head reward model).

A PPO batch is a dict of padded tensors, one row per sample:
``sequences [N, P+R]`` (left-padded prompt, right-padded response), ``attention_mask``,
``prompt_lengths [N]``, ``response_mask [N, R]`` and per-token tensors ``[N, R]`` (log-probs,
values, advantages, returns). Microbatches are cut by a token budget and packed (no padding)
before they reach the models; the per-token outputs are read back at the response positions.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from megatron.core import parallel_state as mpu

from parallel_models import pipeline
from parallel_models.rl import algorithms as algos
from parallel_models.rl import losses
from parallel_models.utils.microbatch import restore_order, split_by_token_budget
from parallel_models.utils.padding import pack_padded_batch
from parallel_models.utils.vocab_parallel import gather_response, log_probs_from_packed_logits

PER_SAMPLE_KEYS = ("sequences", "attention_mask", "prompt_lengths", "response_mask",
                   "old_log_probs", "ref_log_probs", "advantages", "returns", "values")


def make_microbatches(batch: dict, max_tokens: int) -> tuple[list[dict], list[list[int]]]:
    """Token-budget microbatches of a PPO batch, each packed for the RmPad models."""
    sub = {k: v for k, v in batch.items() if k in PER_SAMPLE_KEYS}
    lengths = batch["attention_mask"].sum(-1)
    budget = max(max_tokens, int(lengths.max()))  # one sample always fits
    mbs, indices = split_by_token_budget(sub, budget, seq_lens=lengths)
    for mb in mbs:
        packed = pack_padded_batch(mb["sequences"], mb["attention_mask"])
        mb.update(input_ids=packed.input_ids, cu_seqlens=packed.cu_seqlens,
                  position_ids=packed.position_ids, max_seqlen=packed.max_seqlen)
    return mbs, indices


def _response_log_probs(logits, mb, temperature: float, with_entropy: bool):
    if temperature != 1.0:
        logits = logits / temperature
    out = log_probs_from_packed_logits(logits, mb["input_ids"], mb["cu_seqlens"],
                                       with_entropy=with_entropy)
    R = mb["response_mask"].shape[1]
    if with_entropy:
        logp, ent = out
        return (gather_response(logp, mb["cu_seqlens"], mb["prompt_lengths"], R),
                gather_response(ent, mb["cu_seqlens"], mb["prompt_lengths"], R))
    return gather_response(out, mb["cu_seqlens"], mb["prompt_lengths"], R), None


class PolicyRole:
    """Actor (with a TrainState) or reference (frozen) over a RmPad CausalLM."""

    def __init__(self, model, train_state=None, temperature: float = 1.0, max_tokens: int = 4096):
        self.model = model
        self.state = train_state
        self.temperature = temperature
        self.max_tokens = max_tokens

    @property
    def chunks(self):
        return self.state.chunks if self.state is not None else [self.model]

    @torch.no_grad()
    def log_probs(self, batch: dict) -> torch.Tensor:
        mbs, indices = make_microbatches(batch, self.max_tokens)
        fn = lambda out, mb: _response_log_probs(out.logits, mb, self.temperature, False)[0]  # noqa: E731
        outs = pipeline.forward_only(self.chunks, mbs, fn)
        return restore_order(outs, indices)

    def update(self, batch: dict, cfg, kl_cfg) -> dict:
        """One optimizer step on ``batch`` (a PPO minibatch) with the clipped policy loss."""
        from parallel_models.pipeline import train_step

        mode = cfg.loss_agg_mode

        def loss_fn(out, mb):
            logp, ent = _response_log_probs(out.logits, mb, self.temperature, True)
            mask = mb["response_mask"]
            pg_loss, m = losses.compute_policy_loss(
                mb["old_log_probs"], logp, mb["advantages"], mask,
                clip_ratio_low=cfg.clip_ratio_low, clip_ratio_high=cfg.clip_ratio_high,
                clip_ratio_c=cfg.clip_ratio_c, loss_agg_mode=mode)
            entropy = losses.compute_entropy_loss(ent, mask, mode)
            loss = pg_loss - cfg.entropy_coef * entropy
            metrics = {"actor/pg_loss": pg_loss.detach(), "actor/entropy": entropy.detach(),
                       "actor/pg_clipfrac": m["pg_clipfrac"], "actor/ppo_kl": m["ppo_kl"],
                       "actor/pg_clipfrac_lower": m["pg_clipfrac_lower"]}
            if cfg.use_kl_loss:
                kl = losses.agg_loss(algos.kl_penalty(logp, mb["ref_log_probs"], cfg.kl_loss_type),
                                    mask, mode)
                loss = loss + cfg.kl_loss_coef * kl
                metrics["actor/kl_loss"] = kl.detach()
            denom = losses.agg_denominator(mask, mode)
            return loss * denom, denom, metrics

        mbs, _ = make_microbatches(batch, self.max_tokens)
        out = train_step(self.state, mbs, loss_fn)
        return {("actor/" + k if "/" not in k else k): v for k, v in out.items()}


class CriticRole:
    """Value model (RmPad Value variant): values of the states before each response token."""

    def __init__(self, model, train_state, max_tokens: int = 4096):
        self.model = model
        self.state = train_state
        self.max_tokens = max_tokens

    @torch.no_grad()
    def values(self, batch: dict) -> torch.Tensor:
        mbs, indices = make_microbatches(batch, self.max_tokens)
        fn = lambda out, mb: self._gather(out.values, mb)  # noqa: E731
        return restore_order(pipeline.forward_only(self.state.chunks, mbs, fn), indices)

    @staticmethod
    def _gather(values, mb):
        R = mb["response_mask"].shape[1]
        return gather_response(values.float(), mb["cu_seqlens"], mb["prompt_lengths"], R)

    def update(self, batch: dict, cfg, loss_agg_mode: str) -> dict:
        from parallel_models.pipeline import train_step

        def loss_fn(out, mb):
            vpreds = self._gather(out.values, mb)
            mask = mb["response_mask"]
            loss, m = losses.compute_value_loss(vpreds, mb["values"], mb["returns"], mask,
                                               cliprange_value=cfg.cliprange_value,
                                               loss_agg_mode=loss_agg_mode)
            denom = losses.agg_denominator(mask, loss_agg_mode)
            return loss * denom, denom, {"critic/vf_loss": loss.detach(),
                                         "critic/vf_clipfrac": m["vf_clipfrac"]}

        mbs, _ = make_microbatches(batch, self.max_tokens)
        out = train_step(self.state, mbs, loss_fn)
        return {("critic/" + k if "/" not in k else k): v for k, v in out.items()}


class RuleReward:
    """A rule-based reward ``fn(prompts, responses) -> scores`` on decoded text."""

    def __init__(self, fn, tokenizer):
        self.fn = fn
        self.tokenizer = tokenizer

    def score(self, batch: dict) -> torch.Tensor:
        tok = self.tokenizer
        P = batch["sequences"].shape[1] - batch["response_mask"].shape[1]
        prompts = tok.batch_decode([row[m.bool()].tolist() for row, m in
                                    zip(batch["sequences"][:, :P], batch["attention_mask"][:, :P])],
                                   skip_special_tokens=True)
        responses = tok.batch_decode([row[m.bool()].tolist() for row, m in
                                      zip(batch["sequences"][:, P:], batch["response_mask"])],
                                     skip_special_tokens=True)
        scores = self.fn(prompts, responses)
        if len(scores) != len(responses):
            raise ValueError(f"reward function returned {len(scores)} scores for "
                             f"{len(responses)} responses")
        return torch.tensor([float(s) for s in scores], dtype=torch.float32)


token_level_scores = algos.scores_at_last_token  # the score on the last valid token


def data_parallel_mean(metrics: dict) -> dict:
    """Average float metrics over the data-parallel group (same keys on every rank)."""
    if not dist.is_initialized() or mpu.get_data_parallel_world_size() == 1:
        return {k: float(v) for k, v in metrics.items()}
    keys = sorted(metrics)
    t = torch.tensor([float(metrics[k]) for k in keys], dtype=torch.float64)
    if torch.cuda.is_available():
        t = t.cuda()
    dist.all_reduce(t, group=mpu.get_data_parallel_group())
    t /= mpu.get_data_parallel_world_size()
    return dict(zip(keys, t.tolist()))
