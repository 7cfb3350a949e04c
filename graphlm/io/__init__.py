"""Reading and writing model files: weight import from other formats, checkpoints."""
from .checkpoint import Checkpoint, load_checkpoint, read_checkpoint, save_checkpoint
from .hf_gpt2 import load_hf_gpt2

__all__ = ["load_hf_gpt2", "Checkpoint", "save_checkpoint", "load_checkpoint", "read_checkpoint"]
