"""LoRA on the fsdp backend (peft's LoRA on the transformers model, FSDP2-sharded), actor and
critic: the first steps of the built-in job equal the megatron backend's LoRA run (same adapter
init; rollouts from the merged refill, reference = adapters off, losses, grad norms, KL, the
critic's value loss and grad norm over its adapters and whole value head; fp32), ``actor_lora/``
is read by peft and gives the merged ``actor_hf/``'s logits, ``critic_lora/`` (peft's SEQ_CLS
folder with the score head) gives the merged ``critic_hf/``'s values and the megatron critic's,
the checkpoint holds the adapters (and the critic's head) only and a run killed after it resumes
exactly."""

import json
import os

import pytest
import torch

from tests.helpers import lora_checks
from tests.helpers.ppo_runs import resume_after_kill_matches, run_metrics, run_ppo

COMMON = ["trainer.total_steps=2", "actor.ppo_epochs=1", "actor.mini_batch_size=32",
          "actor.lora.rank=8", "critic.lora.rank=8", "critic.lr=1e-2", "actor.lr=1e-2",
          "actor.use_kl_loss=true", "trainer.save_every=2",
          "trainer.loggers=[jsonl]"]


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    root = tmp_path_factory.mktemp("lora_fsdp")
    out = {}
    for backend in ("megatron", "fsdp"):
        out[backend] = str(root / backend)
        run_ppo([f"trainer.output_dir={out[backend]}", f"parallel.backend={backend}", *COMMON])
    return out


def test_fsdp_lora_steps_equal_megatron_lora(runs):
    meg, fsdp = run_metrics(runs["megatron"]), run_metrics(runs["fsdp"])
    assert len(meg) == len(fsdp) == 2
    for a, b in zip(meg, fsdp):
        for key in ("reward/mean", "response_length/mean", "actor/pg_loss", "actor/grad_norm",
                    "actor/kl_loss", "critic/vf_loss", "critic/grad_norm", "kl/actor_ref"):
            x, y = a[key], b[key]
            assert abs(x - y) <= 1e-5 * max(abs(x), 1e-2), f"step {a['step']} {key}: {x} vs {y}"
        # (the rollout-vs-training log-prob mismatch: rounding on both backends, 2^-21 .. 2^-20
        # here, so each is bounded rather than the two compared to 1e-7)
        assert max(a["rollout/logprob_diff_max"], b["rollout/logprob_diff_max"]) <= 1e-5
    # step 2 samples from the trained adapters (the refill merged them) and the reference
    # (adapters off) moved away from the actor
    assert fsdp[1]["kl/actor_ref"] > 0 and fsdp[1]["rollout/logprob_diff_max"] <= 1e-5


def test_fsdp_lora_export_is_read_by_peft_and_equals_the_merged_export(runs):
    out = runs["fsdp"]
    with open(os.path.join(out, "actor_lora", "adapter_config.json")) as f:
        cfg = json.load(f)
    assert cfg["r"] == 8 and cfg["peft_type"] == "LORA", cfg
    logits = lora_checks.exported_run_logits(out)
    got, before, merged = logits["peft"], logits["base"], logits["merged"]
    meg = lora_checks.hf_logits(os.path.join(runs["megatron"], "actor_hf"), logits["ids"])
    assert lora_checks.rel(got, merged) <= 1e-5
    assert lora_checks.rel(before, merged) > 1e-4, "training did not change the adapters"
    assert lora_checks.rel(meg, merged) <= 1e-4  # both backends trained the same adapters


def test_fsdp_lora_checkpoint_holds_only_the_adapters(runs):
    from torch.distributed.checkpoint import FileSystemReader

    folder = os.path.join(runs["fsdp"], "checkpoints", "step_000002", "dist")
    keys = list(FileSystemReader(folder).read_metadata().state_dict_metadata)
    actor = [k for k in keys if k.startswith("actor.model.")]
    assert actor and all(".lora_" in k for k in actor), actor[:5]
    critic = [k for k in keys if k.startswith("critic.model.")]
    assert critic and all(".lora_" in k or "score.modules_to_save" in k for k in critic), critic
    assert any("score.modules_to_save" in k for k in critic)  # the value head, trained whole


