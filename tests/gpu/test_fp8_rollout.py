"""The FP8 rollout on CUDA (``inference/fp8``): the FP8 GEMM through ``torch._scaled_mm``
(block-wise 128 x 128 weights with 1 x 128 activation tiles on Hopper, row-wise channel scales on
any FP8 GPU) against the emulation of the same quantization and against the bf16 product within
the bound derived from e4m3's rounding; and the FP8 engine vs the bf16 engine on the 0.89B Llama
shape (random weights): greedy tokens (share identical) and the mean |log-prob difference|,
printed, with the FP8 engine's CUDA-graph continuous decode giving the log-probs of a fresh FP8
forward."""

from __future__ import annotations

import pytest
import torch

DEV = "cuda"
U, SUB = 2.0 ** -4, 2.0 ** -10


def _fp8_gpu(granularity: str) -> bool:
    from parallel_models.inference.fp8.gemm import _cuda_blockwise_supported

    if not torch.cuda.is_available():
        return False
    if granularity == "block":
        return _cuda_blockwise_supported(torch.device(DEV))
    return torch.cuda.get_device_capability() >= (8, 9)


@pytest.mark.parametrize("granularity", ["block", "channel"])
@pytest.mark.parametrize("tokens", [1, 64, 200])
def test_scaled_mm_matches_emulation_and_bf16(granularity, tokens):
    from parallel_models.inference.fp8 import (BLOCK, emulated_matmul, fp8_linear, gemm_backend,
                                               quantize_activation, quantize_weight)

    if not _fp8_gpu(granularity):
        pytest.skip(f"no FP8 GEMM for {granularity} scales on this GPU / CUDA")
    g = torch.Generator(device=DEV).manual_seed(tokens)
    x = torch.randn(tokens, 2048, device=DEV, generator=g).bfloat16()
    w = (torch.randn(5632, 2048, device=DEV, generator=g) * 0.02).bfloat16()
    q = quantize_weight(w, granularity)
    assert gemm_backend(x, q) == "scaled_mm"
    from parallel_models.inference.fp8 import gemm

    got = gemm._scaled_mm(x, q).float()
    emulated = emulated_matmul(x.float(), q)
    # fp8_linear runs decode-sized products (<= DECODE_ROWS rows) on the decode kernel
    # (DECODE_KERNEL: TMA W8A8, W8A8-dynamic or weight-only), larger ones on _scaled_mm: it must
    # give what the path it picks gives
    routed = fp8_linear(x, q).float()
    want = got
    if tokens <= gemm.DECODE_ROWS:
        kernel = gemm.decode_kernel(x.device, granularity)
        assert kernel == gemm.DECODE_KERNEL or granularity == "block" and \
            gemm.DECODE_KERNEL == "tma" and kernel == "weight_only"  # (tma: channel scales)
        want = gemm.decode_emulation(kernel)(x, q).float()
    assert ((routed - want).abs() <= 1e-2 * (want.abs() + 1.0)).all()
    # the same quantized operands: only the accumulation (order, fp32 vs tensor cores) and the
    # bf16 output rounding differ
    scale = x.float().abs() @ w.float().abs().t()
    assert ((got - emulated).abs() <= 2e-3 * scale + 1e-2 * emulated.abs()).all()
    # vs the bf16 product: the e4m3 bound of both operands (tests/inference/test_fp8_quantize.py)
    xq, xs = quantize_activation(x.float(), granularity)
    sx = xs.repeat_interleave(BLOCK, 1)[:, :2048] if granularity == "block" else xs[:, None]
    ex = torch.maximum(U * x.float().abs(), SUB * sx)
    sw = (q.scale.repeat_interleave(BLOCK, 0).repeat_interleave(BLOCK, 1)[:5632, :2048]
          if granularity == "block" else q.scale[:, None])
    ew = torch.maximum(U * w.float().abs(), SUB * sw)
    bound = ex @ w.float().abs().t() + x.float().abs() @ ew.t() + ex @ ew.t()
    ref = x.float() @ w.float().t()
    assert ((got - ref).abs() <= bound + 1e-2 * ref.abs() + 2e-3 * scale).all()


