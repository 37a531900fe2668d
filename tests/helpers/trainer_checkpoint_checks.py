"""Workers for the trainer checkpoint tests (run on gloo ranks)."""

from __future__ import annotations

import json
import os
import shutil

import torch

TINY = ["trainer.loggers=[jsonl]", "trainer.save_hf_at_end=false", "actor.ppo_epochs=1",
        "data.batch_size=4", "rollout.n=2", "actor.mini_batch_size=8",
        "rollout.max_new_tokens=8"]


def _trainer(output_dir: str, tp: int, *extra: str):
    from parallel_models.rl.config import load_config
    from parallel_models.rl.trainer import PPOTrainer

    cfg = load_config(None, [f"trainer.output_dir={output_dir}", "trainer.total_steps=3",
                             "trainer.save_every=0", f"parallel.tensor_parallel_size={tp}",
                             *TINY, *extra])
    cfg.validate()
    return PPOTrainer(cfg)


def _adam_states(optimizer) -> dict:
    """{param: torch Adam state} of a megatron (chained) optimizer."""
    out = {}
    for opt in getattr(optimizer, "chained_optimizers", [optimizer]):
        out.update(opt.optimizer.state)
    return out


@torch.no_grad()
def dump_gathered_state(trainer, folder: str) -> None:
    """Every trainable role's weights and Adam exp_avg / exp_avg_sq, gathered over TP into HF
    folders by the HF saver (the optimizer states go through it in place of the weights), and
    the Adam steps as JSON."""
    steps = {}
    for name, role in trainer._trainable().items():
        model = role.model
        model.save_pretrained(os.path.join(folder, name, "weights"), overwrite=True)
        states = _adam_states(role.state.optimizer)
        params = [p for p in model.parameters() if p in states]
        assert len(params) == len(list(model.parameters())), "a parameter has no Adam state"
        steps[name] = sorted({float(states[p]["step"]) for p in params})
        for key in ("exp_avg", "exp_avg_sq"):
            backup = [p.detach().clone() for p in params]
            for p in params:
                p.copy_(states[p][key])
            model.save_pretrained(os.path.join(folder, name, key), overwrite=True)
            for p, b in zip(params, backup):
                p.copy_(b)
    if torch.distributed.get_rank() == 0:
        with open(os.path.join(folder, "adam_steps.json"), "w") as f:
            json.dump(steps, f)


def save_at_step2_then_step(output_dir: str, dump: str, tp: int, *extra: str) -> dict:
    """Two PPO steps, a checkpoint, the gathered state (into ``dump``, when given), then one
    more step: its metrics. ``extra``: more config overrides."""
    trainer = _trainer(output_dir, tp, *extra)
    trainer.step()
    trainer.step()
    path = trainer.save_checkpoint()
    if dump:
        dump_gathered_state(trainer, dump)
    metrics = trainer.step()
    return {"path": path, "metrics": metrics}


def resume_then_step(output_dir: str, checkpoint: str, dump: str, tp: int, model: str,
                     *extra: str) -> dict:
    """Resume ``checkpoint`` at this layout, dump the gathered state, then one step."""
    trainer = _trainer(output_dir, tp, *extra, f"model.path={model}")
    trainer.resume(checkpoint)
    if dump:
        dump_gathered_state(trainer, dump)
    return {"step": trainer.step_index, "metrics": trainer.step()}


def _snapshot(trainer) -> dict:
    out = {f"{n}.{k}": v.detach().clone()
           for n, role in trainer._trainable().items()
           for k, v in role.model.named_parameters()}
    out["step"] = torch.tensor(trainer.step_index)
    for n, role in trainer._trainable().items():
        for i, (p, state) in enumerate(_adam_states(role.state.optimizer).items()):
            for key, value in state.items():
                out[f"{n}.adam.{i}.{key}"] = value.detach().clone()
    return out


def _expect_error(trainer, path: str, *needles: str) -> str:
    from parallel_models.rl.checkpointing import TrainerCheckpointError

    before = _snapshot(trainer)
    try:
        trainer.resume(path)
    except TrainerCheckpointError as err:
        message = str(err)
    else:
        raise AssertionError(f"resume({path}) did not fail")
    for needle in (path, *needles):
        assert needle in message, f"{needle!r} not in: {message}"
    after = _snapshot(trainer)
    assert before.keys() == after.keys(), f"a failed resume of {path} changed optimizer states"
    for k, v in before.items():
        assert torch.equal(v, after[k]), f"{k} changed by a failed resume of {path}"
    return message


