"""What vLLM's batch-invariant mode sets in a process: the capture, its vLLM worker and the rounds' server record it."""

BATCH_INVARIANT_SETTINGS = ("VLLM_BATCH_INVARIANT", "CUBLAS_WORKSPACE_CONFIG", "CUBLASLT_WORKSPACE_SIZE",
                            "VLLM_ALLREDUCE_USE_SYMM_MEM", "VLLM_CUSTOM_ALLREDUCE_ALGO", "NCCL_LAUNCH_MODE", "NCCL_ALGO",
                            "NCCL_PROTO", "NCCL_MIN_NCHANNELS", "NCCL_MAX_NCHANNELS")
"""What vLLM's batch-invariant mode sets in its process (recorded with a rollout captured in it)."""
