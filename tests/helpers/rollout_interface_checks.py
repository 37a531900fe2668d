"""Workers for the rollout interface tests (run on gloo ranks): each adapter built on a tiny
model, greedy generations against transformers' own ``generate``, and a PPO run through a rollout
backend registered by the test (a user's)."""

from __future__ import annotations

import torch

PROMPTS = [[5, 17, 33, 8], [40, 2], [9, 9, 71]]
NEW = 6


def _reference(hf, prompts) -> list[list[int]]:
    """transformers' greedy continuation of each prompt (no stop token)."""
    out = []
    for p in prompts:
        ids = hf.generate(torch.tensor([p]), attention_mask=torch.ones(1, len(p), dtype=torch.long),
                          max_new_tokens=NEW, do_sample=False, pad_token_id=0)
        out.append(ids[0, len(p):].tolist())
    return out


def _hf_log_probs(hf, prompt, response) -> list[float]:
    with torch.no_grad():
        logits = hf(torch.tensor([prompt + response])).logits.float()
    logp = torch.log_softmax(logits[0, len(prompt) - 1:-1], -1)
    return logp.gather(-1, torch.tensor(response)[:, None]).squeeze(-1).tolist()


def _rows(batch) -> dict:
    """What a batch says, in plain lists: each row's prompt, response and sampler log-probs."""
    P = batch.sequences.shape[1] - batch.response_mask.shape[1]
    rows = []
    for b in range(len(batch)):
        plen = int(batch.prompt_lengths[b])
        k = int(batch.response_mask[b].sum())
        rows.append({"prompt": batch.sequences[b, P - plen:P].tolist(),
                     "left_pad": batch.attention_mask[b, :P - plen].tolist(),
                     "response": batch.sequences[b, P:P + k].tolist(),
                     "log_probs": batch.rollout_log_probs[b, :k].tolist()})
    return {"rows": rows, "group_index": batch.group_index.tolist(),
            "type": type(batch).__name__}


def adapters_generate(path: str, folder: str) -> dict:
    """Every adapter satisfies the protocol; the in-process, hybrid (same layout) and HF
    generate adapters' greedy batches, and transformers' greedy references."""
    from transformers import AutoModelForCausalLM

    import parallel_models as pm
    from parallel_models.inference import RolloutClient, RolloutEngine, SamplingParams
    from parallel_models.rl.backends.fsdp.hf_rollout import HFRolloutEngine
    from parallel_models.rl.rollout.hf_generate import HFGenerateRollout
    from parallel_models.rl.rollout.hybrid import HybridRollout
    from parallel_models.rl.rollout.hybrid_adapter import HybridEngineRollout
    from parallel_models.rl.rollout.inprocess import InProcessRollout
    from parallel_models.rl.rollout.interface import Rollout
    from parallel_models.rl.rollout.server import ServerRollout

    pm.init_parallel(tensor_parallel_size=1)
    model = pm.AutoModelForCausalLM.from_pretrained(path, rmpad=True, dtype=torch.float32)
    hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    hf.generation_config.eos_token_id = None  # no stop token: every row runs NEW tokens
    adapters = {
        "inprocess": InProcessRollout(RolloutEngine(model, pad_token_id=0)),
        "hybrid": HybridEngineRollout(HybridRollout(model, 1, pad_token_id=0)),
        "hf_generate": HFGenerateRollout(HFRolloutEngine(hf, pad_token_id=0)),
        "server": ServerRollout(RolloutClient("http://127.0.0.1:9"), model, folder=folder),
    }
    out = {"protocol": {k: isinstance(a, Rollout) for k, a in adapters.items()},
           "not_a_rollout": isinstance(RolloutEngine(model), Rollout)}
    params = SamplingParams(n=2, max_new_tokens=NEW, greedy=True, ignore_eos=True)
    for name in ("inprocess", "hybrid", "hf_generate"):
        adapter = adapters[name]
        adapter.update_weights(0)
        out[name] = _rows(adapter.generate(PROMPTS, params))
        adapter.release_memory()
        adapter.resume_memory()
    out["seeded"] = _seeded_samples(adapters, model)
    out["reference"] = _reference(hf, PROMPTS)
    out["reference_log_probs"] = [_hf_log_probs(hf, p, r)
                                  for p, r in zip(PROMPTS, out["reference"])]
    return out


