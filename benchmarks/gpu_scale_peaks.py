"""Peak GPU memory per stage and GPU: benchmarks/gpu_scale.sh's stage marks against its nvidia-smi samples.

Usage: python benchmarks/gpu_scale_peaks.py STAGES_LOG SMI_CSV   (memory.used in MiB, sampled every 250 ms; it
counts every process on the GPU, the CUDA context and the allocator's cache included)
"""

from __future__ import annotations

import sys
from datetime import datetime
from pathlib import Path


def main(stages_log: str, smi_csv: str) -> None:
    samples = []
    for line in Path(smi_csv).read_text().splitlines():
        parts = [p.strip() for p in line.split(",")]
        if len(parts) != 3 or not parts[2].isdigit():
            continue
        t = datetime.strptime(parts[0], "%Y/%m/%d %H:%M:%S.%f").timestamp()
        samples.append((t, int(parts[1]), int(parts[2])))
    starts = {}
    for line in Path(stages_log).read_text().splitlines():
        kind, stamp, rest = line.rstrip("\n").split(" ", 2)
        if kind == "START":
            starts[rest] = float(stamp)
            continue
        label = rest.rsplit(" rc=", 1)[0]
        t0, t1 = starts.get(label), float(stamp)
        if t0 is None:
            continue
        window = [s for s in samples if t0 <= s[0] <= t1]
        peaks = {}
        for _, gpu, mib in window:
            peaks[gpu] = max(peaks.get(gpu, 0), mib)
        shown = ", ".join(f"GPU{g} {m / 1024:.1f} GiB" for g, m in sorted(peaks.items())) or "no samples"
        print(f"peak {label}: {t1 - t0:.1f} s; {shown}")


if __name__ == "__main__":
    main(*sys.argv[1:3])
