"""PPO roles colocated on the same ranks and the one protocol the trainer calls them through:
actor (trains), reference (frozen actor), critic (value model, trains) and reward (a rule
function here, or the value-head reward model of ``rl/rewards/model.py``).

Every role can ``offload()`` / ``onload()`` itself (``parallel_models.utils.offload``; both
return the bytes moved) and gives an ``on_device()`` block for a phase; besides that a role
offers what it is for: ``log_probs`` (actor, reference), ``values`` (critic), ``score``
(reward) and ``update`` (actor, critic: one optimizer step on a PPO minibatch).

Batches are :class:`parallel_models.rl.data.batch.RolloutBatch` (or a dict with the same keys).
Microbatches are cut by a token budget and packed (no padding) before they reach the models;
the per-token outputs are read back at the response positions.
"""

from __future__ import annotations

import contextlib
from typing import ContextManager, Protocol, runtime_checkable

import torch

from parallel_models import pipeline
from parallel_models.rl.algorithms import core as algos
from parallel_models.llama.layers import exact
from parallel_models.rl.observe import dp_stats
from parallel_models.rl.algorithms import losses
from parallel_models.rl.roles import moe_aux
from parallel_models.rl.roles import routing
from parallel_models.rl.roles.exact_log_probs import exact_response_log_probs
from parallel_models.utils.microbatch import restore_order, split_by_token_budget
from parallel_models.utils.offload import Offloader, OffloadingRole
from parallel_models.utils.padding import pack_padded_batch
from parallel_models.utils.vocab_parallel import gather_response, log_probs_from_packed_logits


@runtime_checkable
class Role(Protocol):
    """What every role offers the trainer: moving its weights (and optimizer states) between the
    compute device and host memory."""

    def offload(self) -> int: ...

    def onload(self) -> int: ...

    def on_device(self, with_optimizer: bool = False) -> ContextManager: ...


@runtime_checkable
class LogProbRole(Role, Protocol):
    def log_probs(self, batch) -> torch.Tensor: ...


@runtime_checkable
class ValueRole(Role, Protocol):
    def values(self, batch) -> torch.Tensor: ...


@runtime_checkable
class ScoreRole(Role, Protocol):
    def score(self, batch) -> torch.Tensor: ...


@runtime_checkable
class TrainableRole(Role, Protocol):
    def update(self, batch) -> dict[str, float]: ...

    def updating(self) -> ContextManager: ...


PER_SAMPLE_KEYS = ("sequences", "attention_mask", "prompt_lengths", "response_mask",
                   "old_log_probs", "ref_log_probs", "advantages", "returns", "values",
                   "rollout_log_probs", "rollout_is_weights", "routes")


def make_microbatches(batch: dict, max_tokens: int, routes: bool = True
                      ) -> tuple[list[dict], list[list[int]]]:
    """Token-budget microbatches of a PPO batch, each packed for the RmPad models (MoE routes
    packed like the tokens: ``rl/roles/routing.py``; ``routes=False``: left out, for models that do
    not replay the actor's routes, e.g. an MoE critic)."""
    sub = {k: v for k, v in batch.items() if k in PER_SAMPLE_KEYS and v is not None
           and (routes or k != "routes")}
    lengths = batch["attention_mask"].sum(-1)
    budget = max(max_tokens, int(lengths.max()))  # one sample always fits
    mbs, indices = split_by_token_budget(sub, budget, seq_lens=lengths)
    for mb in mbs:
        packed = pack_padded_batch(mb["sequences"], mb["attention_mask"])
        mb.update(input_ids=packed.input_ids, cu_seqlens=packed.cu_seqlens,
                  position_ids=packed.position_ids, max_seqlen=packed.max_seqlen)
        if "routes" in mb:
            mb["routes"] = routing.pack_routes(mb["routes"], mb["attention_mask"])
    return mbs, indices