def _seeded_samples(adapters, model) -> dict:
    """Sampled rows (top-k 20, temperature 0.8, 3 per prompt) with per-prompt seeds, through each
    adapter and the continuous engine, all prompts at once and each alone: name -> responses."""
    from parallel_models.inference import RolloutEngine, SamplingParams, prompt_seed
    from parallel_models.rl.rollout.inprocess import InProcessRollout

    params = SamplingParams(n=3, max_new_tokens=NEW, temperature=0.8, top_k=20, ignore_eos=True)
    seeds = [prompt_seed(7, 1, i) for i in range(len(PROMPTS))]
    runs = dict(adapters, continuous=InProcessRollout(
        RolloutEngine(model, pad_token_id=0, kv_budget_tokens=64, max_rows=4)))
    out = {}
    for name in ("inprocess", "continuous", "hybrid", "hf_generate"):
        adapter = runs[name]
        rows = _rows(adapter.generate(PROMPTS, params, prompt_seeds=seeds))["rows"]
        out[name] = [r["response"] for r in rows]
        alone = []
        for p, s in zip(PROMPTS, seeds):  # another batch: the same samples
            alone += [r["response"] for r in _rows(adapter.generate([p], params,
                                                                    prompt_seeds=[s]))["rows"]]
        out[name + "_alone"] = alone
    return out


class RecordingRollout:
    """A user's rollout backend: the training backend's in-process rollout, with every call
    written down (what the trainer asked for, in order)."""

    pushes_weights = False

    def __init__(self, inner, calls: list):
        self.inner, self.calls = inner, calls

    def generate(self, prompt_ids, sampling, *, max_new_tokens=None, prompt_seeds=None):
        self.calls.append(("generate", len(prompt_ids), sampling.n))
        return self.inner.generate(prompt_ids, sampling, max_new_tokens=max_new_tokens,
                                   prompt_seeds=prompt_seeds)

    def update_weights(self, version) -> None:
        self.calls.append(("update_weights", version))
        self.inner.update_weights(version)

    def release_memory(self) -> None:
        self.calls.append(("release_memory",))

    def resume_memory(self) -> None:
        self.calls.append(("resume_memory",))


def ppo_with_rollout_backend(output_dir: str, backend: str, overrides: list) -> dict:
    """Two PPO steps with ``rollout.backend=backend`` (``"recording"``: registered here, as a
    user would, before the config is loaded); the metrics and the recorded calls."""
    from parallel_models.rl.config import load_config
    from parallel_models.rl.rollout.registry import ROLLOUT_BACKENDS
    from parallel_models.rl.trainer import PPOTrainer

    calls: list = []
    ROLLOUT_BACKENDS.add("recording",
                              lambda context: RecordingRollout(context.inprocess(), calls))
    cfg = load_config(None, [f"trainer.output_dir={output_dir}", "trainer.total_steps=2",
                             "trainer.save_every=0", "trainer.loggers=[jsonl]",
                             "trainer.save_hf_at_end=false", "data.batch_size=4", "rollout.n=2",
                             "actor.mini_batch_size=8", "rollout.max_new_tokens=8",
                             f"rollout.backend={backend}", *overrides])
    cfg.validate()
    trainer = PPOTrainer(cfg)
    metrics = [{k: v for k, v in m.items() if not k.startswith(("timing/", "memory/"))}
               for m in trainer.fit()]
    return {"metrics": metrics, "calls": calls, "rollout": type(trainer.rollout).__name__}
