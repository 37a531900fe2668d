"""How a rule reward function is called with the dataset's fields, and per-source reward metrics.

Every sampled response carries the record of the prompt it answers (one JSONL / Parquet row).
:func:`call_reward_function` passes those records to the function in the convention it declares:

* ``fn(prompts, responses, **columns)`` (this package's and TRL's convention): ``records=`` (one
  dict per response) plus one keyword per record field that the function accepts (all of them
  when it takes ``**kwargs``), e.g. ``ground_truth=[...]``, ``data_source=[...]``. A verl-style
  nested ``reward_model: {ground_truth: ...}`` also gives ``ground_truth``.
* ``fn(data_source, solution_str, ground_truth, extra_info=None)`` (verl's ``compute_score``):
  recognised by its ``solution_str`` parameter and called once per response; it may return a
  float or a dict with a ``"score"`` entry (other numeric entries become metrics).

Returns the scores and a dict of metrics, including ``reward/<data_source>/mean`` when the
records name their data source.
"""

from __future__ import annotations

import inspect
from collections import defaultdict
from typing import Any, Callable, Sequence

from parallel_models.rl.rewards.rules import reference_of

_RESERVED = {"prompts", "responses", "records"}


def _parameters(fn: Callable) -> tuple[set[str], bool]:
    try:
        params = inspect.signature(fn).parameters.values()
    except (TypeError, ValueError):  # builtins / C callables: pass everything
        return set(), True
    names = {p.name for p in params if p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY)}
    return names, any(p.kind == p.VAR_KEYWORD for p in params)


def record_columns(records: Sequence[dict]) -> dict[str, list]:
    """Record fields as columns (None where a record lacks one), plus ``ground_truth`` from
    :func:`~parallel_models.rl.rewards.rules.reference_of` when the records have it under another name."""
    keys: dict[str, None] = {}
    for rec in records:
        keys.update(dict.fromkeys(rec))
    columns = {k: [rec.get(k) for rec in records] for k in keys if k not in _RESERVED}
    if "ground_truth" not in columns:
        refs = [reference_of(rec) for rec in records]
        if any(r is not None for r in refs):
            columns["ground_truth"] = refs
    return columns


def _is_verl_style(names: set[str]) -> bool:
    return "solution_str" in names


def call_reward_function(fn: Callable, prompts: Sequence[str], responses: Sequence[str],
                         records: Sequence[dict] | None = None) -> tuple[list[float], dict]:
    """Scores of ``responses`` from ``fn`` (see the module docstring) and reward metrics."""
    records = list(records) if records is not None else [{} for _ in responses]
    if len(records) != len(responses):
        raise ValueError(f"{len(records)} records for {len(responses)} responses")
    names, takes_kwargs = _parameters(fn)
    extra_metrics: dict[str, list[float]] = defaultdict(list)
    if _is_verl_style(names):
        columns = record_columns(records)
        scores = []
        for i, response in enumerate(responses):
            kwargs = {"solution_str": response}
            for key in ("data_source", "ground_truth", "extra_info"):
                if key in names or takes_kwargs:
                    kwargs[key] = columns.get(key, [None] * len(records))[i]
            out = fn(**kwargs)
            if isinstance(out, dict):
                if "score" not in out:
                    raise ValueError(f"reward function {getattr(fn, '__name__', fn)!r} returned a "
                                     f"dict without 'score' (keys: {sorted(out)})")
                for k, v in out.items():
                    if k != "score" and isinstance(v, (int, float)):
                        extra_metrics[f"reward/{k}"].append(float(v))
                out = out["score"]
            scores.append(float(out))
    else:
        columns = record_columns(records)
        kwargs: dict[str, Any] = {"records": records} if ("records" in names or takes_kwargs) else {}
        kwargs.update({k: v for k, v in columns.items() if takes_kwargs or k in names})
        scores = [float(s) for s in fn(list(prompts), list(responses), **kwargs)]
    if len(scores) != len(responses):
        raise ValueError(f"reward function returned {len(scores)} scores for "
                         f"{len(responses)} responses")
    metrics = {k: sum(v) / len(v) for k, v in extra_metrics.items()}
    metrics.update(per_source_means(scores, [rec.get("data_source") for rec in records]))
    return scores, metrics


def per_source_means(scores: Sequence[float], sources: Sequence[Any]) -> dict[str, float]:
    """``reward/<source>/mean`` for every data source named (none when no record names one)."""
    by_source: dict[str, list[float]] = defaultdict(list)
    for score, source in zip(scores, sources):
        if source is not None:
            by_source[str(source)].append(float(score))
    return {f"reward/{src}/mean": sum(v) / len(v) for src, v in sorted(by_source.items())}


__all__ = ["call_reward_function", "record_columns", "per_source_means"]
