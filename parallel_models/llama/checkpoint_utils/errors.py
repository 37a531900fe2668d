"""The one error type of the checkpoint code: a checkpoint that cannot be read or written as
asked. Every message names the file, tensor or setting at fault."""


class CheckpointError(RuntimeError):
    """A checkpoint that cannot be read as asked; the message names the file or tensor."""
