"""qualify: numerics qualification and acceptance harness for RL post-training stacks."""

__version__ = "0.1.0"
