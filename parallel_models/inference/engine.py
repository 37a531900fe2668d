"""The rollout engine: one object that turns prompts + :class:`SamplingParams` into samples with
the parallel CausalLM and swaps its weights atomically. The PPO trainer uses it in-process; the
rollout server (``server/engine.py``) wraps it and mirrors its commands to the other TP ranks.

- :meth:`RolloutEngine.generate` -> :class:`GenerationOutput` (``n`` samples per prompt,
  prompt-major; the tokenizer's EOS unless the params name their own or ``ignore_eos``; a
  ``seed`` gets its own generator, so seeded draws are reproducible).
- :meth:`RolloutEngine.generate_samples` -> per-row ``{"token_ids", "log_probs",
  "finish_reason"}`` lists (the server's answer format); with ``top_logprobs=k`` also
  ``"top_logprobs"``: per generated token the k most likely ``[token_id, log_prob]`` pairs.
- With ``kv_budget_tokens`` the engine batches continuously (``continuous.ContinuousEngine``:
  rows leave when done, waiting prompts take their place, the n samples of a prompt share one
  prefill; at most ``kv_budget_tokens`` KV positions and ``max_rows`` rows at once;
  ``kv_budget_tokens="auto"``: on CUDA the KV pool and the prefill chunk are planned from the
  device memory left at ``gpu_memory_utilization`` when a generate starts (``memory_plan``; an
  explicit budget keeps its size and only the prefill chunk is planned; a plan that cannot fit
  raises ``MemoryPlanError`` before generating); off CUDA "auto" = every row at once). Each prompt
  i gets its own draw seed (``params.seed`` mixed with i, else one from ``generator`` / the global
  generator), so a seeded call is reproducible whatever else runs; ``prompt_seeds`` (the PPO
  trainer's, one per prompt) give each sample its own noise in both batchers (the same tokens).
  ``keep_kv=True`` (the server) keeps the KV pool and the captured decode graphs between calls;
  otherwise they are freed after each call (the trainer trains between rollouts).
- :meth:`RolloutEngine.update_weights` loads an HF folder (or megatron-core checkpoint) into the
  model **atomically**: a copy of the current weights is taken first and written back if
  anything fails while loading (read error, out of memory, shape mismatch) on any rank of
  ``group``; the weights are then bit-identical to before and ``version`` does not move.
"""

from __future__ import annotations

import contextlib
import logging
import time
from typing import Sequence

import torch
import torch.distributed as dist

from parallel_models.inference.generation import GenerationOutput, generate
from parallel_models.inference.memory_plan import DEFAULT_GPU_MEMORY_UTILIZATION
from parallel_models.inference.row_sampling import SEED_BITS, row_seed
from parallel_models.inference.sampling import SamplingParams
from parallel_models.inference.stop_sequences import (check_stop_sequences,
                                                      ends_with_stop_sequence)

log = logging.getLogger(__name__)


class WeightUpdateError(RuntimeError):
    """Loading new weights failed (here or on another rank); the old weights were restored."""


def all_finite(t: torch.Tensor) -> bool:
    """No NaN or inf in ``t``: min and max propagate both; on the CPU ``aminmax`` is ~50x faster
    than ``isfinite(t).all()`` (0.8 s -> 0.015 s for a 272 MB bf16 embedding on one core)."""
    if t.numel() == 0:
        return True
    lo, hi = torch.aminmax(t.detach())
    return bool(torch.isfinite(lo) & torch.isfinite(hi))


def load_weights(model, path) -> None:
    """Fill ``model`` (this rank's shard) from ``path`` (a folder, or a loader ``WeightReader``
    over tensors in memory: a streamed push); a seam tests can replace."""
    from parallel_models.llama.checkpoint_utils import loader

    if isinstance(path, str):
        loader.load_hf_weights(model, path)
    else:
        loader.load_weights(model, path, model.weight_map)
    bad = [name for name, p in model.named_parameters() if not all_finite(p)]
    if bad:
        raise ValueError(f"non-finite weights after loading: {', '.join(bad[:5])}")


def _prompt_caps(caps, prompts: int, limit: int) -> list[int] | None:
    """Per-prompt caps on new tokens, checked (None: no caps)."""
    if caps is None:
        return None
    caps = [int(c) for c in caps]
    if len(caps) != prompts:
        raise ValueError(f"max_new_tokens: {len(caps)} caps for {prompts} prompts")
    bad = [c for c in caps if not 1 <= c <= limit]
    if bad:
        raise ValueError(f"max_new_tokens: caps must be in 1..{limit} (the sampling "
                         f"max_new_tokens), got {bad[:5]}")
    return caps