def _random_089b(seed: int = 0):
    import parallel_models as pm
    from transformers import LlamaConfig

    from parallel_models.config import ModelConfig

    hf_cfg = LlamaConfig(vocab_size=32000, hidden_size=2048, intermediate_size=5632,
                         num_hidden_layers=16, num_attention_heads=16, num_key_value_heads=8,
                         max_position_embeddings=8192, rope_theta=500000.0,
                         architectures=["LlamaForCausalLM"])
    model = pm.LlamaForCausalLMRmPad(ModelConfig.from_hf(hf_cfg), dtype=torch.bfloat16)
    gen = torch.Generator(device=model.device).manual_seed(seed)
    with torch.no_grad():
        for name, prm in model.named_parameters():
            prm.fill_(1.0) if "norm" in name else prm.normal_(0.0, 0.02, generator=gen)
    model.requires_grad_(False)
    return model


def test_fp8_engine_vs_bf16_on_089b(single_rank):
    from parallel_models.inference import RolloutEngine
    from parallel_models.inference.sampling import SamplingParams
    from parallel_models.utils.padding import pack_padded_batch, unpack_to_padded

    model = _random_089b()
    g = torch.Generator().manual_seed(0)
    prompts = [torch.randint(3, 32000, (int(n),), generator=g).tolist()
               for n in torch.randint(16, 64, (32,), generator=g)]
    params = SamplingParams(greedy=True, ignore_eos=True, max_new_tokens=32)
    bf16 = RolloutEngine(model, kv_budget_tokens=32 * 96, max_rows=32).generate(prompts, params)
    engine = RolloutEngine(model, kv_budget_tokens=32 * 96, max_rows=32, weight_dtype="fp8",
                           shares_training_weights=True)
    fp8 = engine.generate(prompts, params)
    backends = sorted({m.fp8_backend for _, m in engine.fp8.modules})
    mask = fp8.response_mask.bool()
    same = (fp8.responses == bf16.responses)[mask].float().mean().item()
    # the first token: the same context, so its log-prob difference is the FP8 error alone
    first = (fp8.log_probs[:, 0] - bf16.log_probs[:, 0]).abs().mean().item()
    mean_diff = (fp8.log_probs - bf16.log_probs).abs()[mask].mean().item()
    print(f"\nfp8 vs bf16, 0.89B shape, 32 prompts x 32 greedy tokens ({backends}): "
          f"identical tokens {same:.3f}, mean |logprob diff| {mean_diff:.4f} "
          f"(first token {first:.4f})")
    assert backends == ["scaled_mm"] or not _fp8_gpu("block")
    from parallel_models.inference.fp8 import gemm

    # the FP8 engine's sampled log-probs are its model's. The engine prefills through W8A8
    # _scaled_mm and decodes through the decode kernel (gemm.DECODE_KERNEL); a fresh forward
    # cannot mix the two per position, so this engine runs the decode kernel everywhere (prefill
    # too) and a fresh forward through it of its sequences must give its log-probs (bf16
    # batch-shape noise only: the KV cache's attention vs the packed one). A W8A8 kernel (the
    # TMA default) quantizes the activations, so that noise moves some of them to the next e4m3
    # value (measured on an H100: 0.095 with the TMA kernel; a W8A8 prefill with a weight-only
    # decode gave 0.074); the weight-only kernel keeps it at bf16's size. Both stay far below
    # FP8 against bf16 (0.27 above) and a wrong kernel's errors (order 1)
    kernel = gemm.decode_kernel(torch.device(model.device), engine.fp8.granularity)
    bound = 5e-2 if kernel == "weight_only" else 0.15
    rows, gemm.DECODE_ROWS = gemm.DECODE_ROWS, 1 << 30
    try:
        wo = engine.generate(prompts, params)
        packed = pack_padded_batch(wo.sequences, wo.attention_mask)
        with torch.no_grad(), engine.fp8.enabled():
            logits = model(packed.input_ids, packed.cu_seqlens, full_vocab=True).logits.float()
    finally:
        gemm.DECODE_ROWS = rows
    logp = torch.log_softmax(unpack_to_padded(logits, packed), -1)
    P = wo.prompts.shape[1]
    fresh = logp[:, P - 1:-1].gather(-1, wo.responses[..., None]).squeeze(-1)
    wo_mask = wo.response_mask.bool()
    fresh_diff = (fresh - wo.log_probs)[wo_mask].abs().mean().item()
    print(f"{kernel} decode kernel everywhere: engine vs a fresh forward, mean |logprob diff| "
          f"{fresh_diff:.4f}")
    assert fresh_diff <= bound
    # FP8 against bf16 on the same context (the prompts' next-token logits): e4m3 keeps 3
    # mantissa bits (relative 2^-4 per element); a wrong kernel gives errors of order 1
    with torch.no_grad():
        flat = torch.tensor([t for p in prompts for t in p], device=model.device)
        cu = torch.tensor([0] + [len(p) for p in prompts], device=model.device).cumsum(0)
        cu = cu.to(torch.int32)
        ref = model(flat, cu, full_vocab=True).logits.float()
        with engine.fp8.enabled():
            got = model(flat, cu, full_vocab=True).logits.float()
    rel = ((got - ref).norm() / ref.norm()).item()
    print(f"prompt logits, FP8 vs bf16: relative error {rel:.4f}")
    assert rel <= 0.25
    # random weights give nearly flat logits, so greedy picks flip easily: reported, and only
    # the first token's log-prob (same context, the FP8 error alone) is bounded
    assert first < 0.5


