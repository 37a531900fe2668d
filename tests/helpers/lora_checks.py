"""Worker functions of the LoRA tests (run on gloo ranks): our LoRA model against
``peft.get_peft_model`` on the transformers model with the same weights and adapters."""

from __future__ import annotations

import torch

from tests.helpers.model_checks import _batch
from tests.helpers.pipeline_checks import _ce_loss_fn, _microbatches_packed

RANK, ALPHA = 4, 8.0


def peft_lora_config(path: str, targets) -> dict:
    """PEFT's ``LoraConfig`` arguments for ``targets`` on ``path``: the names as given on a
    dense model; on an MoE model what our export writes (the experts' ``target_parameters``,
    the MLP names only where a linear MLP takes them)."""
    from parallel_models.config import ModelConfig
    from parallel_models.lora import LoraSettings
    from parallel_models.lora.apply import peft_adapter_config

    config = ModelConfig.from_hf(path)
    if not config.is_moe:
        return {"target_modules": targets}
    cfg = peft_adapter_config(LoraSettings(rank=RANK, alpha=ALPHA, target_modules=targets), config)
    return {k: cfg[k] for k in ("target_modules", "target_parameters") if k in cfg}


def peft_reference(path: str, targets, seed: int = 11):
    """The transformers model of ``path`` under PEFT LoRA (fp32), with nonzero B (N(0, 0.1)
    from ``seed``) so that the adapters change the output."""
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    torch.manual_seed(seed)
    peft_model = get_peft_model(hf, LoraConfig(r=RANK, lora_alpha=ALPHA, lora_dropout=0.0,
                                               **peft_lora_config(path, targets)))
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in peft_model.named_parameters():
            if "lora_B" in name:
                p.copy_(torch.randn(p.shape, generator=g) * 0.1)
    return peft_model


def peft_tensors(peft_model, grads: bool = False) -> dict:
    """PEFT's saved names -> adapter weights (or their gradients)."""
    out = {}
    for name, p in peft_model.named_parameters():
        if "lora_" in name:
            out[name.replace(".default", "")] = (p.grad if grads else p).detach().clone()
    return out


def _hf_loss(logits, ids, mask):
    labels = ids[:, 1:].masked_fill(~mask[:, 1:].bool(), -100)
    return torch.nn.functional.cross_entropy(logits[:, :-1].reshape(-1, logits.shape[-1]),
                                             labels.reshape(-1), ignore_index=-100)


def rel(a, b) -> float:
    return ((a - b).norm() / b.norm().clamp_min(1e-30)).item()


def hf_logits(folder: str, ids: torch.Tensor) -> torch.Tensor:
    """fp32 logits of the transformers model saved in ``folder``."""
    from transformers import AutoModelForCausalLM

    with torch.no_grad():
        return AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32)(
            input_ids=ids).logits