def _prompt_seeds(seeds, prompts: int) -> list[int] | None:
    """Per-prompt draw seeds, checked (None: none)."""
    if seeds is None:
        return None
    seeds = [int(s) for s in seeds]
    if len(seeds) != prompts:
        raise ValueError(f"prompt_seeds: {len(seeds)} seeds for {prompts} prompts")
    if any(not 0 <= s < (1 << SEED_BITS) for s in seeds):
        raise ValueError(f"prompt_seeds: seeds must be in [0, 2^{SEED_BITS})")
    return seeds


class RolloutEngine:
    """``RolloutEngine(model, eos_token_id=None, pad_token_id=0, weights_path=None,
    kv_budget_tokens=None, max_rows=64, prefix_cache_tokens=0, keep_kv=False,
    gpu_memory_utilization=0.9, weight_dtype="bf16", fp8_scales="channel",
    shares_training_weights=False, kv_cache_dtype="bf16")``; ``kv_budget_tokens``: None (static
    batches), a KV size in tokens, or ``"auto"`` (planned, see the module docstring).
    ``weight_dtype="fp8"``: the decoder linears run on FP8 copies of their weights
    (``inference/fp8``; ``fp8_scales``: block | channel), re-quantized after every load and
    after :meth:`weights_changed`;
    ``shares_training_weights``: the model is the actor's (FP8 only inside generate).
    ``kv_cache_dtype="fp8"``: the continuous engine's KV pool in e4m3 with per-(position, head)
    scales (``pool_cache``; static batches keep the model's dtype)."""

    def __init__(self, model, *, eos_token_id: int | list[int] | None = None,
                 pad_token_id: int = 0, weights_path: str | None = None,
                 kv_budget_tokens: int | str | None = None, max_rows: int = 64,
                 prefix_cache_tokens: int = 0, keep_kv: bool = False,
                 gpu_memory_utilization: float = DEFAULT_GPU_MEMORY_UTILIZATION,
                 weight_dtype: str = "bf16", fp8_scales: str = "channel",
                 shares_training_weights: bool = False, kv_cache_dtype: str = "bf16"):
        if model.head_kind != "causal_lm":
            raise TypeError(f"{type(model).__name__} has no LM head; a rollout engine needs a "
                            "CausalLM")
        self.model = model
        # the layout the model was built in (training, or the hybrid engine's TP'): generation
        # communicates over its TP group only (and refuses PP > 1 when asked to generate)
        self.parallel_layout = model.parallel_layout
        self.eos_token_id = eos_token_id
        self.pad_token_id = pad_token_id
        self.weights_path = weights_path
        self.version = 0
        self.generated_tokens = 0
        self.batches = 0
        if isinstance(kv_budget_tokens, str) and kv_budget_tokens != "auto":
            raise ValueError(f"kv_budget_tokens must be a token count or 'auto', got "
                             f"{kv_budget_tokens!r}")
        self.kv_budget_tokens = kv_budget_tokens
        self.gpu_memory_utilization = gpu_memory_utilization
        self.memory_plan = None  # the last plan (CUDA), for logs and metrics
        self.max_rows = max_rows
        self.prefix_cache_tokens = prefix_cache_tokens
        self.keep_kv = keep_kv
        from parallel_models.inference.kv_quant import check_kv_cache_dtype

        self.kv_cache_dtype = check_kv_cache_dtype(kv_cache_dtype)  # (now, not at the first pool)
        if kv_cache_dtype == "fp8" and not kv_budget_tokens:
            log.warning("kv_cache_dtype=fp8: static batches (no kv_budget_tokens) keep their KV "
                        "cache in the model's dtype; the fp8 pool is the continuous engine's")
        self._continuous = None
        # weight_dtype="fp8": the linears run on FP8 copies of their weights (inference/fp8),
        # refreshed after every load / sync; on the actor's own weights only inside generate
        if weight_dtype not in ("bf16", "fp8"):
            raise ValueError(f"weight_dtype must be bf16 or fp8, got {weight_dtype!r}")
        self.fp8 = None
        if weight_dtype == "fp8":
            from parallel_models.inference.fp8 import Fp8Linears

            self.fp8 = Fp8Linears(model, fp8_scales, active=not shares_training_weights)
            log.info("fp8 rollout: %d linears on FP8 copies (%.2f GiB, %s scales)",
                     len(self.fp8.modules), self.fp8.weight_bytes / 2**30, fp8_scales)

    @property
    def continuous(self) -> bool:
        return bool(self.kv_budget_tokens)

    def continuous_engine(self, longest_prompt: int | None = None,
                          longest_row: int | None = None, rows: int | None = None,
                          kv_budget_tokens: int | str | None = None):
        """The :class:`~parallel_models.inference.continuous.ContinuousEngine` (made on first
        use), its KV pool and prefill chunk planned for requests whose
        longest prompt / row (prompt + new tokens) are given (default: the model's positions)
        and ``rows`` samples (default ``max_rows``); ``kv_budget_tokens`` (a static engine's
        caller, e.g. multi-turn rollouts): the budget instead of the engine's own."""
        if self.fp8 is not None:
            self.fp8.refresh_if_stale()
        if self._continuous is None:
            from parallel_models.inference.continuous import ContinuousEngine

            budget, chunk = self._plan(longest_prompt, longest_row, rows,
                                       kv_budget_tokens or self.kv_budget_tokens)
            self._continuous = ContinuousEngine(
                self.model, budget, max_rows=self.max_rows,
                prefix_cache_tokens=self.prefix_cache_tokens, max_prefill_tokens=chunk,
                kv_cache_dtype=self.kv_cache_dtype)
            self._continuous.on_tokens = self._count_tokens
        return self._continuous

    def _plan(self, longest_prompt, longest_row, rows, budget) -> tuple[int, int]:
        """(KV tokens, prefill chunk) of the continuous engine: the memory plan on CUDA
        (``memory_plan.plan_for_model``), else the explicit budget (``"auto"``: every row at
        once) and the default chunk."""
        from parallel_models.inference.continuous import DEFAULT_MAX_PREFILL_TOKENS
        from parallel_models.inference.memory_plan import plan_for_model

        explicit = None if budget == "auto" else int(budget)
        if longest_row is None:  # (the server: requests unknown) a row as long as allowed
            positions = int(getattr(self.model.config, "max_position_embeddings", 0)
                            or explicit or DEFAULT_MAX_PREFILL_TOKENS)
            longest_row = min(positions, explicit or positions)
            longest_prompt = min(longest_row - 1, DEFAULT_MAX_PREFILL_TOKENS)
        rows = min(self.max_rows, rows or self.max_rows)
        plan = plan_for_model(self.model, utilization=self.gpu_memory_utilization,
                              longest_prompt=longest_prompt, longest_row=longest_row, rows=rows,
                              max_prefill_tokens=DEFAULT_MAX_PREFILL_TOKENS,
                              kv_budget_tokens=explicit, kv_cache_dtype=self.kv_cache_dtype)
        if plan is None:  # no device memory to plan (CPU)
            return explicit or rows * longest_row, DEFAULT_MAX_PREFILL_TOKENS
        self.memory_plan = plan
        log.info("rollout memory plan: %s", plan.describe())
        return plan.kv_tokens, plan.prefill_tokens

    def _count_tokens(self, count: int) -> None:
        self.generated_tokens += count

    @property
    def device(self) -> torch.device:
        return self.model.device

    # ---- generation ------------------------------------------------------------------------
    def stop_ids(self, params: SamplingParams) -> list[int]:
        return params.stop_ids(self.eos_token_id)

    def generate(self, prompts: Sequence[Sequence[int]], params: SamplingParams,
                 generator: torch.Generator | None = None, top_logprobs: int = 0,
                 on_step=None, record_routes: bool = False,
                 max_new_tokens: Sequence[int] | None = None,
                 prompt_seeds: Sequence[int] | None = None,
                 stop_sequences: Sequence[Sequence[int]] | None = None) -> GenerationOutput:
        """``params.n`` samples of each prompt (rows prompt-major). A ``params.seed`` seeds a
        generator of its own unless ``generator`` is given. ``top_logprobs=k`` also returns the
        k most likely tokens per step; ``on_step`` sees each step's tokens as they are drawn
        (``generation.generate``); ``record_routes`` (MoE) also returns the experts every token
        was routed to (``GenerationOutput.routes``; recorded by the static batcher).
        ``max_new_tokens``: per prompt, a cap on its samples' new tokens (each in
        1..``params.max_new_tokens``). ``prompt_seeds``: one seed per prompt (e.g.
        ``row_sampling.prompt_seed``); sample j of prompt i then draws with the noise of
        ``row_seed(prompt_seeds[i], j)``, the same tokens in the static and the continuous
        batcher, whatever else is in the batch (``params.seed`` and ``generator`` unused).
        ``stop_sequences``: token-id sequences that end a sample too (kept in it; e.g. the ids of
        ``</tool_call>``), in both batchers (``stop_sequences.py``)."""
        # fp8: the FP8 copies refreshed if the weights changed, and on for the call
        with self.fp8.enabled() if self.fp8 is not None else contextlib.nullcontext():
            return self._generate(prompts, params, generator, top_logprobs, on_step,
                                  record_routes, max_new_tokens, prompt_seeds, stop_sequences)

    def _generate(self, prompts, params, generator, top_logprobs, on_step, record_routes,
                  max_new_tokens, prompt_seeds, stop_sequences) -> GenerationOutput:
        caps = _prompt_caps(max_new_tokens, len(prompts), params.max_new_tokens)
        seeds = _prompt_seeds(prompt_seeds, len(prompts))
        if params.greedy:  # no noise to draw: the greedy path as without seeds
            seeds = None
        if self.continuous and on_step is None and not record_routes:
            return self._generate_continuous(prompts, params, generator, top_logprobs, caps,
                                             seeds, stop_sequences)
        rows = [list(p) for p in prompts for _ in range(params.n)]
        update = {"n": 1} if caps is None else {"n": 1, "max_new_tokens": max(caps)}
        one_each = params.model_copy(update=update)  # (a seed makes generate's generator)
        out = generate(self.model, rows, one_each, generator=generator,
                       stop_token_ids=self.stop_ids(params), pad_token_id=self.pad_token_id,
                       top_logprobs=top_logprobs, on_step=on_step, record_routes=record_routes,
                       row_limits=None if caps is None else
                       [c for c in caps for _ in range(params.n)],
                       row_seeds=None if seeds is None else
                       [row_seed(s, j) for s in seeds for j in range(params.n)],
                       stop_sequences=stop_sequences)
        self.generated_tokens += int(out.response_mask.sum())
        return out

    def _generate_continuous(self, prompts, params, generator, top_logprobs, caps=None,
                             seeds=None, stop_sequences=None):
        from parallel_models.inference.continuous import generation_output, request_seed

        lengths = [len(p) for p in prompts]
        longest = max((len(p) + (params.max_new_tokens if caps is None else c)
                       for p, c in zip(prompts, caps or [None] * len(prompts))), default=2)
        engine = self.continuous_engine(max(lengths, default=1), longest,
                                        len(prompts) * params.n)
        stop = self.stop_ids(params)
        try:
            requests = []
            for i, p in enumerate(prompts):
                if seeds is not None:  # the prompt's own seed (row_seed(seed, j) per sample)
                    update = {"seed": seeds[i]}
                else:
                    seed = params.seed
                    if seed is None and not params.greedy:
                        seed = int(torch.randint(0, 1 << 62, (1,), generator=generator))
                    update = {"seed": request_seed(seed, i)}
                if caps is not None:
                    update["max_new_tokens"] = caps[i]
                one = params.model_copy(update=update)
                requests.append(engine.submit(p, one, stop_ids=stop, top_logprobs=top_logprobs,
                                              stop_sequences=stop_sequences))
            engine.run()
        finally:
            if not self.keep_kv:
                self._continuous = None
        out = generation_output(requests, self.pad_token_id)
        device = self.device
        return type(out)(**{f: (v.to(device) if torch.is_tensor(v) else v)
                             for f, v in vars(out).items()})

    def generate_samples(self, prompts: Sequence[Sequence[int]], params: SamplingParams,
                         top_logprobs: int = 0, on_step=None, record_routes: bool = False,
                         max_new_tokens: Sequence[int] | None = None,
                         prompt_seeds: Sequence[int] | None = None,
                         stop_sequences: Sequence[Sequence[int]] | None = None) -> list[dict]:
        """Like :meth:`generate`, as one ``{"token_ids", "log_probs", "finish_reason"}`` dict per
        row (``"stop"`` when the last token is a stop id or it ends with one of
        ``stop_sequences``, else ``"length"``); ``top_logprobs=k``
        adds ``"top_logprobs"``: per token a list of k ``[token_id, log_prob]``, most likely
        first; ``record_routes`` (MoE) adds ``"routes"``: per prompt and generated token, per MoE
        layer, the k experts used (-1 where none: the last generated token)."""
        out = self.generate(prompts, params, top_logprobs=top_logprobs, on_step=on_step,
                            record_routes=record_routes, max_new_tokens=max_new_tokens,
                            prompt_seeds=prompt_seeds, stop_sequences=stop_sequences)
        stops = set(self.stop_ids(params))
        sequences = check_stop_sequences(stop_sequences)
        mask, toks = out.response_mask.cpu(), out.responses.cpu()
        logps = out.log_probs.float().cpu()
        samples = []
        for b in range(toks.shape[0]):
            k = int(mask[b].sum())
            ids = toks[b, :k].tolist()
            samples.append({"token_ids": ids, "log_probs": logps[b, :k].tolist(),
                            "finish_reason": "stop" if ids and (ids[-1] in stops or
                                                                ends_with_stop_sequence(
                                                                    ids, sequences))
                            else "length"})
        if out.routes is not None:
            from parallel_models.utils.routes import expand

            real = out.attention_mask.bool().cpu()
            routes = expand(out.routes.cpu())
            for b, sample in enumerate(samples):
                sample["routes"] = routes[b][real[b]].tolist()
        if out.top_token_ids is not None:
            top_ids, top_logps = out.top_token_ids.cpu(), out.top_log_probs.float().cpu()
            for b, sample in enumerate(samples):
                k = len(sample["token_ids"])
                sample["top_logprobs"] = [[list(pair) for pair in zip(i, v)] for i, v in
                                          zip(top_ids[b, :k].tolist(), top_logps[b, :k].tolist())]
        return samples

    # ---- weights -----------------------------------------------------------------------------
    def weights_changed(self) -> None:
        """The model's weights were changed from outside (a weight sync, the actor's step): an
        FP8 rollout re-quantizes them before it generates next."""
        if self.fp8 is not None:
            self.fp8.mark_stale()

    def _tensors(self) -> list[tuple[str, torch.Tensor]]:
        named = list(self.model.named_parameters()) + list(self.model.named_buffers())
        seen, out = set(), []
        for name, t in named:
            if id(t) not in seen:  # tied weights once
                seen.add(id(t))
                out.append((name, t))
        return out

    def _snapshot(self) -> list[torch.Tensor]:
        # host copies on CUDA (the accelerator holds the model, the host has room), else clones
        host = self.device.type == "cuda"
        return [t.detach().to("cpu", copy=True) if host else t.detach().clone()
                for _, t in self._tensors()]

    @torch.no_grad()
    def _restore(self, snapshot: list[torch.Tensor]) -> None:
        for (_, t), saved in zip(self._tensors(), snapshot):
            t.copy_(saved)

    @staticmethod
    def _label(path) -> str:
        return repr(path) if isinstance(path, str) else getattr(path, "folder", "<memory>")

    def update_weights(self, path, group=None, keep_old: bool = True) -> dict:
        """Load ``path`` into the model, all or nothing. With ``group`` (a process group of every
        rank holding a shard; all call this together) the ranks agree: if loading fails on any
        of them, each restores its old shard. Returns ``{"weight_version", "path", "seconds"}``;
        raises :class:`WeightUpdateError` (the weights and version unchanged) on failure.
        ``keep_old=False``: no snapshot to restore (a model-sized copy); only for weights the
        caller already checked complete, of the right shapes and finite on every rank."""
        t0 = time.perf_counter()
        snapshot: list[torch.Tensor] | None = None
        error: BaseException | None = None
        try:
            if keep_old:  # before touching anything: an OOM here changes nothing
                snapshot = self._snapshot()
            load_weights(self.model, path)
        except Exception as exc:  # noqa: BLE001 - restored below, reported to the caller
            error = exc  # (the other ranks still take part in the vote below: no hang)
        failed = torch.tensor([0 if error is None else 1], dtype=torch.int32)
        if group is not None and dist.is_initialized() and dist.get_world_size(group) > 1:
            dist.all_reduce(failed, group=group)
        if self.fp8 is not None:  # (the restored weights too: the copies follow the weights)
            self.fp8.mark_stale()
        if int(failed):
            if snapshot is not None:
                self._restore(snapshot)
            if error is None:
                raise WeightUpdateError(f"loading {self._label(path)} failed on another rank; the previous "
                                        f"weights (version {self.version}) were kept")
            raise WeightUpdateError(f"{type(error).__name__}: {error} (the previous weights, "
                                    f"version {self.version}, were kept)") from error
        del snapshot
        if self.fp8 is not None:  # now: the server's batcher decodes without generate
            self.fp8.refresh()
        if self._continuous is not None:
            self._continuous.clear_prefixes()  # KV of the old weights
        self.version += 1
        self.weights_path = path if isinstance(path, str) else getattr(path, "folder", None)
        return {"weight_version": self.version, "path": self.weights_path,
                "seconds": round(time.perf_counter() - t0, 3)}


__all__ = ["RolloutEngine", "WeightUpdateError", "load_weights"]
