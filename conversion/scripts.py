"""The ``hf2mcore`` and ``mcore2hf`` console scripts: parse the command line first, import the
converter (torch, megatron-core, transformers) only once the arguments are good."""

from __future__ import annotations

from conversion._cli import convert_main, hf2mcore_parser, mcore2hf_parser, quiet_megatron_import


def hf2mcore(argv=None) -> int:
    def convert(args):
        with quiet_megatron_import():
            from conversion.hf2mcore import convert_args
        return convert_args(args)

    return convert_main("hf2mcore", hf2mcore_parser(), argv, convert)


def mcore2hf(argv=None) -> int:
    def convert(args):
        with quiet_megatron_import():
            from conversion.mcore2hf import convert_args
        return convert_args(args)

    return convert_main("mcore2hf", mcore2hf_parser(), argv, convert)