def _packed_log_probs(logits, mb, temperature: float, with_entropy: bool):
    """Next-token log-probs (and entropy) of every packed token; ``logits``: the packed
    vocab-parallel logits or the model's output (under context parallelism or for long inputs
    its own ``next_token_log_probs``: on this rank's share of the tokens then gathered, chunked
    over the tokens without the logits; ``heads/lm_output.py``)."""
    if hasattr(logits, "next_token_log_probs"):
        return logits.next_token_log_probs(mb["input_ids"], mb["cu_seqlens"], with_entropy,
                                           temperature)
    logits = getattr(logits, "logits", logits)
    return log_probs_from_packed_logits(logits, mb["input_ids"], mb["cu_seqlens"],
                                        with_entropy=with_entropy, temperature=temperature)


def _response_log_probs(logits, mb, temperature: float, with_entropy: bool):
    """``logits``: packed ``[T, V/tp]`` logits or the model output holding them."""
    if exact.enabled():  # rollout.exact: the sampler's own log-prob kernel
        return exact_response_log_probs(getattr(logits, "logits", logits), mb, temperature,
                                        with_entropy)
    out = _packed_log_probs(logits, mb, temperature, with_entropy)
    R = mb["response_mask"].shape[1]
    if with_entropy:
        logp, ent = out
        return (gather_response(logp, mb["cu_seqlens"], mb["prompt_lengths"], R),
                gather_response(ent, mb["cu_seqlens"], mb["prompt_lengths"], R))
    return gather_response(out, mb["cu_seqlens"], mb["prompt_lengths"], R), None


def policy_loss(logits, mb, cfg, temperature: float):
    """The actor's loss on one packed microbatch (``logits [T, V]`` or the model output): the
    policy loss (``actor.policy_loss``, default the clipped PPO loss), minus the entropy bonus,
    plus the KL loss; returned as ``(loss * denom, denom, metrics)`` with the loss-like metrics weighted
    (see :func:`_global_update_metrics`). Both training backends use it."""
    mode = cfg.loss_agg_mode
    logp, ent = _response_log_probs(logits, mb, temperature, True)
    mask = mb["response_mask"]
    # rollout correction (actor.rollout_correction / tis_cap): the batch's importance weights,
    # made once per step by rl/algorithms/rollout_correction.py, reach every policy loss here
    tis = mb.get("rollout_is_weights")
    loss_name = getattr(cfg, "policy_loss", "ppo")
    loss_fn = losses.POLICY_LOSSES.get(loss_name)
    pg_loss, m = loss_fn(log_probs=logp, old_log_probs=mb["old_log_probs"],
                         advantages=mb["advantages"], response_mask=mask, config=cfg,
                         token_weights=tis)
    declared = losses.POLICY_LOSSES.attribute(loss_fn, "metrics")
    if set(m) != set(declared):
        raise ValueError(f"actor.policy_loss={loss_name!r} returned the metrics {sorted(m)} but "
                         f"declares {sorted(declared)} (its metrics attribute)")
    entropy = losses.compute_entropy_loss(ent, mask, mode)
    loss = pg_loss - cfg.entropy_coef * entropy
    denom = losses.agg_denominator(mask, mode)
    tokens = (mask > 0).sum()
    metrics = {"pg_loss": pg_loss.detach() * denom, "entropy": entropy.detach() * denom,
               **{k: v.detach() * tokens for k, v in m.items()},
               "_denom": denom.detach().float(), "_tokens": tokens.float()}
    if cfg.use_kl_loss:
        kl = losses.agg_loss(algos.kl_penalty(logp, mb["ref_log_probs"], cfg.kl_loss_type),
                             mask, mode)
        loss = loss + cfg.kl_loss_coef * kl
        metrics["kl_loss"] = kl.detach() * denom
    return loss * denom, denom, metrics


def policy_metric_weights(cfg) -> dict[str, str]:
    """Which weight each weighted actor metric of :func:`policy_loss` carries (the policy loss's
    own metrics, those it declares, are token means)."""
    loss_fn = losses.POLICY_LOSSES.get(getattr(cfg, "policy_loss", "ppo"))
    weighted = {"pg_loss": "_denom", "entropy": "_denom",
                **dict.fromkeys(losses.POLICY_LOSSES.attribute(loss_fn, "metrics"), "_tokens")}
    if cfg.use_kl_loss:
        weighted["kl_loss"] = "_denom"
    return weighted


VALUE_METRIC_WEIGHTS = {"vf_loss": "_denom", "vf_clipfrac": "_tokens"}


