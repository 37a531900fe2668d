"""End-to-end GRPO at the Llama-3-8B shape on two GPUs (issue 19 item 3): the trainer's own run,
per phase time, peak memory, tokens/s/GPU and the MFU of the scoring and training phases, and
the whole step's tokens/s/GPU counted as NeMo-RL counts it.

    python bench/grpo_scale.py --layout tp2 [--layout pp2] [--critic] [--steps 2] [--out r.json]
    python bench/grpo_scale.py --shape tiny --layout tp2 pp2 --steps 1   # the CPU smoke (gloo)

The runs of issue 33 (2x H100 80 GB; each layout prints one JSON line: per step its time and
each phase's seconds, peak GiB allocated and reserved and the allocator's retries, the median
and spread after the first step):

    # 8B GRPO at TP=2 and at PP=2, 5 steps (>= 4 after warm-up), each under 10 minutes
    # (--device-mib 81559: an H100 80GB's memory on a larger card; docs/PERFORMANCE.md)
    python bench/grpo_scale.py --layout tp2 --steps 5 --timeout 540 --no-trainer-offload \
        --actor optimizer_offload_fraction=1 --out grpo_tp2.json
    python bench/grpo_scale.py --layout pp2 --steps 5 --timeout 545 --no-trainer-offload \
        --actor optimizer_offload_fraction=1 recompute=full --out grpo_pp2.json
    # the PPO + critic variant (GAE; the critic a rank-64 LoRA on the 8B base with a trainable
    # value head: a full 8B critic's optimizer states do not fit a 256 GiB host beside the
    # actor's); ~170 s a step, so longer than one device call: bench/gpu_session.sh critic
    python bench/grpo_scale.py --layout tp2 --critic --steps 5 --timeout 1500 \
        --no-trainer-offload --actor optimizer_offload_fraction=1 recompute=full \
        --critic-opt lora.rank=64 recompute=full --out ppo_8b.json
    # GRPO with 8k-16k-token responses at the 1.5B and the 0.5B shape
    python bench/grpo_scale.py --preset long-responses --layout tp2 --steps 3 \
        --actor recompute=full --out long_1p5b.json
    python bench/grpo_scale.py --preset long-responses --shape 0.5b --layout tp2 --steps 3 \
        --actor recompute=full --out long_0p5b.json

What runs (each layout: ``torchrun --nproc-per-node 2 -m parallel_models.rl.train``):
- model: a random-weight bf16 Llama of the 8B shape (hidden 4096, 32 layers, 32/8 heads, ffn
  14336, vocab 128256, rope theta 500000), written once as HF safetensors straight from tensors
  drawn on the GPU (no transformers model is built); ``--shape tiny`` for the CPU;
- tokenizer: a word-level one over the same 128256 ids (``t0`` ... plus specials), built on the
  spot, so 512-token prompts and random responses round-trip as text;
- the bench's own process never holds GPU memory while the run goes: the model is written and the
  matmul peak measured in a spawned child process (``gpu_setup``), whose CUDA context and cached
  blocks go with it;
- rollout KV: ``rollout.kv_budget_tokens=auto`` (``--kv-budget``), planned from the memory left
  at ``rollout.gpu_memory_utilization`` (``--gpu-memory-utilization``; default: the config's);
- data: 64 prompts per step of exactly 512 tokens, each with a response cap drawn long-tailed
  (lognormal, median 300 (``--response-median``), sigma 0.8, clipped to 16 (``--response-min``)
  ..1024 (``--max-new``)) in the record field the trainer reads
  (``data.max_new_tokens_key``); ``rollout.ignore_eos``, so every response is as long as its cap;
- GRPO: 8 samples per prompt, actor + reference (the KL loss) colocated with ``trainer.offload``,
  continuous batching, one PPO epoch in minibatches of 128 samples; ``--critic``: the PPO variant
  (GAE, a critic initialised from the actor, KL in the reward);
- layouts: ``tp2`` (TP=2) and ``pp2`` (PP=2; the rollout runs at TP'=1 on each GPU through the
  hybrid engine);
- shapes: ``8b``, ``1.5b`` and ``0.5b`` (the Qwen2.5 shapes as Llama), ``tiny``;
  ``--preset long-responses``: 16 prompts x 8 of 512 tokens with responses of 8,192..16,384
  tokens (median 12,000) at the 1.5B shape (options given on the command line win).

Reported per step and phase (the trainer's ``timing/*_s`` and ``memory/*_peak_gib``): tokens/s/GPU
= tokens the phase processed / time / GPUs; MFU of scoring (actor + reference forward: 2 N
tokens + causal attention each) and of the actor update (6 N tokens + attention) against the
H200's dense bf16 peak (989 TFLOP/s) and against the measured matmul peak; N = 7.50B multiplying
parameters (the input embedding is a lookup). The whole step, as NeMo-RL's performance summary
counts it (docs.nvidia.com/nemo/rl/latest/about/performance-summary.html: tokens/sec/GPU =
total tokens processed / (time of the stage x GPUs), the stage being the whole step): prompt +
response tokens of all samples / step time / GPUs. Step 1 includes graph capture and compiles:
the table reports the last step (all steps are in the JSON).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import subprocess
import sys
import tempfile
import time

import torch

from parallel_models.utils.process_tree import stop_process_tree

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from common import HostMemoryWatch  # noqa: E402
from grpo_scale_report import case_line, print_table, read_steps  # noqa: E402

SHAPES = {
    "8b": dict(hidden_size=4096, num_hidden_layers=32, num_attention_heads=32,
               num_key_value_heads=8, intermediate_size=14336, vocab_size=128256),
    # the Qwen2.5-0.5B / 1.5B shapes (as Llama: no qkv bias, untied head)
    "0.5b": dict(hidden_size=896, num_hidden_layers=24, num_attention_heads=14,
                 num_key_value_heads=2, intermediate_size=4864, vocab_size=151936),
    "1.5b": dict(hidden_size=1536, num_hidden_layers=28, num_attention_heads=12,
                 num_key_value_heads=2, intermediate_size=8960, vocab_size=151936),
    "tiny": dict(hidden_size=64, num_hidden_layers=4, num_attention_heads=4,
                 num_key_value_heads=2, intermediate_size=128, vocab_size=1000),
}
# --preset long-responses: GRPO with 8k-16k-token responses at the 1.5B shape (issue 33 item 5);
# flags given on the command line win
PRESETS = {"long-responses": dict(shape="1.5b", prompts=16, n=8, prompt_len=512, max_new=16384,
                                  response_min=8192, response_median=12000, mini_batch=64,
                                  micro_tokens=34816, timeout=[590])}
SPECIALS = ["<pad>", "<s>", "</s>"]


def log(msg: str) -> None:
    print(f"[grpo_scale {time.strftime('%H:%M:%S')}] {msg}", flush=True)


def build_model(folder: str, shape: dict, device: str, max_positions: int = 8192) -> None:
    """HF Llama folder of random bf16 weights (std 0.02, norms 1), written shard by shard."""
    from safetensors.torch import save_file
    from transformers import LlamaConfig

    V, H, L = shape["vocab_size"], shape["hidden_size"], shape["num_hidden_layers"]
    kv = H // shape["num_attention_heads"] * shape["num_key_value_heads"]
    ffn = shape["intermediate_size"]
    cfg = LlamaConfig(**shape, max_position_embeddings=max(8192, max_positions),
                      rope_theta=500000.0,
                      tie_word_embeddings=False, bos_token_id=1, eos_token_id=2, pad_token_id=0,
                      architectures=["LlamaForCausalLM"], torch_dtype="bfloat16")
    os.makedirs(folder, exist_ok=True)
    gen = torch.Generator(device=device).manual_seed(0)

    def rand(*size):
        return (torch.randn(*size, generator=gen, device=device) * 0.02).to(torch.bfloat16).cpu()

    shards = [{"model.embed_tokens.weight": rand(V, H)}]
    for i in range(L):
        p = f"model.layers.{i}."
        shards.append({p + "self_attn.q_proj.weight": rand(H, H),
                       p + "self_attn.k_proj.weight": rand(kv, H),
                       p + "self_attn.v_proj.weight": rand(kv, H),
                       p + "self_attn.o_proj.weight": rand(H, H),
                       p + "mlp.gate_proj.weight": rand(ffn, H),
                       p + "mlp.up_proj.weight": rand(ffn, H),
                       p + "mlp.down_proj.weight": rand(H, ffn),
                       p + "input_layernorm.weight": torch.ones(H, dtype=torch.bfloat16),
                       p + "post_attention_layernorm.weight": torch.ones(H, dtype=torch.bfloat16)})
    shards.append({"model.norm.weight": torch.ones(H, dtype=torch.bfloat16),
                   "lm_head.weight": rand(V, H)})
    weight_map, total = {}, 0
    for k, tensors in enumerate(shards):
        name = f"model-{k + 1:05d}-of-{len(shards):05d}.safetensors"
        save_file(tensors, os.path.join(folder, name), metadata={"format": "pt"})
        for key, t in tensors.items():
            weight_map[key] = name
            total += t.numel() * t.element_size()
    with open(os.path.join(folder, "model.safetensors.index.json"), "w") as f:
        json.dump({"metadata": {"total_size": total}, "weight_map": weight_map}, f)
    cfg.save_pretrained(folder)
    build_tokenizer(V).save_pretrained(folder)


def build_tokenizer(vocab_size: int):
    """A word-level fast tokenizer whose ids are ``<pad> <s> </s> t3 t4 ...``."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {w: i for i, w in enumerate(SPECIALS)}
    vocab.update({f"t{i}": i for i in range(len(SPECIALS), vocab_size)})
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<pad>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    return PreTrainedTokenizerFast(tokenizer_object=tok, pad_token="<pad>", bos_token="<s>",
                                   eos_token="</s>", unk_token="<pad>")