def test_triton_activation_quantization_matches_torch():
    from parallel_models.inference.fp8 import gemm
    from parallel_models.inference.fp8.quantize import quantize_activation

    pytest.importorskip("triton")
    from parallel_models.inference.fp8.act_quant_kernel import (quantize_token_groups,
                                                                quantize_tokens)

    g = torch.Generator(device=DEV).manual_seed(0)
    for tokens, cols in ((1, 2048), (64, 5632), (37, 300), (256, 14336)):
        x = torch.randn(tokens, cols, device=DEV, generator=g).bfloat16()
        x[0, :128] = 0
        q, s = quantize_token_groups(x)
        q_ref, s_ref = quantize_activation(x, "block")
        assert s.shape == s_ref.shape and s.stride(0) == 1  # token-major, as _scaled_mm reads
        # one recipe, bit for bit (the torch scales divide by a tensor: CUDA's division by a
        # Python scalar multiplies by its reciprocal, 0.16 % of the values one step apart)
        assert torch.equal(s, s_ref) and torch.equal(q.float(), q_ref.float())
        q, s = quantize_tokens(x)  # per token: _scaled_mm's row-wise scale_a [tokens, 1]
        q_ref, s_ref = quantize_activation(x, "channel")
        assert s.shape == (tokens, 1) and torch.equal(s[:, 0], s_ref)
        assert torch.equal(q.float(), q_ref.float())
    gemm._check_fused_quant(torch.device(DEV))
    assert gemm._fused_quant[str(torch.device(DEV))], "the engine would not use the kernels"


def test_fp8_grouped_experts_gemm_on_hopper():
    """The MoE experts' FP8 grouped GEMM (``torch._scaled_grouped_mm``, channel scales) runs on
    Hopper and agrees with its emulation (the same quantized operands)."""
    from parallel_models.inference.fp8 import grouped_experts as ge
    from parallel_models.inference.fp8.quantize import quantize_weight

    if torch.cuda.get_device_capability()[0] != 9:
        pytest.skip("the FP8 grouped GEMM path is Hopper-only")
    assert ge._scaled_ok(torch.device(DEV)), "see the warning: the experts would run emulated"
    g = torch.Generator(device=DEV).manual_seed(0)
    x = torch.randn(300, 2048, device=DEV, generator=g).bfloat16()
    ws = [quantize_weight(torch.randn(1536, 2048, device=DEV, generator=g) * 0.02, "channel")
          for _ in range(8)]
    wq, sc = torch.stack([w.data for w in ws]), torch.stack([w.scale for w in ws])
    offs = torch.cumsum(torch.tensor([0, 40, 7, 100, 1, 52, 60, 40], device=DEV), 0).int()
    got = ge._scaled(x, wq, sc, offs).float()
    want = ge._emulated(x.float(), wq, sc, offs)
    scale = x.float().abs().mean() * wq.float().abs().mean() * sc.mean() * 2048
    assert (got - want).abs().max() <= 1e-2 * scale + 1e-2 * want.abs().max()


