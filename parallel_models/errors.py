"""Exceptions shared by light and heavy modules alike; importing this file imports nothing else,
so the PPO config and the console scripts can raise and catch them without torch."""


class ConfigError(ValueError):
    """A model or parallel setting that cannot work; the message names the values."""


__all__ = ["ConfigError"]