def response_caps(g: torch.Generator, prompts: int, cap: int, median: float = 300.0,
                  low: int = 16) -> list[int]:
    """``prompts`` long-tailed response caps drawn from ``g`` (lognormal around ``median``, sigma
    0.8, clipped to ``low`` .. ``cap``)."""
    caps = torch.exp(math.log(median) + 0.8 * torch.randn(prompts, generator=g))
    return caps.round().clamp(min(low, cap), cap).long().tolist()


def build_data(path: str, prompts: int, prompt_len: int, vocab: int, cap: int, seed: int = 0,
               median: float = 300.0, low: int = 16):
    """``prompts`` records of ``prompt_len`` words and a long-tailed response cap
    (:func:`response_caps`, drawn first from the seeded generator); -> the caps."""
    g = torch.Generator().manual_seed(seed)
    caps = response_caps(g, prompts, cap, median, low)
    with open(path, "w") as f:
        for i in range(prompts):
            ids = torch.randint(len(SPECIALS), vocab, (prompt_len,), generator=g).tolist()
            f.write(json.dumps({"prompt": " ".join(f"t{t}" for t in ids),
                                "budget": caps[i]}) + "\n")
    return caps


def overrides(args, layout: str, model: str, data: str, out: str, prompt_len: int,
              new_tokens: int) -> list[str]:
    samples = args.prompts * args.n
    engines = 1 if layout == "tp2" else 2  # pp2: two rollout engines (TP'=1, one per GPU)
    kv_budget = args.kv_budget
    if kv_budget == "all":  # every sample's region at once (the pre-planner setting)
        kv_budget = samples // engines * (prompt_len + new_tokens)
    o = [f"model.path={model}", f"model.dtype={args.dtype}", f"data.path={data}",
         f"data.max_prompt_length={prompt_len}", f"data.batch_size={args.prompts}",
         "data.shuffle=false", "data.max_new_tokens_key=budget", f"rollout.n={args.n}",
         f"rollout.max_new_tokens={new_tokens}", "rollout.ignore_eos=true",
         f"rollout.kv_budget_tokens={kv_budget}", f"rollout.max_batch_rows={samples // engines}",
         "actor.ppo_epochs=1", f"actor.mini_batch_size={args.mini_batch}",
         f"actor.micro_batch_tokens={args.micro_tokens}", "actor.lr=1e-6",
         f"trainer.total_steps={args.steps}", "trainer.save_every=0",
         "trainer.save_hf_at_end=false", "trainer.loggers=[jsonl]", f"trainer.output_dir={out}",
         f"trainer.offload={str(args.offload).lower()}"]
    if args.gpu_memory_utilization is not None:
        o.append(f"rollout.gpu_memory_utilization={args.gpu_memory_utilization}")
    o += [f"actor.{k}={v}" for k, v in args.actor_options]
    o += [f"critic.{k}={v}" for k, v in args.critic_options] if args.critic else []
    o += (["parallel.tensor_parallel_size=2"] if layout == "tp2" else
          ["parallel.pipeline_parallel_size=2"])
    if args.critic:
        o += ["algorithm.adv_estimator=gae", "critic.enable=true", "actor.use_kl_loss=false",
              "critic.lr=1e-6"]
    else:
        o += ["algorithm.adv_estimator=grpo", "critic.enable=false", "actor.use_kl_loss=true",
              "algorithm.kl_in_reward=false"]
    return o


