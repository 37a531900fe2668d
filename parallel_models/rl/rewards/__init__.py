"""Rewards: rule functions (a registry by name, or a user file), how they are called with the
dataset's fields, math answer checking, and the value-head reward model with its own tokenizer."""
