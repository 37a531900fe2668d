"""Watching a run: metrics (JSONL, TensorBoard, trackers), plots, data-parallel statistics and
validation."""