def run_layout(args, layout, model, data, caps, root, prompt_len, new_tokens, env) -> dict:
    out = os.path.join(root, f"run_{layout}")
    launch = ["-m", "parallel_models.rl.train"]
    here = os.path.dirname(os.path.abspath(__file__))
    envelope = ["--device-mib", str(args.device_mib)] if args.device_mib else []
    if args.memory_trace:  # live GPU memory by allocating code, per step (bench/memory_trace.py)
        launch = [os.path.join(here, "memory_trace.py"), "--out",
                  os.path.join(args.memory_trace, layout), *envelope, *launch]
    elif envelope:  # the trainer inside a smaller card's memory (bench/device_envelope.py)
        launch = [os.path.join(here, "device_envelope.py"), *envelope, *launch]
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2",
           "--master-port", str(29500 + (layout == "pp2")), *launch,
           *overrides(args, layout, model, data, out, prompt_len, new_tokens)]
    log(f"{layout}: {' '.join(cmd[-8:])} ...")
    t0 = time.time()
    proc = subprocess.Popen(cmd, env=env, start_new_session=True)
    with HostMemoryWatch(proc.pid) as host:  # reported even when the host's OOM killer strikes
        try:
            proc.wait(timeout=args.timeout_s)
        except subprocess.TimeoutExpired:  # keep the steps logged so far; free the GPUs
            log(f"{layout}: over {args.timeout_s} s, stopping it")
            stop_process_tree(proc)  # torchrun's ranks too (they run in sessions of their own)
    wall = time.time() - t0
    log(f"{layout}: host memory {host.result()}")
    result = {"layout": layout, "returncode": proc.returncode, "wall_s": wall, **host.result()}
    result = read_steps(args, SHAPES[args.shape], result, os.path.join(out, "metrics.jsonl"),
                        caps, prompt_len)
    log(f"{layout}: exit {proc.returncode} after {wall:.0f} s, {len(result['steps'])} step(s) "
        "logged")
    return result