@pytest.mark.parametrize("kernel", ["dynamic", "w8a8", "weight_only", "tma"])
@pytest.mark.parametrize("granularity", ["block", "channel"])
def test_decode_gemm_configs_tuning_and_graph_replay(granularity, kernel):
    """The decode GEMM kernels (W8A8-dynamic: the activations quantized in the kernel; W8A8 on
    activations quantized before it; weight-only) at 8B shapes (down 4096 x 14336 at 64 rows,
    qkv 6144 x 4096 at 256 rows):
    every candidate tile config, the tuned choice, and the tuned kernel captured in a CUDA graph
    and replayed on new activations (the split-K partial sums' hand-over between programs, many
    times) agree with the kernel's emulation (``gemm.dynamic_matmul``: ``x`` quantized per token
    and 128-wide group, then ``x @ dequantize(W)^T``; ``gemm.weight_only_matmul``); the split
    counters end at 0."""
    pytest.importorskip("triton")
    if torch.cuda.get_device_capability() < (8, 9):
        pytest.skip("e4m3 needs SM 8.9+")
    if kernel == "tma" and (granularity == "block" or torch.cuda.get_device_capability() < (9, 0)):
        pytest.skip("the TMA kernel: channel scales, SM 9.0+")
    import importlib

    from parallel_models.inference.fp8 import decode_gemm_shared, decode_tuning, gemm
    from parallel_models.inference.fp8.quantize import QuantizedWeight, quantize_weight

    module = importlib.import_module("parallel_models.inference.fp8." + {
        "weight_only": "weight_only_kernel", "tma": "tma_decode_kernel"}.get(
            kernel, "dynamic_act_kernel"))
    mm, launch = (getattr(module, name) for name in {
        "dynamic": ("dynamic_act_mm", "launch"), "w8a8": ("prequantized_mm", "launch_prequantized"),
        "weight_only": ("weight_only_mm", "launch"), "tma": ("tma_mm", "launch")}[kernel])
    emulation = gemm.decode_emulation(kernel)
    # bf16's rounding, plus 2^-11 of the largest output for the accumulation order; the TMA
    # kernel's tensor cores accumulate all of K in their own precision by default (no fp32
    # promotion: tma_decode_kernel.promote_every() == 0), which left up to 0.9 % of the largest
    # output over K = 14336 on an H100 (docs/PERFORMANCE.md, session 25): 2^-6 for it
    floor = 2.0 ** -6 if kernel == "tma" and module.promote_every() == 0 else 2.0 ** -11
    g = torch.Generator(device=DEV).manual_seed(0)
    for rows, out, inp in ((64, 4096, 14336), (256, 6144, 4096)):
        w = torch.randn(out, inp, device=DEV, generator=g) * 0.02
        q = quantize_weight(w, granularity)
        if granularity == "block":
            storage = gemm.block_scale_storage(out, inp, DEV)
            storage.copy_(q.scale)
            q = QuantizedWeight(q.data, storage, granularity)
        x = torch.randn(rows, inp, device=DEV, generator=g).bfloat16()

        def check(got, x=x):
            want = emulation(x, q).float()
            tol = 2.0 ** -7 * want.abs() + floor * want.abs().max()
            assert ((got.float() - want).abs() <= tol).all()

        y = torch.empty(rows, out, dtype=torch.bfloat16, device=DEV)
        dev = torch.device(DEV)
        for cfg in decode_tuning.candidates(rows, out, inp, granularity,
                                            decode_tuning.sm_count(dev),
                                            decode_tuning.smem_bytes(dev), kernel=kernel):
            check(launch(x, q, y, cfg))
        check(mm(x, q))  # tunes this key
        chosen = decode_tuning.chosen_configs()[decode_tuning.key_of(
            rows, out, inp, granularity, x.device, kernel)]
        print(f"\n{kernel} {granularity} {rows} x {out} x {inp}: {chosen}")
        static = x.clone()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            captured = mm(static, q)
        for _ in range(20):
            static.normal_(generator=g)
            graph.replay()
            check(captured, static)
        for _, counters in decode_gemm_shared._workspaces.values():
            assert int(counters.abs().sum()) == 0


