"""Per-row reproducible sampling: for continuous batching, and for rollouts whose samples must not
depend on the layout (the static batcher with per-row seeds, ``generation.generate``).

In a continuous batch the rows next to a sample change from step to step, so drawing from one
generator for the whole batch would make a seeded request's samples depend on the traffic. Here
every row draws with counter-based noise: the uniform for (row seed, step, vocab id) is a hash
(splitmix64) of those three integers, and the token is the Gumbel-max of the filtered logits,
i.e. a draw from ``softmax(filtered logits / temperature)``. A request's samples are therefore
the same whatever else runs, on any device, and a step needs no generator state (graph-safe).

A PPO step seeds prompt i of its global batch with :func:`prompt_seed` (run seed, step, i) and
sample j of it with :func:`row_seed` (prompt seed, j): the tokens are then the same at any TP /
PP / DP layout, rollout TP', static or continuous batching, and after a resume elsewhere.

Log-probs and top log-probs are those of ``generation._next_tokens``: ``log_softmax(logits /
temperature)`` of the drawn token (greedy: of the raw logits).

Fused picks: when a group asks for no top-k / top-p filter and no top log-probs, its token and
log-prob need only ``argmax(logits / T + noise)`` and ``logits[token] / T - logsumexp(logits /
T)``; :func:`greedy_pick` / :func:`sampled_pick` compute just that, and on CUDA run through
``torch.compile`` (``utils/gpu_compile``): one or two reductions reading the bf16 logits once,
instead of an fp32 copy, a full-vocab log-softmax and a dozen int64 noise passes over ``[rows,
vocab]``. Same math (the same noise function); the log-prob differs from the general path's only
by the rounding of the sum. The option ``fused_draw`` off (``PARALLEL_MODELS_FUSED_DRAW=0``)
switches them off (benches compare; read at each draw).
"""

from __future__ import annotations

import warnings

import torch

from parallel_models.llama.layers import exact
from parallel_models.options import option
from parallel_models.utils.gpu_compile import compiled_on_gpu

_C1 = 0xBF58476D1CE4E5B9 - (1 << 64)
_C2 = 0x94D049BB133111EB - (1 << 64)
_GOLDEN = 0x9E3779B97F4A7C15 - (1 << 64)


def filter_logits(logits: torch.Tensor, top_k: int, top_p: float) -> torch.Tensor:
    """``logits`` with the tokens outside the top-k / top-p set at -inf (0 / 1.0: no filter)."""
    if top_k and top_k < logits.shape[-1]:
        kth = torch.topk(logits, top_k, dim=-1).values[..., -1:]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if top_p < 1.0:
        sorted_logits, order = torch.sort(logits, descending=True, dim=-1)
        probs = torch.softmax(sorted_logits, dim=-1)
        # drop a token when the mass before it already reaches top_p (the top one always stays)
        drop = probs.cumsum(-1) - probs >= top_p
        sorted_logits = sorted_logits.masked_fill(drop, float("-inf"))
        logits = torch.full_like(logits, float("-inf")).scatter(-1, order, sorted_logits)
    return logits


def _shr(x: torch.Tensor, s: int) -> torch.Tensor:
    """Logical right shift of int64 (torch's ``>>`` is arithmetic)."""
    return (x >> s) & ((1 << (64 - s)) - 1)


def _mix(x: torch.Tensor) -> torch.Tensor:
    """splitmix64's finalizer on int64 with wrapping products."""
    x = (x ^ _shr(x, 30)) * _C1
    x = (x ^ _shr(x, 27)) * _C2
    return x ^ _shr(x, 31)


def row_seed(seed: int, sample: int) -> int:
    """The noise seed of sample ``sample`` of a request seeded with ``seed`` (a Python int)."""
    x = torch.tensor([(seed * 1_000_003 + sample) & ((1 << 63) - 1)], dtype=torch.long)
    return int(_mix(_mix(x) + _GOLDEN))


