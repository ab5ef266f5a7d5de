"""Model families: the tiny Qwen3 family made from a seed, and loading of local checkpoints."""
