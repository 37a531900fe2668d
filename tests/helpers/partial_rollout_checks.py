"""Worker of the partial-rollout test (one gloo rank): the server's engine with
``partial_rollouts`` generates, a weight update lands between two decode steps, the rows go on;
returns each sample's tokens, log-probs and per-token weight versions, and transformers' log-probs
of every token recomputed under the weights that drew it (a full forward over the sample's
prefix), with the greedy choice of those weights."""

from __future__ import annotations

import torch

PROMPTS = [[5, 9, 14, 3, 22], [40, 41, 7], [11, 12, 13, 14, 15, 16, 17]]
MAX_NEW, STEPS_BEFORE = 12, 4


def partial_update_run(first: str, second: str) -> dict:
    import parallel_models as pm
    from transformers import AutoModelForCausalLM

    from parallel_models.inference import RolloutEngine
    from parallel_models.inference.sampling import SamplingParams
    from parallel_models.inference.server.engine import Engine
    from parallel_models.inference.server.partial_rollout import TokenVersions

    pm.init_parallel(tensor_parallel_size=1)
    model = pm.AutoModelForCausalLM.from_pretrained(first, rmpad=True, dtype=torch.float32)
    rollout = RolloutEngine(model, eos_token_id=None, pad_token_id=0, weights_path=first,
                            kv_budget_tokens=256, max_rows=8, keep_kv=True)
    engine = Engine(rollout, 1)
    engine.partial_rollouts = True
    params = SamplingParams(greedy=True, max_new_tokens=MAX_NEW, ignore_eos=True, n=2)
    done, versions = [], []
    subs, hooks = [], []
    for prompt in PROMPTS:
        v = TokenVersions(params.n, lambda: engine.version)
        versions.append(v)
        subs.append((prompt, params, 0))
        hooks.append((v.record, done.append))
    engine.run_cstep(subs, hooks)
    for _ in range(STEPS_BEFORE - 1):
        engine.run_cstep([])
    old = engine.version
    engine.update_weights(second)
    while rollout.continuous_engine().has_work:
        engine.run_cstep([])
    by_version = {old: AutoModelForCausalLM.from_pretrained(first, dtype=torch.float32),
                  engine.version: AutoModelForCausalLM.from_pretrained(second, dtype=torch.float32)}
    out = []
    for req, v in zip(sorted(done, key=lambda r: PROMPTS.index(r.prompt)), versions):
        for j, sample in enumerate(req.samples):
            recomputed, greedy = [], []
            for t, (token, version) in enumerate(zip(sample.token_ids, v.versions[j])):
                ids = torch.tensor([req.prompt + sample.token_ids[:t]])
                with torch.no_grad():
                    logits = by_version[version](ids).logits[0, -1].float()
                recomputed.append(float(torch.log_softmax(logits, -1)[token]))
                greedy.append(int(logits.argmax()))
            out.append({"tokens": sample.token_ids, "log_probs": sample.log_probs,
                        "versions": v.versions[j], "recomputed": recomputed, "greedy": greedy})
    return {"samples": out, "old": old, "new": engine.version}