SEED_BITS = 62  # prompt seeds are in [0, 2^62): the server's seed range


def prompt_seed(run_seed: int, step: int, index: int) -> int:
    """The seed of prompt ``index`` (its place in the step's global batch) of step ``step`` of a
    run seeded with ``run_seed``: splitmix64 over the three integers, in [0, 2^62). A rollout
    draws sample ``j`` of the prompt with :func:`row_seed` ``(prompt_seed, j)``, so which rank,
    TP / PP / DP layout or rollout engine generates it does not change its tokens."""
    x = torch.tensor([int(run_seed) & ((1 << 63) - 1)], dtype=torch.long)
    for value in (step, index):
        x = _mix(x + _GOLDEN) ^ (int(value) & ((1 << 63) - 1))
    return int(_mix(x + _GOLDEN)) & ((1 << SEED_BITS) - 1)


def golden_tensor(device) -> torch.Tensor:
    """The 0-d int64 tensor of splitmix64's increment, for :func:`gumbel_noise`'s ``golden``."""
    return torch.full((), _GOLDEN, dtype=torch.long, device=device)


def gumbel_noise(seeds: torch.Tensor, steps: torch.Tensor, vocab: int,
                 golden: torch.Tensor | None = None) -> torch.Tensor:
    """``[B, vocab]`` float32 Gumbel(0, 1) noise, a pure function of (seed, step, vocab id).

    The vocab ids are multiplied by ``golden`` (:func:`golden_tensor`), a tensor and not a Python
    constant: under ``torch.compile`` ``arange * constant`` becomes an index expression, which
    inductor emits with 32-bit indices (``Scalar ... out of range for type int32`` from Triton,
    wrong values where it compiles); a tensor operand keeps the product an int64 tensor product
    with the same wrapping values."""
    if golden is None:
        golden = golden_tensor(seeds.device)
    base = _mix(_mix(seeds + _GOLDEN * steps) ^ steps)  # [B]
    ids = torch.arange(vocab, device=seeds.device, dtype=torch.long) * golden
    bits = _mix(base[:, None] + ids[None, :])
    u = (_shr(bits, 40).float() + 0.5) * (1.0 / (1 << 24))  # (0, 1), 24 bits
    return -torch.log(-torch.log(u))


def seeded_noise_logits(logits: torch.Tensor, params, row_seeds: torch.Tensor,
                        step: int) -> torch.Tensor:
    """``logits`` ``[B, vocab]`` at ``params``' temperature, top-k / top-p filtered, plus the
    Gumbel noise of (row seed, ``step``): their argmax is :func:`draw`'s token, so an engine that
    decodes greedily over these (transformers' ``generate`` with a logits processor) samples the
    very tokens of ours."""
    scaled = logits.float() / params.temperature
    filtered = filter_logits(scaled, params.top_k, params.top_p)
    steps = torch.full_like(row_seeds, int(step))
    return filtered + gumbel_noise(row_seeds, steps, logits.shape[-1])


def _greedy_pick(logits: torch.Tensor):
    x = logits.float()
    tokens = x.argmax(-1)
    return tokens, x.gather(-1, tokens[:, None]).squeeze(-1) - torch.logsumexp(x, -1)


def _sampled_pick(logits: torch.Tensor, seeds: torch.Tensor, steps: torch.Tensor,
                  temperature: float, golden: torch.Tensor):
    scaled = logits.float() / temperature
    tokens = (scaled + gumbel_noise(seeds, steps, logits.shape[-1], golden)).argmax(-1)
    return tokens, scaled.gather(-1, tokens[:, None]).squeeze(-1) - torch.logsumexp(scaled, -1)


greedy_pick = compiled_on_gpu(_greedy_pick)
_compiled_sampled_pick = compiled_on_gpu(_sampled_pick)


def sampled_pick(logits: torch.Tensor, seeds: torch.Tensor, steps: torch.Tensor,
                 temperature: float):
    """(tokens, log-probs) of the Gumbel-max draw at ``temperature`` (compiled on CUDA)."""
    return _compiled_sampled_pick(logits, seeds, steps, temperature,
                                  golden_tensor(logits.device))


