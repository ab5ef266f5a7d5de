"""The model family: the tiny Qwen3 family made from a seed, checkpoints, precisions, and the one HF loader and
scorer (qualify.models.hf) used by the reference and the engines."""
