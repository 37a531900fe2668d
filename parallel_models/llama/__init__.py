"""The one Llama-style decoder and everything built on it: the families (``families/``), the
parallel layers (``layers/``), the decoder and its variants (``modeling.py``) and the checkpoint
formats (``checkpoint_utils/``)."""
