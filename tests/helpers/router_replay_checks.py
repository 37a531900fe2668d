"""Worker functions of the router-replay tests (tests/models/test_router_replay.py), run on gloo ranks:
the rollout engine records routes, the actor's old-log-prob forward compares / replays them.

Two tiny Qwen3-MoE models: ``plain`` (random routers) and ``near_tie`` (in every router the row
of expert 1 equals expert 0's plus ~3e-9 noise, so the two logits differ by less than float
rounding: the rollout's prefill + KV-cache decode and the training forward of the same tokens
then pick different experts for some tokens, as bf16 kernels do on the GPU)."""

from __future__ import annotations

import torch

NEAR_TIE = 3e-9


def save_models(root: str) -> dict:
    from safetensors.torch import load_file, save_file

    from parallel_models.testing import save_tiny_hf_model

    plain = save_tiny_hf_model(f"{root}/plain", "qwen3_moe", seed=1)
    tie = save_tiny_hf_model(f"{root}/near_tie", "qwen3_moe", seed=1)
    weights = load_file(f"{tie}/model.safetensors")
    g = torch.Generator().manual_seed(0)
    for name, w in weights.items():
        if name.endswith("mlp.gate.weight"):
            w[1] = w[0] + NEAR_TIE * torch.randn(w[0].shape, generator=g)
    save_file(weights, f"{tie}/model.safetensors", metadata={"format": "pt"})
    return {"plain": plain, "near_tie": tie}


def _prompts(seed: int) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(3, 250, (n,), generator=g).tolist() for n in (5, 9, 3, 12, 7, 4, 8, 6)]


def _rollout(model, seed: int):
    from parallel_models.rl.data.batch import RolloutBatch
    from parallel_models.inference.engine import RolloutEngine
    from parallel_models.inference.sampling import SamplingParams

    prompts = _prompts(seed)
    out = RolloutEngine(model).generate(prompts, SamplingParams(max_new_tokens=12, seed=seed),
                                        record_routes=True)
    return RolloutBatch(sequences=out.sequences, attention_mask=out.attention_mask,
                        prompt_lengths=out.prompt_mask.sum(-1), response_mask=out.response_mask,
                        group_index=torch.arange(len(prompts)),
                        rollout_log_probs=out.log_probs, routes=out.routes)


def _max_diff(logp, batch) -> float:
    mask = batch.response_mask.bool()
    return float(torch.where(mask, logp - batch.rollout_log_probs, torch.zeros_like(logp))
                 .abs().max())


def replay_against_rollout(paths: dict, tp: int, ep: int, save_dir: str | None = None) -> dict:
    """Per model: log-prob max abs difference rollout vs old-log-prob forward and the route
    mismatch, with replay off and with R3 (rollout routes replayed), in two microbatch
    budgets; the routes R3 used vs the rollout's; ``plain`` also :func:`replay_identity`.
    ``save_dir``: rank 0 saves its rollout batches there (for :func:`replay_through_pipeline`)."""
    import parallel_models as pm
    from parallel_models.rl.roles.model_roles import PolicyRole
    from parallel_models.utils import routes as route_utils

    pm.init_parallel(tensor_parallel_size=tp, expert_model_parallel_size=ep)
    from megatron.core import parallel_state as mpu

    out = {}
    for name, path in paths.items():
        cls = pm.get_model_class(pm.registry.architecture_of(path), "causal_lm", rmpad=True)
        model = cls.from_pretrained(path, dtype=torch.float32)
        batch = _rollout(model, seed=11 + mpu.get_data_parallel_rank())
        if save_dir is not None and torch.distributed.get_rank() == 0:
            torch.save(dict(batch.tensor_items()), f"{save_dir}/{name}.pt")
        res = {"routes_dtype": str(batch.routes.dtype), "routes_shape": tuple(batch.routes.shape)}
        for budget in (40, 4096):
            role = PolicyRole(model, None, max_tokens=budget)
            logp = role.log_probs(batch)
            res[f"off_{budget}_diff"] = _max_diff(logp, batch)
            res[f"off_{budget}_mismatch"] = role.route_session.mismatch
            logp = role.log_probs(batch, replay=True, record=True)
            res[f"r3_{budget}_diff"] = _max_diff(logp, batch)
            used, given = route_utils.expand(role.recorded_routes), route_utils.expand(batch.routes)
            present = given[..., 0] >= 0
            res[f"r3_{budget}_routes_differ"] = int((used != given)[present].any(-1).sum())
            res[f"r3_{budget}_routes_compared"] = int(present.sum())
        if name == "plain":
            res["identity"] = replay_identity(model)
        out[name] = res
    return out


