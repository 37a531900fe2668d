"""Worker for the parallel layout test: a training layout and a rollout layout of another TP in
the same ranks, their models interleaved, megatron-core's globals untouched (run on gloo ranks)."""

from __future__ import annotations

import torch


def _megatron_globals() -> dict:
    """megatron-core's parallel_state globals that hold data (groups, ranks, sizes), by name."""
    from megatron.core import parallel_state as mpu

    return {name: value for name, value in vars(mpu).items()
            if name.startswith("_") and name[1:2].isupper() and name.upper() == name
            and not callable(value) and not isinstance(value, type(mpu))}


def _changed(before: dict) -> list[str]:
    """The names whose value is no longer the same object as in ``before``."""
    now = _megatron_globals()
    return sorted(n for n in set(before) | set(now) if now.get(n, None) is not before.get(n, None))


def bad_rollout_sizes() -> list[str]:
    """The errors of rollout layouts that cannot fit the 2-rank world."""
    import parallel_models as pm
    from parallel_models.errors import ConfigError
    from parallel_models.inference.rollout_layout import build_rollout_layout

    pm.init_parallel()
    messages = []
    for tp in (3, 0):
        try:
            build_rollout_layout(tp)
        except ConfigError as err:
            messages.append(str(err))
    return messages


def two_layouts(path: str, train_tp: int, rollout_tp: int, train_ep: int = 1) -> dict:
    import parallel_models as pm
    from transformers import AutoModelForCausalLM

    from parallel_models.inference.generation import SamplingParams, generate
    from parallel_models.inference.rollout_layout import build_rollout_layout

    pm.init_parallel(tensor_parallel_size=train_tp, expert_model_parallel_size=train_ep)
    before = _megatron_globals()
    training = pm.training_layout()
    rollout = build_rollout_layout(rollout_tp)
    res = {"changed_by_build": _changed(before)}
    actor = pm.AutoModelForCausalLM.from_pretrained(path, rmpad=True, dtype=torch.float32)
    cls = pm.get_model_class(actor.architecture, "causal_lm", rmpad=True)
    engine_model = cls.from_pretrained(path, dtype=torch.float32, layout=rollout)
    res["changed_by_load"] = _changed(before)
    o_proj = engine_model.model.layers[0].self_attn.o_proj
    res["rollout_group_ok"] = (o_proj.tp_group is rollout.tp_group
                               and engine_model.parallel_layout is rollout
                               and actor.parallel_layout is training
                               and rollout.tp_group is not training.tp_group)
    res["qkv_rows"] = (actor.model.layers[0].self_attn.qkv_proj.weight.shape[0],
                       engine_model.model.layers[0].self_attn.qkv_proj.weight.shape[0])

    hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    g = torch.Generator().manual_seed(0)
    prompts = [torch.randint(3, 200, (n,), generator=g).tolist() for n in (5, 9, 3)]
    ids = torch.tensor([t for p in prompts for t in p])
    cu = torch.tensor([0, 5, 14, 17], dtype=torch.int32)

    def train_forward():
        with torch.no_grad():
            return actor(ids, cu, full_vocab=True).logits

    during: list = []

    def roll():
        out = generate(engine_model, prompts, SamplingParams(max_new_tokens=8, greedy=True),
                       on_step=lambda *a: during.append(_changed(before)))
        return out.responses

    alone_first = train_forward()
    responses_1 = roll()
    between = train_forward()  # a training forward after a rollout generate
    responses_2 = roll()
    res["changed_during_generate"] = sorted({n for c in during for n in c})
    res["changed_at_end"] = _changed(before)
    res["train_same_after_rollout"] = torch.equal(alone_first, between)
    res["rollout_same_after_train"] = torch.equal(responses_1, responses_2)
    with torch.no_grad():  # the training model against transformers, sequence by sequence
        res["train_vs_hf"] = max(
            (alone_first[s:e] - hf(ids[s:e].unsqueeze(0)).logits[0]).abs().max().item()
            for s, e in zip(cu[:-1].tolist(), cu[1:].tolist()))
    mismatches = []
    for b, p in enumerate(prompts):
        want = hf.generate(torch.tensor([p]), attention_mask=torch.ones(1, len(p), dtype=torch.long),
                           max_new_tokens=8, do_sample=False, pad_token_id=0)[0, len(p):]
        if want.tolist() != responses_1[b, :len(want)].tolist():
            mismatches.append(b)
    res["greedy_vs_hf_mismatches"] = mismatches
    res["responses"] = responses_1
    return res
