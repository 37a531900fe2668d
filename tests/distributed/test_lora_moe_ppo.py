"""LoRA PPO on the built-in tiny Qwen3-MoE (actor and critic adapters on attention and every
routed expert): the run at expert parallel 2 (experts and their adapters split over the two
data-parallel ranks, adapter gradients reduced over the expert-data-parallel group) equals the
EP=1, DP=2 run step for step (rel <= 1e-5), and the second step's reference (adapters off)
has moved away from the actor."""

from parallel_models.testing import run_distributed
from tests.helpers import hybrid_checks
from tests.helpers.hybrid_ppo_runs import ABS_FLOOR, REL

RUN = ["model.path=builtin-moe", "trainer.total_steps=2", "data.batch_size=4", "rollout.n=2",
       "actor.mini_batch_size=8", "rollout.max_new_tokens=6", "actor.ppo_epochs=1",
       "rollout.greedy=true", "trainer.seed=3", "actor.lora.rank=4", "critic.lora.rank=4",
       "actor.lr=1e-2", "critic.lr=1e-2"]


def _metrics(tmp_path, name, extra):
    rows = run_distributed(hybrid_checks.ppo_metrics, 2, str(tmp_path / name), RUN + extra,
                           timeout=400)[0]
    return [{k: v for k, v in m.items() if not k.startswith(("timing/", "memory/"))}
            for m in rows]


def test_lora_on_moe_experts_ep2_equals_ep1(tmp_path):
    want = _metrics(tmp_path, "ep1", [])
    got = _metrics(tmp_path, "ep2", ["parallel.expert_parallel_size=2"])
    assert len(got) == len(want) == 2
    for step, (g, w) in enumerate(zip(got, want)):
        assert g.keys() == w.keys(), (step, sorted(set(g) ^ set(w)))
        for k in w:
            tol = REL * max(abs(w[k]), abs(g[k])) + ABS_FLOOR
            assert abs(g[k] - w[k]) <= tol, f"step {step + 1} {k}: EP=2 {g[k]} vs EP=1 {w[k]}"
    assert want[1]["kl/actor_ref"] > 0 and want[1]["critic/grad_norm"] > 0