def replay_identity(model) -> dict:
    """Routes that agree change nothing: one forward + backward without replay (recording its
    routes), one replaying them; max abs differences of the logits and of every gradient."""
    from parallel_models.llama.layers import router_replay

    g = torch.Generator().manual_seed(5)
    ids = torch.randint(3, 250, (23,), generator=g)
    cu = torch.tensor([0, 9, 23], dtype=torch.int32)

    def run(routes, replay):
        model.zero_grad(set_to_none=True)
        with router_replay.routing(model, routes, [23], replay=replay, record=True) as session:
            logits = model(ids, cu).logits
            weights = torch.randn(logits.shape, generator=torch.Generator().manual_seed(7))
            (logits * weights[:, :logits.shape[1]]).sum().backward()
        grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
        return logits.detach(), grads, session

    logits0, grads0, first = run(None, False)
    logits1, grads1, second = run(first.recorded, True)
    grad_diff = max(float((grads0[n] - grads1[n]).abs().max()) for n in grads0)
    router_grads = sum(1 for n in grads0 if "router" in n and grads0[n].abs().sum() > 0)
    return {"logits": float((logits0 - logits1).abs().max()), "grads": grad_diff,
            "same_grad_keys": grads0.keys() == grads1.keys(), "router_grads": router_grads,
            "compared": second.compared, "differing": second.differing}


def replay_through_pipeline(paths: dict, save_dir: str) -> dict:
    """PP=2 (layers [0, 1] | [2]: an MoE layer on each stage): the old-log-prob forward of the
    saved rollout batches through megatron-core's schedule, off and R3 (each stage replays its
    own layers' routes; mismatch counts summed over the stages)."""
    import parallel_models as pm
    from parallel_models.rl.data.batch import RolloutBatch
    from parallel_models.rl.roles.model_roles import PolicyRole
    from parallel_models.utils import routes as route_utils

    pm.init_parallel(pipeline_parallel_size=2)
    out = {}
    for name, path in paths.items():
        batch = RolloutBatch(**torch.load(f"{save_dir}/{name}.pt"))
        cls = pm.get_model_class(pm.registry.architecture_of(path), "causal_lm", rmpad=True,
                                 pp=True)
        chunk = pm.build_pipeline_chunks(cls, path, dtype=torch.float32,
                                         layers_per_stage=[2, 1])[0]
        role = PolicyRole(chunk, None, max_tokens=40)
        res = {"off_diff": _max_diff(role.log_probs(batch), batch),
               "off_mismatch": role.route_session.mismatch}
        res["r3_diff"] = _max_diff(role.log_probs(batch, replay=True, record=True), batch)
        used, given = route_utils.expand(role.recorded_routes), route_utils.expand(batch.routes)
        res["r3_routes"] = route_utils.share_differing(used, given)
        res["stage_layers"] = sorted({int(layer) for layer in
                                      (used[..., 0] >= 0).nonzero()[:, 2].tolist()})
        out[name] = res
    return out


def inprocess_greedy_routes(path: str, prompts: list[list[int]], max_new_tokens: int) -> dict:
    """The in-process engine's greedy rollout of ``prompts`` with routes (server reference)."""
    import parallel_models as pm
    from parallel_models.inference.engine import RolloutEngine
    from parallel_models.inference.sampling import SamplingParams

    pm.init_parallel()
    cls = pm.get_model_class(pm.registry.architecture_of(path), "causal_lm", rmpad=True)
    model = cls.from_pretrained(path, dtype=torch.float32)
    out = RolloutEngine(model).generate(
        prompts, SamplingParams(max_new_tokens=max_new_tokens, greedy=True, ignore_eos=True),
        record_routes=True)
    return {"sequences": out.sequences, "routes": out.routes}
