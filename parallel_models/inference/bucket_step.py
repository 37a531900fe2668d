"""The continuous engine's decode batch sizes (buckets) and one bucket's decode step.

A bucket is a fixed batch size (powers of two up to ``max_rows``); its step reads the rows'
tokens, KV regions and lengths from fixed buffers (``pool_cache.DecodeRows``), so on CUDA it is
captured in a CUDA graph once and replayed whatever rows it holds. Used by
``continuous.ContinuousEngine``.
"""

from __future__ import annotations

import warnings

from parallel_models.llama.layers import exact
from parallel_models.inference.generation import capture_cuda_graph
from parallel_models.inference.pool_cache import DecodeRows, PoolKVCache


def bucket_sizes(max_rows: int) -> list[int]:
    """1, 2, 4, ... below ``max_rows``, then ``max_rows``."""
    out, b = [], 1
    while b < max_rows:
        out.append(b)
        b *= 2
    return out + [max_rows]


class BucketStep:
    """The decode step of one bucket: ``DecodeRows`` buffers -> logits ``[size, vocab]``; a CUDA
    graph captured on the first call when possible (as ``generation._DecodeStep``)."""

    def __init__(self, model, cache: PoolKVCache, rows: DecodeRows, use_graph: bool):
        self.model, self.cache, self.rows = model, cache, rows
        self.use_graph, self.graph, self.logits = use_graph, None, None
        self.exact = False  # whether the graph holds exact mode's kernels (layers/exact)

    def _forward(self):
        self.cache.begin_decode(self.rows)
        hidden, _ = self.model.forward_hidden(self.rows.tokens, self.rows.cu_q, self.rows.lengths,
                                              1, kv_cache=self.cache)
        return self.model._head(hidden, 0, full_vocab=True)

    def __call__(self):
        if not self.use_graph:
            return self._forward()
        if self.graph is not None and self.exact != exact.enabled():
            self.graph = None  # captured with the other kernels: capture again
        if self.graph is None:
            self.exact = exact.enabled()
            try:
                self.graph, self.logits = capture_cuda_graph(self._forward)
            except Exception as err:  # e.g. an op that syncs: run eagerly from now on
                warnings.warn(f"CUDA graph capture of a decode bucket failed ({err}); decoding "
                              "eagerly")
                self.use_graph, self.graph = False, None
                return self._forward()
        self.graph.replay()
        return self.logits