def gather_values(values, mb):
    """Packed per-token values -> ``[B, R]``: the value of the state before each response token."""
    R = mb["response_mask"].shape[1]
    return gather_response(values.float(), mb["cu_seqlens"], mb["prompt_lengths"], R)


def value_loss(values, mb, cliprange_value: float, mode: str):
    """The critic's clipped value loss on one packed microbatch (``values [T]``), returned like
    :func:`policy_loss`."""
    vpreds = gather_values(values, mb)
    mask = mb["response_mask"]
    loss, m = losses.compute_value_loss(vpreds, mb["values"], mb["returns"], mask,
                                        cliprange_value=cliprange_value, loss_agg_mode=mode)
    denom = losses.agg_denominator(mask, mode)
    tokens = (mask > 0).sum()
    return loss * denom, denom, {"vf_loss": loss.detach() * denom,
                                 "vf_clipfrac": m["vf_clipfrac"] * tokens,
                                 "_denom": denom.detach().float(), "_tokens": tokens.float()}


class _ModelRole(OffloadingRole):
    """Offload plumbing shared by the model-backed roles."""

    idle_grads = None  # an IdleGradBuffers once release_idle_grads() was called

    def _init_offload(self, chunks, optimizer) -> None:
        self._offload_parts, self._offloader = (chunks, optimizer), None

    def release_idle_grads(self) -> int:
        """From now on the role's gradient buffers are released outside its update phases
        (``trainer.release_idle_grads``); released now. The bytes freed."""
        from parallel_models.utils.idle_grad_buffers import IdleGradBuffers

        if self.idle_grads is None:
            self.idle_grads = IdleGradBuffers(self._offload_parts[0])
        return self.idle_grads.release()

    def updating(self):
        if self.idle_grads is None:
            return contextlib.nullcontext()
        return self.idle_grads.in_use()

    @property
    def offloader(self) -> Offloader:
        """Made on first use (only trainer.offload uses it)."""
        if self._offloader is None:
            self._offloader = Offloader(*self._offload_parts)
        return self._offloader


def _global_update_metrics(out: dict, weighted: dict[str, str], n_microbatches: int,
                           prefix: str) -> dict[str, float]:
    """``train_step`` averages metrics over microbatches; the loss-like ones come in as
    ``value * weight`` with their weights, so their means over microbatches and data-parallel
    ranks are the global weighted means (the loss the gradients are of)."""
    keys = sorted(weighted)
    sums = torch.tensor([[out.pop(k) * n_microbatches, out[weighted[k]] * n_microbatches]
                         for k in keys], dtype=torch.float64)
    sums = dp_stats.data_parallel_sum(sums)
    for k in set(weighted.values()):
        out.pop(k, None)
    result = {k: float(s / max(w, 1e-30)) for k, (s, w) in zip(keys, sums.tolist())}
    result.update(out)
    return {(prefix + k if "/" not in k else k): v for k, v in result.items()}


class PolicyRole(_ModelRole):
    """Actor (with a TrainState and its ``actor`` config section) or reference (frozen) over a
    RmPad CausalLM. MoE: ``log_probs(batch, replay=, record=)`` replays / records the batch's
    routes and leaves its :class:`RouteSession` in ``route_session`` (``recorded_routes``: the
    routes it used, batch layout); with ``actor.router_replay`` R2 / R3 the updates replay
    ``batch.routes``."""

    def __init__(self, model, train_state=None, temperature: float = 1.0, max_tokens: int = 4096,
                 cfg=None):
        self.model = model
        self.state = train_state
        self.temperature = temperature
        self.max_tokens = max_tokens
        self.cfg = cfg
        self._init_offload(self.chunks, train_state.optimizer if train_state else None)

    @property
    def chunks(self):
        return self.state.chunks if self.state is not None else [self.model]

    route_session = None
    recorded_routes = None

    @torch.no_grad()
    def log_probs(self, batch, replay: bool = False, record: bool = False) -> torch.Tensor:
        mbs, indices = make_microbatches(batch, self.max_tokens)
        fn = lambda out, mb: _response_log_probs(out, mb, self.temperature, False)[0]  # noqa: E731
        with routing.routed_forwards(self.chunks, mbs, replay=replay, record=record) as session:
            outs = pipeline.forward_only(self.chunks, mbs, fn)
        self.route_session = session
        self.recorded_routes = (routing.recorded_routes(session, mbs, indices,
                                                        self.model.config.num_experts)
                                if session.recorded is not None else None)
        return restore_order(outs, indices)

    def update(self, batch) -> dict[str, float]:
        """One optimizer step on ``batch`` (a PPO minibatch) with the clipped policy loss.
        Loss metrics are global token (or sequence) means over microbatches and ranks."""
        from parallel_models.pipeline import train_step

        cfg = self.cfg

        def loss_fn(out, mb):
            return policy_loss(out, mb, cfg, self.temperature)

        mbs, _ = make_microbatches(batch, self.max_tokens)
        replay = getattr(cfg, "router_replay", "off") != "off"
        coef = moe_aux.aux_loss_coef(cfg, self.model.config)  # MoE load-balancing loss
        weights = policy_metric_weights(cfg)
        if coef > 0:
            weights = {**weights, moe_aux.METRIC: "_denom"}
        with routing.routed_forwards(self.chunks, mbs, replay=replay), \
                moe_aux.recording(self.chunks, coef):
            out = train_step(self.state, mbs, moe_aux.with_aux_loss(loss_fn, self.model, coef))
        return _global_update_metrics(out, weights, len(mbs), "actor/")


