"""Benchmark-only workaround, copied to /tmp/site/sitecustomize.py on the GPU machine (see BENCHMARKS.md, issue 18).

qualify/rounds/client.py imports `shm_segments` from qualify.rollout.capture, which commit 52ef516 moved away
(qualify.rollout.shm), so `qualify rounds` fails to import at that commit. This puts back the function that
commit removed, unchanged (the names of vLLM's /dev/shm segments), when qualify.rounds.client is imported.
"""

import importlib.abc
import sys
from pathlib import Path


def _shm_segments() -> set[str]:
    shm = Path("/dev/shm")
    return {p.name for p in shm.glob("vllm*")} if shm.is_dir() else set()


class _PutBack(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path, target=None):
        if name == "qualify.rounds.client":
            from qualify.rollout import capture

            if not hasattr(capture, "shm_segments"):
                capture.shm_segments = _shm_segments


sys.meta_path.insert(0, _PutBack())