def gpu_setup(folder: str | None, shape: dict, max_positions: int = 8192) -> dict:
    """The GPU work before the runs, in this (child) process: the model written to ``folder``
    (when given), the device's name and measured bf16 matmul peak."""
    if folder:
        log(f"writing the model to {folder}")
        build_model(folder, shape, "cuda", max_positions)
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    from common import matmul_peak_tflops

    return {"device": torch.cuda.get_device_name(),
            "matmul_peak": matmul_peak_tflops(torch.device("cuda"))}


def in_child(fn, *args):
    """``fn(*args)`` in a spawned process (its CUDA context and memory leave with it)."""
    import concurrent.futures
    import multiprocessing

    with concurrent.futures.ProcessPoolExecutor(
            1, mp_context=multiprocessing.get_context("spawn")) as pool:
        return pool.submit(fn, *args).result()


def gpu_memory_in_use(pid: int) -> int:
    """MiB of GPU memory process ``pid`` holds (nvidia-smi; 0 when it has none or no
    nvidia-smi)."""
    try:
        out = subprocess.run(["nvidia-smi", "--query-compute-apps=pid,used_memory",
                              "--format=csv,noheader,nounits"], capture_output=True, text=True,
                             timeout=30).stdout
    except (OSError, subprocess.SubprocessError):
        return 0
    rows = [line.split(",") for line in out.splitlines() if line.strip()]
    return sum(int(m) for p, m in rows if p.strip() == str(pid) and m.strip().isdigit())