class CriticRole(_ModelRole):
    """Value model (RmPad Value variant): values of the states before each response token."""

    def __init__(self, model, train_state, max_tokens: int = 4096, cfg=None,
                 loss_agg_mode: str = "token-mean"):
        self.model = model
        self.state = train_state
        self.max_tokens = max_tokens
        self.cfg = cfg
        self.loss_agg_mode = loss_agg_mode
        self._init_offload(train_state.chunks, train_state.optimizer)

    @torch.no_grad()
    def values(self, batch) -> torch.Tensor:
        mbs, indices = make_microbatches(batch, self.max_tokens, routes=False)
        fn = lambda out, mb: self._gather(out.values, mb)  # noqa: E731
        return restore_order(pipeline.forward_only(self.state.chunks, mbs, fn), indices)

    _gather = staticmethod(gather_values)

    def update(self, batch) -> dict[str, float]:
        from parallel_models.pipeline import train_step

        def loss_fn(out, mb):
            return value_loss(out.values, mb, self.cfg.cliprange_value, self.loss_agg_mode)

        mbs, _ = make_microbatches(batch, self.max_tokens, routes=False)
        out = train_step(self.state, mbs, loss_fn)
        return _global_update_metrics(out, VALUE_METRIC_WEIGHTS, len(mbs), "critic/")


class RuleReward:
    """A rule-based reward on decoded text. The function gets the prompts, the responses and the
    dataset record of each response (its fields as keywords, or verl's ``compute_score``
    convention; see ``rl/rewards/calls.py``). No weights: offloading moves nothing."""

    def __init__(self, fn, tokenizer):
        self.fn = fn
        self.tokenizer = tokenizer
        self.metrics: dict[str, float] = {}

    def offload(self) -> int:
        return 0

    def onload(self) -> int:
        return 0

    def on_device(self, with_optimizer: bool = False):
        return contextlib.nullcontext(self)

    def score(self, batch) -> torch.Tensor:
        from parallel_models.rl.rewards.calls import call_reward_function, per_source_means

        tok = self.tokenizer
        P = batch["sequences"].shape[1] - batch["response_mask"].shape[1]
        prompts = tok.batch_decode([row[m.bool()].tolist() for row, m in
                                    zip(batch["sequences"][:, :P], batch["attention_mask"][:, :P])],
                                   skip_special_tokens=True)
        responses = tok.batch_decode([row[m.bool()].tolist() for row, m in
                                      zip(batch["sequences"][:, P:], batch["response_mask"])],
                                     skip_special_tokens=True)
        records = batch.get("records") if hasattr(batch, "get") else None
        scores, metrics = call_reward_function(self.fn, prompts, responses, records)
        # per-data-source means are reduced over DP by the trainer from the records
        local = per_source_means(scores, [r.get("data_source") for r in records or []])
        self.metrics = {k: v for k, v in metrics.items() if k not in local}
        return torch.tensor(scores, dtype=torch.float32)
