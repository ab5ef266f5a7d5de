"""Whether this Python holds qualify's GPU stack as requirements/gpu.lock pins it, with a CUDA torch.

Exit 0 with one line when it does; else exit 1 naming what is missing or at another version (--quiet: no line when
it does)."""

import importlib.metadata as md
import importlib.util
import re
import sys
from pathlib import Path

LOCK = Path(__file__).resolve().parent.parent / "requirements" / "gpu.lock"


def pins() -> dict[str, str]:
    out = {}
    for line in LOCK.read_text().splitlines():
        line = line.split("#", 1)[0].strip()
        if line:
            name, _, version = line.partition("==")
            out[re.sub(r"[-_.]+", "-", name).lower()] = version
    return out


def main() -> None:
    problems = []
    for name, version in sorted(pins().items()):
        try:
            have = md.version(name)
        except md.PackageNotFoundError:
            problems.append(f"missing: {name}=={version}")
            continue
        if have != version:
            problems.append(f"{name} {have} (the lock pins {version})")
    import torch

    if not torch.cuda.is_available():
        problems.append(f"torch {torch.__version__} sees no CUDA GPU")
    if importlib.util.find_spec("qualify") is None:
        problems.append("qualify is not importable (pip install --no-deps -e . in the repository)")
    if problems:
        sys.exit("GPU environment: " + "; ".join(problems))
    if "--quiet" not in sys.argv:
        print(f"GPU environment ok: torch {torch.__version__} ({torch.cuda.get_device_name(0)}), vllm "
              f"{md.version('vllm')}, megatron-core {md.version('megatron-core')}, deepspeed {md.version('deepspeed')}")


if __name__ == "__main__":
    main()