def exported_run_logits(out: str) -> dict:
    """A LoRA PPO run's exports read by transformers and peft on fixed ids: ``base``
    (``builtin_model/``), ``peft`` (``PeftModel.from_pretrained(base, actor_lora/)``) and
    ``merged`` (``actor_hf/``); ``ids``: the input ids."""
    import os

    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    ids = torch.randint(3, 40, (2, 12), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        base = AutoModelForCausalLM.from_pretrained(os.path.join(out, "builtin_model"),
                                                    dtype=torch.float32)
        before = base(input_ids=ids).logits
        peft = PeftModel.from_pretrained(base, os.path.join(out, "actor_lora"))(
            input_ids=ids).logits
    return {"ids": ids, "base": before, "peft": peft,
            "merged": hf_logits(os.path.join(out, "actor_hf"), ids)}


def build_lora_chunks(path: str, targets, peft_model):
    """Our PP-variant chunks of ``path`` with LoRA adapters holding ``peft_model``'s."""
    import parallel_models as pm
    from parallel_models.lora import LoraSettings, add_lora, load_adapter_tensors

    cls = pm.get_model_class(pm.registry.architecture_of(path), "causal_lm", rmpad=True, pp=True)
    chunks = pm.build_pipeline_chunks(cls, path, dtype=torch.float32)
    add_lora(chunks, LoraSettings(rank=RANK, alpha=ALPHA, target_modules=targets))
    load_adapter_tensors(chunks, peft_tensors(peft_model))
    return chunks


def check_lora_against_peft(path: str, targets, tp: int, sp: bool, pp: int, ep: int = 1,
                            grouped: bool | None = None) -> dict:
    """Logits and adapter gradients of our LoRA model vs PEFT's (relative errors; gradients
    compared on rank 0 after gathering), and the trainable counts of both (``full``: ours at
    PEFT's full size). ``grouped``: the MoE experts as grouped GEMMs (True) or megatron-core's
    loop over experts (False); None: the default."""
    import parallel_models as pm
    from parallel_models.lora import (adapter_parameter_count, gather_adapter_tensors,
                                      trainable_parameter_count)
    from parallel_models.options import set_options

    if grouped is not None:
        set_options({"moe_grouped_gemm": grouped})
    pm.init_parallel(tensor_parallel_size=tp, sequence_parallel=sp, pipeline_parallel_size=pp,
                     expert_model_parallel_size=ep)
    peft_model = peft_reference(path, targets)
    chunks = build_lora_chunks(path, targets, peft_model)
    ids, mask = _batch(chunks[0].config.vocab_size, "right", seed=3)
    pos = (mask.cumsum(-1) - 1).clamp(min=0)

    hf_logits = peft_model(input_ids=ids, attention_mask=mask, position_ids=pos).logits
    _hf_loss(hf_logits, ids, mask).backward()
    mbs = _microbatches_packed(ids, mask, 2)
    for mb in mbs:
        mb["full_vocab"] = True
    logits = torch.cat(pm.forward_only(chunks, [dict(mb) for mb in mbs]))
    pm.forward_backward(chunks, mbs, _ce_loss_fn)
    _reduce_like_ddp(chunks)
    grads = gather_adapter_tensors(chunks, grads=True)
    out = {"logits_rel": rel(logits, hf_logits.detach()[mask.bool()]),
           "trainable": trainable_parameter_count(chunks), "full": adapter_parameter_count(chunks),
           "frozen_grads": sum(p.grad is not None for c in chunks for p in c.parameters()
                               if not p.requires_grad)}
    if grads is not None:
        want = peft_tensors(peft_model, grads=True)
        out["grad_names"] = sorted(grads) == sorted(want)
        out["grad_rel"] = max(rel(grads[n], want[n]) for n in want)
        out["peft_trainable"] = sum(t.numel() for t in want.values())
    return out


def _reduce_like_ddp(chunks) -> None:
    """Sum the trainable gradients as megatron-core's DDP does: dense ones over the
    data-parallel group, expert ones (``allreduce=False``) over the expert-data-parallel group
    (every data-parallel rank ran the same batch, its loss divided by the DP size)."""
    import torch.distributed as dist
    from megatron.core import parallel_state as mpu

    for c in chunks:
        for p in c.parameters():
            if p.grad is None:
                continue
            group = (mpu.get_expert_data_parallel_group() if getattr(p, "allreduce", True) is False
                     else mpu.get_data_parallel_group())
            if dist.get_world_size(group) > 1:
                dist.all_reduce(p.grad, group=group)


def check_export(path: str, targets, tp: int, sp: bool, pp: int, out_dir: str,
                 ep: int = 1) -> dict:
    """Export from this layout: the PEFT adapter folder (read back by
    ``peft.PeftModel.from_pretrained`` and by our ``load_adapter`` into a fresh model) and the
    merged HF folder (``adapters_merged`` + ``save_pretrained``) must give our logits; the base
    weights must be bit-identical after the merged save."""
    import os

    import parallel_models as pm
    from parallel_models.lora import adapters_merged, save_adapter

    pm.init_parallel(tensor_parallel_size=tp, sequence_parallel=sp, pipeline_parallel_size=pp,
                     expert_model_parallel_size=ep)
    peft_model = peft_reference(path, targets)
    chunks = build_lora_chunks(path, targets, peft_model)
    ids, mask = _batch(chunks[0].config.vocab_size, "left", seed=5)
    pos = (mask.cumsum(-1) - 1).clamp(min=0)

    def ours(model_chunks):
        mbs = _microbatches_packed(ids, mask, 2)
        for mb in mbs:
            mb["full_vocab"] = True
        return torch.cat(pm.forward_only(model_chunks, mbs))

    logits = ours(chunks)
    lora_dir, merged_dir = os.path.join(out_dir, "actor_lora"), os.path.join(out_dir, "actor_hf")
    save_adapter(chunks, lora_dir, base_model_name_or_path=path)
    before = {n: p.detach().clone() for c in chunks for n, p in c.named_parameters()}
    with adapters_merged(chunks):
        merged_logits = ours(chunks)
        pm.save_pretrained(chunks, merged_dir)
    after = {n: p.detach() for c in chunks for n, p in c.named_parameters()}
    restored = all(torch.equal(before[n], after[n]) for n in before)
    fresh = build_lora_chunks_from_folder(path, lora_dir)
    out = {"in_memory_merged_rel": rel(merged_logits, logits), "restored": restored,
           "reloaded_rel": rel(ours(fresh), logits)}
    if torch.distributed.get_rank() == 0:
        from peft import PeftModel
        from transformers import AutoModelForCausalLM

        valid = mask.bool()
        with torch.no_grad():
            base = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
            peft_loaded = PeftModel.from_pretrained(base, lora_dir)
            got = peft_loaded(input_ids=ids, attention_mask=mask, position_ids=pos).logits
            merged = AutoModelForCausalLM.from_pretrained(merged_dir, dtype=torch.float32)
            got_merged = merged(input_ids=ids, attention_mask=mask, position_ids=pos).logits
        out["peft_loaded_rel"] = rel(logits, got[valid])
        out["merged_hf_rel"] = rel(logits, got_merged[valid])
        out["files"] = sorted(os.listdir(lora_dir))
    return out


def build_lora_chunks_from_folder(path: str, lora_dir: str):
    """Fresh chunks of ``path`` with the adapters of the PEFT folder ``lora_dir``."""
    import parallel_models as pm
    from parallel_models.lora import load_adapter

    cls = pm.get_model_class(pm.registry.architecture_of(path), "causal_lm", rmpad=True, pp=True)
    chunks = pm.build_pipeline_chunks(cls, path, dtype=torch.float32)
    load_adapter(chunks, lora_dir)
    return chunks


def check_init_and_disable(path: str, tp: int) -> dict:
    """Fresh adapters (B = 0) leave the logits bit-identical to the model without LoRA;
    ``adapters_disabled`` gives them back with nonzero B; A is PEFT's kaiming-uniform
    (|A| <= 1/sqrt(fan_in)) and the same matrix at every TP (gathered A of q_proj)."""
    import parallel_models as pm
    from parallel_models.lora import (LoraSettings, adapters_disabled, add_lora,
                                      gather_adapter_tensors, lora_modules)

    pm.init_parallel(tensor_parallel_size=tp)
    cls = pm.get_model_class(pm.registry.architecture_of(path), "causal_lm", rmpad=True)
    model = cls.from_pretrained(path, dtype=torch.float32)
    ids, mask = _batch(model.config.vocab_size, "right", seed=1)
    mb = _microbatches_packed(ids, mask, 1)[0]

    def logits():
        with torch.no_grad():
            return model(mb["input_ids"], mb["cu_seqlens"], full_vocab=True).logits

    base = logits()
    add_lora(model, LoraSettings(rank=RANK, alpha=ALPHA))
    fresh = logits()
    bounds_ok, b_zero = True, True
    for _, _, lora in lora_modules(model):
        for ad in lora.adapters.values():
            fan_in = ad.lora_A.weight.shape[1] * (lora.tp if type(lora).__name__ == "RowLora" else 1)
            bounds_ok &= bool(ad.lora_A.weight.abs().max() <= fan_in ** -0.5)
            b_zero &= bool((ad.lora_B.weight == 0).all())
            with torch.no_grad():
                ad.lora_B.weight.normal_(0.0, 0.1, generator=torch.Generator().manual_seed(3))
    with_b = logits()
    with adapters_disabled(model):
        disabled = logits()
    gathered = gather_adapter_tensors(model)
    a = {k: v for k, v in gathered.items() if "lora_A" in k} if gathered is not None else None
    return {"fresh_equal": torch.equal(fresh, base), "disabled_equal": torch.equal(disabled, base),
            "changed": rel(with_b, base), "bounds_ok": bounds_ok, "b_zero": b_zero, "A": a}


def check_merged_rollout(path: str, tp: int, rollout_tp: int) -> dict:
    """The hybrid engine's rollout copy (TP', filled by the merged weight sync the megatron
    backend installs for a LoRA actor) gives the LoRA actor's logits; the actor's base weights
    are untouched by the sync."""
    import parallel_models as pm
    from parallel_models.lora import LoraSettings, MergedWeightSync, add_lora, lora_modules
    from parallel_models.rl.rollout.hybrid import HybridRollout

    pm.init_parallel(tensor_parallel_size=tp)
    cls = pm.get_model_class(pm.registry.architecture_of(path), "causal_lm", rmpad=True)
    actor = cls.from_pretrained(path, dtype=torch.float32)
    add_lora(actor, LoraSettings(rank=RANK, alpha=ALPHA))
    g = torch.Generator().manual_seed(5)
    with torch.no_grad():
        for _, _, lora in lora_modules(actor):
            for ad in lora.adapters.values():  # the same full B on every rank, then the slice
                ad.lora_B.weight.copy_(torch.randn(ad.lora_B.weight.shape, generator=g) * 0.1)
    hybrid = HybridRollout(actor, rollout_tp, share_weights=False)
    hybrid.weight_sync = MergedWeightSync(hybrid.weight_sync, actor)
    before = {n: p.detach().clone() for n, p in actor.named_parameters()}
    hybrid.sync(version=1)
    restored = all(torch.equal(before[n], p) for n, p in actor.named_parameters())
    ids, mask = _batch(actor.config.vocab_size, "right", seed=9)
    mb = _microbatches_packed(ids, mask, 1)[0]
    with torch.no_grad():
        want = actor(mb["input_ids"], mb["cu_seqlens"], full_vocab=True).logits
        got = hybrid.engine.model(mb["input_ids"], mb["cu_seqlens"], full_vocab=True).logits
        from parallel_models.lora import adapters_disabled

        with adapters_disabled(actor):
            base = actor(mb["input_ids"], mb["cu_seqlens"], full_vocab=True).logits
    return {"rel": rel(got, want), "restored": restored, "lora_effect": rel(base, want),
            "rollout_has_lora": any(hasattr(m, "lora") for m in hybrid.engine.model.modules())}


def count_parameters_in_memory(args: list) -> dict:
    """Build the PPO trainer of ``args`` (its roles, rollout and all) and count the parameters
    alive in this process (every ``torch.nn.Parameter``, storages counted once), the actor's
    base (frozen) and trainable ones."""
    import gc

    from parallel_models.rl.config.ppo import load_config
    from parallel_models.rl.trainer import PPOTrainer

    trainer = PPOTrainer(load_config(None, list(args)))
    gc.collect()
    seen, total = set(), 0
    for obj in gc.get_objects():
        if isinstance(obj, torch.nn.Parameter) and obj.data_ptr() not in seen:
            seen.add(obj.data_ptr())
            total += obj.numel()
    actor = trainer.roles.model
    return {"in_memory": total,
            "actor_frozen": sum(p.numel() for p in actor.parameters() if not p.requires_grad),
            "actor_trainable": sum(p.numel() for p in actor.parameters() if p.requires_grad),
            "actor_total": sum(p.numel() for p in actor.parameters()),
            "reference": type(trainer.ref).__name__}


def lora_ppo_steps(output_dir: str, tp: int, sp: bool, pp: int = 1, steps: int = 2) -> bool:
    """``steps`` PPO steps of the built-in job with LoRA at TP=``tp`` (+SP) x PP=``pp`` (the
    hybrid engine's merged weight sync when PP > 1), then the export."""
    from parallel_models.rl.config import load_config
    from parallel_models.rl.trainer import PPOTrainer

    cfg = load_config(None, [f"trainer.output_dir={output_dir}", f"trainer.total_steps={steps}",
                             f"parallel.tensor_parallel_size={tp}",
                             f"parallel.sequence_parallel={str(sp).lower()}",
                             f"parallel.pipeline_parallel_size={pp}",
                             "trainer.save_every=0", "trainer.loggers=[jsonl]",
                             "actor.ppo_epochs=1", "data.batch_size=4", "rollout.n=2",
                             "actor.mini_batch_size=8", "rollout.max_new_tokens=8",
                             "actor.lora.rank=4", "actor.lr=1e-2"])
    cfg.validate()
    PPOTrainer(cfg).fit()
    return True


def lora_save_then_step(output_dir: str, tp: int, sp: bool) -> dict:
    """Two LoRA PPO steps (actor and critic LoRA) at TP=``tp`` (+SP), a trainer checkpoint, the
    gathered adapters (the critic's with its head), then one more step: its metrics."""
    from parallel_models.lora import gather_adapter_tensors
    from tests.helpers.trainer_checkpoint_checks import _trainer

    trainer = _trainer(output_dir, tp, "actor.lora.rank=4", "critic.lora.rank=4", "actor.lr=1e-2",
                       f"parallel.sequence_parallel={str(sp).lower()}")
    trainer.step()
    trainer.step()
    path = trainer.save_checkpoint()
    adapters = gather_adapter_tensors(trainer.roles.model)
    critic = gather_adapter_tensors(trainer.roles.critic.model)
    return {"path": path, "adapters": adapters, "critic": critic, "metrics": trainer.step()}


def lora_resume_then_step(output_dir: str, checkpoint: str, tp: int, model: str) -> dict:
    """Resume a LoRA trainer checkpoint at TP=``tp``: the gathered adapters, then one step."""
    from parallel_models.lora import gather_adapter_tensors
    from tests.helpers.trainer_checkpoint_checks import _trainer

    trainer = _trainer(output_dir, tp, "actor.lora.rank=4", "critic.lora.rank=4", "actor.lr=1e-2",
                       f"model.path={model}")
    trainer.resume(checkpoint)
    adapters = gather_adapter_tensors(trainer.roles.model)
    critic = gather_adapter_tensors(trainer.roles.critic.model)
    return {"step": trainer.step_index, "adapters": adapters, "critic": critic,
            "metrics": trainer.step()}


def check_value_lora_against_peft(path: str, tp: int) -> dict:
    """A LoRA value model (the critic) vs PEFT's ``SEQ_CLS`` LoRA on the transformers
    ``*ForSequenceClassification`` model (the ``score`` head trained whole, PEFT's
    ``modules_to_save``): per-token values and the gradients of the adapters and the head."""
    import parallel_models as pm
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForSequenceClassification

    from parallel_models.lora import (LoraSettings, add_lora, gather_adapter_tensors,
                                      load_adapter_tensors, trainable_parameter_count)
    from parallel_models.utils.padding import pack_padded_batch

    pm.init_parallel(tensor_parallel_size=tp)
    hf = AutoModelForSequenceClassification.from_pretrained(path, dtype=torch.float32)
    peft_model = get_peft_model(hf, LoraConfig(r=RANK, lora_alpha=ALPHA, task_type="SEQ_CLS",
                                               target_modules="all-linear"))
    g = torch.Generator().manual_seed(4)
    with torch.no_grad():
        for name, p in peft_model.named_parameters():
            if "lora_B" in name:
                p.copy_(torch.randn(p.shape, generator=g) * 0.1)
    want_names = {n.replace(".default", "").replace(".modules_to_save", ""): p
                  for n, p in peft_model.named_parameters() if p.requires_grad}
    cls = pm.get_model_class(pm.registry.architecture_of(path), "value", rmpad=True)
    model = cls.from_pretrained(path, dtype=torch.float32)
    add_lora(model, LoraSettings(rank=RANK, alpha=ALPHA))
    load_adapter_tensors(model, {n: p.detach() for n, p in want_names.items()})
    ids, mask = _batch(model.config.vocab_size, "right", seed=6)
    pos = (mask.cumsum(-1) - 1).clamp(min=0)
    inner = peft_model.base_model.model
    hidden = inner.model(input_ids=ids, attention_mask=mask, position_ids=pos).last_hidden_state
    hf_values = inner.score(hidden).squeeze(-1)[mask.bool()]
    (hf_values ** 2).sum().backward()
    packed = pack_padded_batch(ids, mask)
    values = model(packed.input_ids, packed.cu_seqlens).values
    (values ** 2).sum().backward()
    grads = gather_adapter_tensors(model, grads=True)
    out = {"values_rel": rel(values.detach(), hf_values.detach()),
           "trainable": trainable_parameter_count(model)}
    if grads is not None:
        out["grad_names"] = sorted(grads) == sorted(want_names)
        out["grad_rel"] = max(rel(grads[n], p.grad) for n, p in want_names.items())
        out["peft_trainable"] = sum(p.numel() for p in want_names.values())
    return out


def push_lora_to_server(path: str, url: str, prompts: list) -> dict:
    """A LoRA actor (TP=1, nonzero B) pushes its adapters to the server at ``url`` twice (new
    B each time); after each push the server's greedy answers to ``prompts`` must have the
    actor's LoRA log-probs. -> per push: the max |server - actor| log-prob difference, the
    largest difference to the base model, the version, and the bytes sent; the full model's
    bytes."""
    import parallel_models as pm
    from parallel_models.inference.server.client import RolloutClient
    from parallel_models.lora import LoraSettings, adapters_disabled, add_lora, lora_modules
    from parallel_models.lora.server_push import push_adapter_stream

    pm.init_parallel(tensor_parallel_size=1)
    actor = pm.get_model_class(pm.registry.architecture_of(path), "causal_lm",
                               rmpad=True).from_pretrained(path, dtype=torch.float32)
    full_bytes = sum(p.numel() * p.element_size() for p in actor.parameters())
    add_lora(actor, LoraSettings(rank=RANK, alpha=ALPHA))
    client = RolloutClient(url, timeout=60)

    def log_probs(ids: list[int], n_prompt: int) -> torch.Tensor:
        x = torch.tensor(ids)
        with torch.no_grad():
            logits = actor(x, torch.tensor([0, len(ids)], dtype=torch.int32),
                           full_vocab=True).logits
        lp = torch.log_softmax(logits.float(), -1)[n_prompt - 1:-1]
        return lp.gather(-1, x[n_prompt:, None])[:, 0]

    pushes = []
    for seed in (5, 6):
        g = torch.Generator().manual_seed(seed)
        with torch.no_grad():
            for _, _, lora in lora_modules(actor):
                for ad in lora.adapters.values():
                    ad.lora_B.weight.copy_(torch.randn(ad.lora_B.weight.shape, generator=g) * 0.2)
        sent = push_adapter_stream(actor, client)
        out = client.generate(prompts, greedy=True, max_new_tokens=6, eos_token_id=2,
                              return_text=False)
        diff, off_base = 0.0, 0.0
        for prompt, res in zip(prompts, out["results"]):
            sample = res["samples"][0]
            ids = list(prompt) + sample["token_ids"]
            want = log_probs(ids, len(prompt))
            got = torch.tensor(sample["log_probs"])
            diff = max(diff, float((got - want).abs().max()))
            with adapters_disabled(actor):
                off_base = max(off_base, float((got - log_probs(ids, len(prompt))).abs().max()))
        pushes.append({"diff": diff, "off_base": off_base, "version": out["weight_version"],
                       "pushed": sent["weight_version"], "bytes": sent["bytes"]})
    client.close()
    return {"pushes": pushes, "full_bytes": full_bytes}


def moe_mlp_target_errors(path: str) -> dict:
    """The errors ``add_lora`` gives on a Qwen3-MoE model with a dense layer for what PEFT
    cannot express (see ``lora/apply.py``); attention targets still work."""
    import parallel_models as pm
    from parallel_models.errors import ConfigError
    from parallel_models.lora import LoraSettings, add_lora

    pm.init_parallel(tensor_parallel_size=1)
    cls = pm.get_model_class(pm.registry.architecture_of(path), "causal_lm", rmpad=True)
    model = cls.from_pretrained(path, dtype=torch.float32)
    out = {}
    for key, targets, dropout in (("all-linear", "all-linear", 0.0),
                                  ("['gate_proj']", ["gate_proj"], 0.0),
                                  ("['q_proj', 'down_proj']", ["q_proj", "down_proj"], 0.0),
                                  ("dropout", ["gate_proj", "up_proj"], 0.1)):
        try:
            add_lora(model, LoraSettings(rank=RANK, alpha=ALPHA, target_modules=targets,
                                         dropout=dropout))
            out[key] = None
        except ConfigError as err:
            out[key] = str(err)
    out["attention_trainable"] = add_lora(model, LoraSettings(
        rank=RANK, alpha=ALPHA, target_modules=["q_proj", "v_proj"]))
    return out