def bad_checkpoints(output_dir: str) -> dict:
    """Resuming from folders that are not (complete, compatible) checkpoints fails clearly and
    loads nothing."""
    from transformers import AutoTokenizer, LlamaConfig, LlamaForCausalLM

    from parallel_models.rl.checkpointing import STATE_FILE

    trainer = _trainer(os.path.join(output_dir, "run"), 1)
    trainer.step()
    good = trainer.save_checkpoint()
    messages = {}
    # 1. a folder that is not a checkpoint
    plain = os.path.join(output_dir, "plain")
    os.makedirs(plain)
    with open(os.path.join(plain, "notes.txt"), "w") as f:
        f.write("hello")
    messages["plain"] = _expect_error(trainer, plain, "not a trainer checkpoint")
    # 2. the temporary folder of an unfinished save, and a folder with its index missing
    partial = os.path.join(os.path.dirname(good), ".step_000001.tmp-1234")
    shutil.copytree(good, partial)
    messages["tmp"] = _expect_error(trainer, partial, "did not finish")
    cut = os.path.join(output_dir, "cut")
    shutil.copytree(good, cut)
    os.remove(os.path.join(cut, "dist", ".metadata"))
    messages["cut"] = _expect_error(trainer, cut, "incomplete", ".metadata")
    # 3. another model shape: a run whose model has a wider MLP
    model_dir = os.path.join(output_dir, "wide_model")
    src = os.path.join(output_dir, "run", "builtin_model")
    config = LlamaConfig.from_pretrained(src)
    config.intermediate_size = 96
    torch.manual_seed(0)
    LlamaForCausalLM(config).save_pretrained(model_dir)
    AutoTokenizer.from_pretrained(src).save_pretrained(model_dir)
    other = _trainer(os.path.join(output_dir, "other"), 1, f"model.path={model_dir}")
    messages["shape"] = _expect_error(other, good, "intermediate_size 128", "96")
    # the tensors themselves are checked too (here with the shape summary edited to agree)
    forged = os.path.join(output_dir, "forged")
    shutil.copytree(good, forged)
    with open(os.path.join(forged, STATE_FILE)) as f:
        state = json.load(f)
    for shape in state["models"].values():
        shape["intermediate_size"] = 96
    with open(os.path.join(forged, STATE_FILE), "w") as f:
        json.dump(state, f)
    from parallel_models.llama.checkpoint_utils.checksums import write_manifest

    write_manifest(forged)  # the forgery's checksums agree too
    messages["tensor"] = _expect_error(other, forged, "linear_fc1.weight", "[2, 256, 64]",
                                       "[2, 192, 64]")
    return messages


def _optimizer_params(chunks, optimizer) -> list[tuple[str, torch.Tensor]]:
    """(our parameter name, the tensor the optimizer updates: the parameter, or its fp32 main
    copy for a bf16 model)."""
    names = {p: n for c in chunks for n, p in c.named_parameters()}
    out = []
    for opt in getattr(optimizer, "chained_optimizers", [optimizer]):
        if hasattr(opt, "fp32_from_float16_groups"):
            out += [(names[p], m) for g16, g32 in zip(opt.float16_groups,
                                                      opt.fp32_from_float16_groups)
                    for p, m in zip(g16, g32)]
        else:
            out += [(names[p], p) for g in opt.optimizer.param_groups for p in g["params"]]
    return out


def _fake_adam_states(chunks, optimizer) -> None:
    """Adam states that are functions of the weights (2 w + 1, w^2, step 5), so they can be
    checked at any layout."""
    states = {}
    for opt in getattr(optimizer, "chained_optimizers", [optimizer]):
        states.update({id(p): opt.optimizer.state for g in opt.optimizer.param_groups
                       for p in g["params"]})
    for _, p in _optimizer_params(chunks, optimizer):
        states[id(p)][p] = {"step": torch.tensor(5.0), "exp_avg": 2 * p.detach() + 1,
                            "exp_avg_sq": p.detach() ** 2}


def _distributed_optimizers(optimizer) -> list:
    from megatron.core.optimizer.distrib_optimizer import DistributedOptimizer

    return [o for o in getattr(optimizer, "chained_optimizers", [optimizer])
            if isinstance(o, DistributedOptimizer)]


@torch.no_grad()
def _fake_distributed_adam_states(optimizer) -> None:
    """``_fake_adam_states`` for megatron's distributed optimizer: on this rank's flat shard of
    each parameter's fp32 main copy (the functions are elementwise, so any layout can check
    them)."""
    from parallel_models.rl.roles.sharded_state import _init_distributed_states

    _init_distributed_states(optimizer)
    for opt in _distributed_optimizers(optimizer):
        for p in opt.model_param_group_index_map:
            states = opt._get_main_param_and_optimizer_states(p)
            main = states["param"].detach()
            opt._set_main_param_and_optimizer_states(p, {"param": main, "exp_avg": 2 * main + 1,
                                                         "exp_avg_sq": main ** 2,
                                                         "step": torch.tensor(5.0)})