def _tma_generate(monkeypatch, seed: int):
    """``generate()``: a fresh FP8 engine (channel scales, the TMA decode kernel) on the random
    0.89B model, 8 greedy tokens of 16 prompts drawn with ``seed``; skips without SM 9.0."""
    pytest.importorskip("triton")
    if torch.cuda.get_device_capability() < (9, 0):
        pytest.skip("the TMA kernel needs SM 9.0+")
    from parallel_models.inference import RolloutEngine
    from parallel_models.inference.fp8 import gemm
    from parallel_models.inference.sampling import SamplingParams

    model = _random_089b()
    g = torch.Generator().manual_seed(seed)
    prompts = [torch.randint(3, 32000, (int(n),), generator=g).tolist()
               for n in torch.randint(16, 48, (16,), generator=g)]
    params = SamplingParams(greedy=True, ignore_eos=True, max_new_tokens=8)
    monkeypatch.setattr(gemm, "DECODE_KERNEL", "tma")

    def generate():
        engine = RolloutEngine(model, kv_budget_tokens=16 * 64, max_rows=16,
                               weight_dtype="fp8", fp8_scales="channel")
        return engine.generate(prompts, params)

    return generate


def test_tma_decode_reads_the_producers_e4m3_copies(single_rank, monkeypatch):
    """With the TMA decode kernel, the decoder's norms and SwiGLU write the e4m3 copies the
    qkv / gate_up / down GEMMs read (``fused_producers``): only o_proj's input is quantized by the
    GEMM's own launch (three copies read per one quantized). The copies are what the GEMM would
    quantize itself: the same engine with the producers' outputs stripped of their copies (the
    GEMM quantizing every input) samples the same tokens with the same log-probs, bit for bit
    (both with the gate_up GEMM and SwiGLU as two kernels). With them as one
    (``swiglu_gemm_kernel``, the default) its group-scaled copy is read too (three copies per
    one quantized again), and the log-probs move only by that copy's other rounding: the first
    response token (the prefill's) is the same; the second's log-prob moves by e4m3 rounding
    noise of the down GEMM's input (0.090 on an H100; the kernel's recipe is checked exactly in
    tests/inference/test_fp8_swiglu_gemm.py), bounded as the decode kernel's batch-shape noise
    is in test_fp8_engine_vs_bf16_on_089b (0.15); a wrong copy gives errors of order 1."""
    generate = _tma_generate(monkeypatch, 1)
    from parallel_models.inference.fp8 import fused_producers, tma_decode_kernel
    from parallel_models.inference.fp8.quantize import QUANTIZED_COPY
    from parallel_models.llama.layers import fused_ops

    class Stripped(fused_producers.OutputQuantizer):
        """The producers' kernels, their copies dropped."""

        def rms_norm(self, x, residual, weight, eps):
            total, y = super().rms_norm(x, residual, weight, eps)
            delattr(y, QUANTIZED_COPY)
            return total, y

        def swiglu(self, gate_up):
            y = super().swiglu(gate_up)
            delattr(y, QUANTIZED_COPY)
            return y

    counts = {"read": 0, "quantized": 0}
    quantized_input = tma_decode_kernel.quantized_input

    def counted(x2):
        counts["read" if getattr(x2, QUANTIZED_COPY, None) is not None else "quantized"] += 1
        return quantized_input(x2)

    monkeypatch.setattr(tma_decode_kernel, "quantized_input", counted)
    for fuse in (False, True):  # (tunes the decode tiles: every candidate's launch reads its
        monkeypatch.setattr(fused_producers, "FUSE_GATE_UP", fuse)  # input)
        generate()
    runs = {}
    for name, quantizer, fuse in (("copies", fused_producers.QUANTIZER, False),
                                  ("stripped", Stripped(), False),
                                  ("one_kernel", fused_producers.QUANTIZER, True)):
        fused_ops.set_output_quantizer(quantizer)
        monkeypatch.setattr(fused_producers, "FUSE_GATE_UP", fuse)
        counts.update(read=0, quantized=0)
        try:
            runs[name] = (generate(), dict(counts))
        finally:
            fused_ops.set_output_quantizer(fused_producers.QUANTIZER)
    (fused, n_fused), (alone, n_alone) = runs["copies"], runs["stripped"]
    one, n_one = runs["one_kernel"]
    print(f"\nTMA decode inputs, producers' copies read: {n_fused}; stripped: {n_alone}; "
          f"gate_up + SwiGLU one kernel: {n_one}")
    assert n_fused["quantized"] > 0 and n_fused["read"] == 3 * n_fused["quantized"]
    assert n_alone["read"] == 0 and n_alone["quantized"] == 4 * n_fused["quantized"]
    assert torch.equal(fused.responses, alone.responses)
    assert torch.equal(fused.log_probs, alone.log_probs)
    assert n_one == n_fused
    assert torch.equal(one.responses[:, 0], fused.responses[:, 0])
    second = (one.log_probs[:, 1] - fused.log_probs[:, 1]).abs().mean().item()
    print(f"gate_up + SwiGLU in one kernel vs two: second token mean |logprob diff| {second:.5f}")
    assert second <= 0.15


