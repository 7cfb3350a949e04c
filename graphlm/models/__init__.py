"""Models built from graphlm.nn modules."""
from .gpt import GPT, GPTConfig

__all__ = ["GPT", "GPTConfig"]
