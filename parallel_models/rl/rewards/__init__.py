"""Rewards: rule functions (a registry by name, or a user file), how they are called with the
dataset's fields, math answer checking, the value-head reward model with its own tokenizer, and
DAPO's overlong shaping."""