def test_graph_tuning_compares_runners_up_in_the_captured_step(single_rank, monkeypatch):
    """``fp8.graph_tuning`` (on by default; ``PARALLEL_MODELS_FP8_GRAPH_TUNING=0`` off): the
    engine's first decode capture compares each tuned key's runners-up inside the step's
    graph, keeps a config only from that key's agreeing ones, and the engine's log-probs stay
    those of the configs timed alone up to tile rounding (the bound of the decode kernel's
    batch-shape noise, test_fp8_engine_vs_bf16_on_089b)."""
    generate = _tma_generate(monkeypatch, 2)
    from parallel_models.inference.fp8 import decode_tuning, graph_tuning

    for name, value in (("_chosen", {}), ("alternatives", {}), ("fresh", []), ("timings", {})):
        monkeypatch.setattr(decode_tuning, name, value)
    monkeypatch.setattr(graph_tuning, "graph_timings", [])
    monkeypatch.setenv(graph_tuning.ENV, "0")
    alone = generate()  # the configs timed fastest alone; the keys stay fresh
    alone_choices = decode_tuning.chosen_configs()
    assert decode_tuning.fresh and not graph_tuning.graph_timings
    monkeypatch.setenv(graph_tuning.ENV, "1")
    tuned = generate()
    compared = graph_tuning.graph_timings
    print(f"\ngraph tuning: {len(compared)} comparisons, "
          f"{sum(kept for *_, kept in compared)} kept")
    assert compared and not set(decode_tuning.fresh) & decode_tuning.used
    for key, cfg, new_ms, now_ms, kept in compared:
        assert cfg in decode_tuning.alternatives[key] and new_ms > 0 and now_ms > 0
    for key, cfg in decode_tuning.chosen_configs().items():
        kept = [c for k, c, *_, was_kept in compared if k == key and was_kept]
        assert cfg == (kept[-1] if kept else alone_choices[key])
    assert torch.equal(tuned.responses[:, 0], alone.responses[:, 0])  # (the prefill's)
    diff = (tuned.log_probs[:, 1] - alone.log_probs[:, 1]).abs().mean().item()
    assert diff <= 0.15, diff