def apply_preset(args, parser) -> None:
    """``--preset``'s values for every option left at its default."""
    for key, value in PRESETS.get(args.preset or "", {}).items():
        if getattr(args, key) == parser.get_default(key):
            setattr(args, key, value)


def actor_option(text: str) -> tuple[str, str]:
    key, sep, value = text.partition("=")
    if not sep:
        raise argparse.ArgumentTypeError(f"--actor takes key=value, got {text!r}")
    return key, value


def report_from_metrics(args) -> None:
    """The table and JSON line of a finished run from its ``metrics.jsonl`` alone (e.g. a run
    that outlived the bench, or whose report failed), on any machine: the response caps are
    drawn again as ``build_data`` drew them (seed 0)."""
    caps = response_caps(torch.Generator().manual_seed(0), args.prompts * args.steps,
                         args.max_new, args.response_median, args.response_min)
    args.matmul_peak = None
    result = read_steps(args, SHAPES[args.shape],
                        {"layout": args.layout[0], "returncode": None, "wall_s": None},
                        args.from_metrics, caps, args.prompt_len)
    print_table(result)
    print(json.dumps(case_line(result, args)), flush=True)
    if args.out:
        with open(args.out, "w") as f:
            json.dump({"from_metrics": args.from_metrics, "args": vars(args), "runs": [result]},
                      f, indent=1)


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--layout", nargs="+", choices=["tp2", "pp2"], default=["tp2"])
    p.add_argument("--shape", choices=sorted(SHAPES), default="8b")
    p.add_argument("--critic", action="store_true", help="the PPO variant (GAE + a critic)")
    p.add_argument("--steps", type=int, default=2)
    p.add_argument("--prompts", type=int, default=64)
    p.add_argument("--n", type=int, default=8)
    p.add_argument("--prompt-len", type=int, default=512)
    p.add_argument("--max-new", type=int, default=1024)
    p.add_argument("--mini-batch", type=int, default=128)
    p.add_argument("--micro-tokens", type=int, default=8192)
    p.add_argument("--timeout", type=int, nargs="+", default=[560],
                   help="seconds per layout (one value, or one per --layout)")
    p.add_argument("--kv-budget", default="auto",
                   help="rollout.kv_budget_tokens: auto (planned) | all (every sample at once) "
                        "| a token count")
    p.add_argument("--gpu-memory-utilization", type=float, default=None,
                   help="rollout.gpu_memory_utilization (default: the config's)")
    p.add_argument("--actor", dest="actor_options", type=actor_option, nargs="*", default=[],
                   help="extra actor settings, e.g. recompute=full optimizer_offload_fraction=1")
    p.add_argument("--critic-opt", dest="critic_options", type=actor_option, nargs="*",
                   default=[], help="extra critic settings with --critic (key=value)")
    p.add_argument("--no-trainer-offload", action="store_true",
                   help="trainer.offload=false (the roles stay on the GPU between phases)")
    p.add_argument("--response-median", type=float, default=300.0,
                   help="median of the long-tailed response caps (lognormal, sigma 0.8)")
    p.add_argument("--response-min", type=int, default=16, help="smallest response cap")
    p.add_argument("--preset", choices=sorted(PRESETS), default=None,
                   help="long-responses: GRPO with 8k-16k responses at the 1.5B shape")
    p.add_argument("--device-mib", type=int, default=0,
                   help="run the trainer as if each card had this many MiB (81559: an H100 "
                        "80GB on a larger card; bench/device_envelope.py)")
    p.add_argument("--memory-trace", default=None, metavar="DIR",
                   help="write the live GPU memory by allocating code after every step to "
                        "DIR/<layout>/rank<R>.jsonl (bench/memory_trace.py)")
    p.add_argument("--from-metrics", default=None, metavar="METRICS_JSONL",
                   help="no run: the report of a finished run's metrics.jsonl (the same "
                        "--layout, --critic, --steps and data options as the run's)")
    p.add_argument("--root", default=None, help="folder for the model, data and runs")
    p.add_argument("--out", default=None)
    args = p.parse_args()
    apply_preset(args, p)
    if args.from_metrics:
        return report_from_metrics(args)
    os.environ.setdefault("PYTORCH_NVML_BASED_CUDA_CHECK", "1")  # is_available through NVML:
    cuda = torch.cuda.is_available()  # no CUDA context in this process, the runs get it all
    args.dtype = "bfloat16" if cuda else "float32"
    args.offload = cuda and not args.no_trainer_offload
    args.matmul_peak = None
    root = args.root or tempfile.mkdtemp(prefix="grpo_scale_")
    shape = SHAPES[args.shape]
    model, data = os.path.join(root, "model"), os.path.join(root, "prompts.jsonl")
    missing = not os.path.isfile(os.path.join(model, "config.json"))
    device_name, held = "cpu", 0
    if cuda:  # the model and the matmul peak in a child process: its GPU memory leaves with it
        info = in_child(gpu_setup, model if missing else None, shape,
                        args.prompt_len + args.max_new)
        args.matmul_peak, device_name = info["matmul_peak"], info["device"]
        held = gpu_memory_in_use(os.getpid())
        log(f"GPU memory held by the bench's own process: {held} MiB")
    elif missing:
        log(f"writing the {args.shape} model to {model}")
        build_model(model, shape, "cpu", args.prompt_len + args.max_new)
    caps = build_data(data, args.prompts * args.steps, args.prompt_len, shape["vocab_size"],
                      args.max_new, median=args.response_median, low=args.response_min)
    srt = sorted(caps)
    dist_info = {"mean": sum(caps) / len(caps), "median": srt[len(srt) // 2],
                 "p90": srt[int(0.9 * (len(srt) - 1))], "max": srt[-1], "min": srt[0]}
    log(f"data: {len(caps)} prompts x {args.prompt_len} tokens, response caps {dist_info}")
    env = {**os.environ, "PYTHONUNBUFFERED": "1", "TOKENIZERS_PARALLELISM": "false",
           "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "4")}
    results = {"device": device_name, "bench_process_gpu_mib": held,
               "torch": torch.__version__, "args": vars(args), "response_caps": dist_info,
               "nemo_rl_definition": "tokens/sec/GPU = total tokens processed / (stage time x "
                                     "GPUs); docs.nvidia.com/nemo/rl/latest/about/"
                                     "performance-summary.html", "runs": []}
    timeouts = dict(zip(args.layout, args.timeout * len(args.layout) if len(args.timeout) == 1
                        else args.timeout))
    for layout in args.layout:
        args.timeout_s = timeouts[layout]
        results["runs"].append(run_layout(args, layout, model, data, caps, root,
                                          args.prompt_len, args.max_new, env))
        print_table(results["runs"][-1])
        print(json.dumps(case_line(results["runs"][-1], args)), flush=True)
        if args.out:
            with open(args.out, "w") as f:
                json.dump(results, f, indent=1)
    failed = [r["layout"] for r in results["runs"] if r["returncode"] != 0]
    if failed:
        sys.exit(f"failed layouts: {failed}")


if __name__ == "__main__":
    main()