def _check_distributed_adam_states(chunks, optimizer, vocab: int, tp_rank: int) -> None:
    """The loaded distributed optimizer's shards: fp32 main copies of the loaded weights, Adam
    states made from them (zero on vocab padding rows), step 5."""
    names = {p: n for c in chunks for n, p in c.named_parameters()}
    for opt in _distributed_optimizers(optimizer):
        for p in opt.model_param_group_index_map:
            name, full = names[p], p.detach().float()
            states = opt._get_main_param_and_optimizer_states(p)
            flat = opt._get_model_param_range_map(p)["param"]
            want_avg, want_sq = 2 * full + 1, full ** 2
            if name in ("model.embed_tokens.weight", "lm_head.proj.weight"):
                real = max(0, min(p.shape[0], vocab - tp_rank * p.shape[0]))
                want_avg[real:] = 0
                want_sq[real:] = 0
            for key, want in (("param", full), ("exp_avg", want_avg), ("exp_avg_sq", want_sq)):
                got = states[key].detach()
                assert torch.equal(got, want.reshape(-1)[flat.start:flat.end]), f"{name} {key}"
            assert float(states["step"]) == 5.0, name


def roles_roundtrip(hf_path: str, folder: str, tp: int, pp: int, dtype: str, save: bool,
                    out: str, ep: int = 1, distributed: bool = False) -> bool:
    """Save (``save``) or load the model + optimizer of a role at TP=tp, PP=pp, EP=ep (DP: the
    rest), with megatron's distributed optimizer when ``distributed``.
    Loading starts from zeroed weights and checks the gathered weights against ``hf_path`` and
    the Adam states against the weights they were made from (real vocab rows; padding rows load
    as zeros)."""
    import torch.distributed as dist
    from megatron.core import parallel_state as mpu

    import parallel_models as pm
    from parallel_models.rl.roles import sharded_state
    from parallel_models.utils.optimizer import OptimConfig, build_optimizer

    pm.init_parallel(tensor_parallel_size=tp, pipeline_parallel_size=pp,
                     expert_model_parallel_size=ep)
    cls = pm.get_model_class(pm.registry.architecture_of(hf_path), "causal_lm", rmpad=True,
                             pp=pp > 1)
    chunks = (pm.build_pipeline_chunks(cls, hf_path, dtype=dtype) if pp > 1
              else [cls.from_pretrained(hf_path, dtype=dtype)])
    state = build_optimizer(chunks, OptimConfig(lr=1e-3, use_distributed_optimizer=distributed))
    roles = {"actor": (chunks, state.optimizer)}
    if save:
        if distributed:
            _fake_distributed_adam_states(state.optimizer)
        else:
            _fake_adam_states(chunks, state.optimizer)
        if dist.get_rank() == 0:
            os.makedirs(folder)
        dist.barrier()
        sharded_state.save_roles(folder, roles)
        return True
    with torch.no_grad():
        for c in chunks:
            for p in c.parameters():
                p.zero_()
        for _, m in ([] if distributed else _optimizer_params(chunks, state.optimizer)):
            m.zero_()
    loaded = sharded_state.load_roles(folder, sharded_state.roles_sharded_state_dict(
        roles, loading=True))
    assert all(float(p.abs().sum()) == 0 for c in chunks for p in c.parameters()), \
        "load_roles changed the live weights"
    sharded_state.apply_loaded(roles, loaded)
    chunks[0].save_pretrained(out, overwrite=True)
    tp_rank = mpu.get_tensor_model_parallel_rank()
    vocab = chunks[0].config.vocab_size
    if distributed:
        _check_distributed_adam_states(chunks, state.optimizer, vocab, tp_rank)
        return True
    states = _adam_states(state.optimizer)
    params = dict(n_p for c in chunks for n_p in c.named_parameters())
    for name, p in _optimizer_params(chunks, state.optimizer):
        s = states[p]
        assert float(s["step"]) == 5.0, name
        real = p.shape[0]
        if name in ("model.embed_tokens.weight", "lm_head.proj.weight"):
            real = max(0, min(p.shape[0], vocab - tp_rank * p.shape[0]))
            assert float(s["exp_avg"][real:].abs().sum()) == 0, f"{name}: padding rows"
        assert torch.equal(p.detach().to(params[name].dtype), params[name].detach()), name
        assert torch.equal(s["exp_avg"][:real], 2 * p.detach()[:real] + 1), name
        assert torch.equal(s["exp_avg_sq"][:real], p.detach()[:real] ** 2), name
    return True
