"""Checkpoint converters (console scripts): ``hf2mcore`` (HF folder -> megatron-core GPTModel
dist checkpoint) and ``mcore2hf`` (dist checkpoint saved at any TP/PP -> HF folder).

``convert_hf_to_mcore`` / ``convert_mcore_to_hf`` are the same conversions as functions."""


def __getattr__(name):
    if name == "convert_hf_to_mcore":
        from conversion.hf2mcore import convert_hf_to_mcore

        return convert_hf_to_mcore
    if name == "convert_mcore_to_hf":
        from conversion.mcore2hf import convert_mcore_to_hf

        return convert_mcore_to_hf
    raise AttributeError(name)


__all__ = ["convert_hf_to_mcore", "convert_mcore_to_hf"]
