"""Exact mode (``rollout.exact``): rollout log-probs equal training log-probs bit for bit.

The rollout (prefill and decode steps of varying batch) and the training forward (packed
microbatches) feed the same token through differently shaped kernels, and PyTorch's kernels
(cuBLAS, its reductions, flash attention) choose their reduction order from the shape. While
exact mode is on, every op whose reduction could depend on the batch runs a batch-invariant
Triton kernel (one fixed tile / block configuration, no split reductions):

- matrix products (every linear, the LM head, the MoE router and the grouped experts):
  ``triton_matmul``; the MoE combine and the router softmax: ``triton_rows``;
- RMSNorm (incl. Qwen3's q/k norms) and the next-token log-prob: ``triton_rows``;
- attention: one kernel for prefill, decode and training, ``triton_attention``;
- ``torch.compile`` of the elementwise ops is off (eager elementwise ops are per element).

``mode`` holds the switch (:func:`exact_mode`, :func:`enabled`) and routes the ops; the model
code asks :func:`enabled` at the few places it calls its own kernels (attention, norms, log-probs).
Triton is needed (imported when the mode is switched on); off, nothing changes.
"""

from parallel_models.llama.layers.exact.mode import enabled, exact_mode

__all__ = ["enabled", "exact_mode"]
