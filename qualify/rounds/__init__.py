"""`qualify rounds`: PPO rounds with live actor-weight installation into a running vLLM engine, and the probes."""