def test_fsdp_critic_lora_export_is_peft_seq_cls_and_equals_the_merged_export(runs):
    """``critic_lora/`` (peft's SEQ_CLS folder: adapters + ``score``) on the base gives the
    merged ``critic_hf/``'s values and the megatron backend's ``critic_lora/``'s."""
    from peft import PeftModel
    from safetensors.torch import load_file
    from transformers import AutoModelForSequenceClassification

    def values(folder, adapter=None):
        model = AutoModelForSequenceClassification.from_pretrained(
            folder, num_labels=1, dtype=torch.float32)
        if adapter is not None:
            model = PeftModel.from_pretrained(model, adapter).base_model.model
        hidden = model.model(input_ids=ids).last_hidden_state
        return model.score(hidden).squeeze(-1)

    fsdp, meg = runs["fsdp"], runs["megatron"]
    names = set(load_file(os.path.join(fsdp, "critic_lora", "adapter_model.safetensors")))
    assert names == set(load_file(os.path.join(meg, "critic_lora", "adapter_model.safetensors")))
    assert "base_model.model.score.weight" in names
    ids = torch.randint(3, 40, (2, 12), generator=torch.Generator().manual_seed(1))
    base = os.path.join(fsdp, "builtin_model")
    with torch.no_grad():
        got = values(base, os.path.join(fsdp, "critic_lora"))
        merged = values(os.path.join(fsdp, "critic_hf"))
        theirs = values(base, os.path.join(meg, "critic_lora"))
        before = values(base)
    assert lora_checks.rel(got, merged) <= 1e-5
    assert lora_checks.rel(before, merged) > 1e-4, "training did not change the critic"
    assert lora_checks.rel(theirs, got) <= 1e-4  # both backends trained the same critic


def test_fsdp_lora_run_resumes_after_kill(tmp_path):
    resume_after_kill_matches(tmp_path, ["parallel.backend=fsdp", "actor.lora.rank=8",
                                         "algorithm.adv_estimator=grpo", "critic.enable=false",
                                         "actor.use_kl_loss=true", "trainer.total_steps=3",
                                         "trainer.save_every=2", "trainer.save_hf_at_end=false",
                                         "trainer.loggers=[jsonl]"], steps=3)


def test_fsdp_lora_on_moe_is_the_megatron_backends(tmp_path):
    """On an MoE model (Qwen2-MoE: experts, shared expert, dense layer) the fsdp backend's peft
    LoRA has the megatron backend's adapters (names, shapes, A draws: the experts' as peft's
    target_parameters), its merged refill equals peft's merge, and our model gives its logits."""
    from parallel_models.testing import run_distributed, save_tiny_hf_model
    from tests.helpers import lora_moe_checks

    path = save_tiny_hf_model(str(tmp_path / "qwen2_moe"), "qwen2_moe", seed=1, router_scale=10.0)
    res = run_distributed(lora_moe_checks.fsdp_moe_lora_matches_megatron, 1, path)[0]
    assert res["names"] and res["a_equal"] and res["served_names"], res
    assert res["merged_keys"] and res["merged_diff"] <= 1e-6, res
    assert res["logits_rel"] <= 1e-5, res


def test_fsdp_lora_on_moe_experts_trains_what_the_rollout_samples(tmp_path):
    """A run of the built-in MoE with actor and critic LoRA (experts included) on the fsdp
    backend: step 2 samples from the trained adapters (the refill merged the experts' adapters
    and wrote the fused experts as the weight map reads them), so the rollout's log-probs are
    the training forward's."""
    out = str(tmp_path / "moe")
    run_ppo([f"trainer.output_dir={out}", "parallel.backend=fsdp", "model.path=builtin-moe",
             "trainer.total_steps=2", "actor.ppo_epochs=1", "actor.mini_batch_size=32",
             "actor.lora.rank=8", "critic.lora.rank=8", "actor.lr=1e-2", "actor.use_kl_loss=true",
             "trainer.save_every=0", "trainer.save_hf_at_end=false", "trainer.loggers=[jsonl]"])
    rows = run_metrics(out)
    assert rows[1]["kl/actor_ref"] != 0, "the adapters did not move the policy"
    assert all(r["rollout/logprob_diff_max"] <= 1e-5 for r in rows), rows