_FUSED_FAILED = []  # the first failure of a fused pick (e.g. its compilation): general path


def fused_draw_enabled() -> bool:
    return option("fused_draw") and not _FUSED_FAILED


def _fused(params, logits, seeds, steps):
    """(tokens, log-probs) by a fused pick, or None where it does not apply or failed once."""
    try:
        if params.greedy:
            return greedy_pick(logits)
        if not params.top_k and params.top_p >= 1.0:
            return sampled_pick(logits, seeds, steps, float(params.temperature))
    except Exception as exc:  # noqa: BLE001 - the general path computes the same draw
        _FUSED_FAILED.append(exc)
        warnings.warn(f"fused draw disabled, using the general path: {type(exc).__name__}: {exc}")
    return None


def draw(logits: torch.Tensor, seeds: torch.Tensor, steps: torch.Tensor, groups, top_k_max: int):
    """Next tokens of every row of ``logits`` ``[B, vocab]``.

    ``groups``: list of ``(rows, params)`` with ``rows`` a LongTensor of row indices (None = all
    rows) sharing the :class:`SamplingParams` ``params``; rows in no group get token 0;
    ``seeds`` / ``steps`` may be None when every group is greedy.
    -> ``(tokens [B], log_probs [B] float32, top (ids, log-probs) [B, top_k_max] or None)``.
    """
    b, vocab = logits.shape
    if (not top_k_max and fused_draw_enabled() and len(groups) == 1 and groups[0][0] is None
            and not exact.enabled()):  # exact mode: the log-prob of the training side's kernel
        picked = _fused(groups[0][1], logits, seeds, steps)
        if picked is not None:
            return (*picked, None)
    raw, logits = logits, logits.float()  # raw: exact mode's log-prob reads the model's dtype
    tokens = torch.zeros(b, dtype=torch.long, device=logits.device)
    logp = torch.zeros(b, dtype=torch.float32, device=logits.device)
    top_ids = top_vals = None
    if top_k_max:
        k = min(top_k_max, vocab)
        top_ids = torch.zeros(b, k, dtype=torch.long, device=logits.device)
        top_vals = torch.zeros(b, k, dtype=torch.float32, device=logits.device)
    for rows, params in groups:
        sub = logits if rows is None else logits[rows]
        if params.greedy:
            scaled = sub
            chosen = sub.argmax(-1)
        else:
            scaled = sub / params.temperature
            filtered = filter_logits(scaled, params.top_k, params.top_p)
            s = seeds if rows is None else seeds[rows]
            t = steps if rows is None else steps[rows]
            chosen = (filtered + gumbel_noise(s, t, vocab)).argmax(-1)
        all_logp = torch.log_softmax(scaled, -1)
        chosen_logp = all_logp.gather(-1, chosen[:, None]).squeeze(-1)
        if exact.enabled():  # the training loss's log-prob kernel (layers/exact)
            from parallel_models.llama.layers.exact import ops

            chosen_logp = ops.token_log_probs(raw if rows is None else raw[rows], chosen,
                                              1.0 if params.greedy else params.temperature)
        if rows is None:
            tokens, logp = chosen, chosen_logp
        else:
            tokens[rows], logp[rows] = chosen, chosen_logp
        if top_k_max:
            vals, ids = torch.topk(all_logp, top_ids.shape[1], -1)
            if rows is None:
                top_ids, top_vals = ids, vals
            else:
                top_ids[rows], top_vals[rows] = ids, vals
    top = (top_ids, top_vals) if top_k_max else None
    return tokens, logp, top


__all__ = ["SEED_BITS", "draw", "filter_logits", "fused_draw_enabled", "golden_tensor",
           "greedy_pick", "gumbel_noise", "prompt_seed", "row_seed", "sampled_pick",
           "seeded_noise_logits"]
