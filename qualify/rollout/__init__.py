"""Rollout capture with real vLLM, and the immutable rollout it produces."""
