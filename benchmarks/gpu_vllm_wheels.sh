#!/usr/bin/env bash
# Build, where pip reaches a registry, what a CUDA host without registry access needs to run qualify with GPU vLLM,
# in ignored folders:
#   .gpu/dl/vllm-0.26.0-*.whl    the vllm wheel (304 MB)
#   .gpu/deps                    vllm's dependencies a CUDA PyTorch image lacks (about 55 MB)
#   .whl/                        megatron-core, deepspeed, hjson, pydantic & co (what gpu_chain.sh installs)
#   .gpu/slurm-debs              Debian 12's Slurm 22.05 for scripts/slurm-gpu.sh (apt-get download, 4.5 MB)
#   .gpu/xz/p00 [.. pNN]         all the wheels above unpacked into one site and xz-compressed (SHA256SUMS in p00): one
#                                part, or with PART_MIB=N parts of N MiB each for an offline transfer in parts of a
#                                chosen size
#   WHEELHOUSE=DIR               also every wheel in one directory: `scripts/install-gpu.sh --wheelhouse DIR` installs
#                                requirements/gpu.lock from it into the host's Python, with no registry
# vllm 0.26.0 pins torch 2.11.0 (CUDA 13), the host's torch. Dependencies are resolved for Python 3.12
# against stand-in wheels of torch/torchvision/torchaudio ("2.11.0+image", no requirements), so the resolver
# keeps the host's torch instead of fetching a second one; packages the host already has are then dropped.
# On the GPU host, with the parts copied there, `bash benchmarks/gpu_vllm_chain.sh part DIR` for each part, then
# `bash benchmarks/gpu_vllm_chain.sh install` (or run|chain OUT) joins them and unpacks the site into /tmp/site.
# Usage: [PART_MIB=N] [WHEELHOUSE=DIR] bash benchmarks/gpu_vllm_wheels.sh
set -euo pipefail
cd "$(dirname "$0")/.."
vllm=vllm==0.26.0
plat=(--only-binary=:all: --python-version 3.12 --implementation cp --abi cp312 --abi abi3 --abi none)
for p in manylinux_2_39 manylinux_2_35 manylinux_2_34 manylinux_2_31 manylinux_2_28 manylinux_2_27 manylinux_2_24 \
         manylinux_2_17 manylinux2014 manylinux1 linux; do plat+=(--platform "${p}_x86_64"); done
plat+=(--platform any)
# What the target host's Python already holds (a CUDA PyTorch image's packages, listed 2026-11-17); edit for another host.
image="absl-py accelerate aiofiles aiohappyeyeballs aiohttp aiosignal annotated-doc anyio attrs botorch build \
certifi charset-normalizer chex click cloudpickle cmake colorama contourpy coverage cuda-bindings cuda-core \
cuda-pathfinder cuda-toolkit cupy-cuda13x cycler cython diffrax e3nn einops equinox etils execnet filelock \
flatbuffers flax fonttools formulaic frozenlist fsspec gpytorch grpcio h11 h5py hf-xet httpcore httpx \
huggingface-hub humanize hypothesis idna imageio iniconfig interface-meta jax jaxlib jaxtyping jinja2 joblib \
kiwisolver lazy-loader lightning lightning-utilities linear-operator lineax llvmlite lxml markdown \
markdown-it-py markupsafe matplotlib mdurl meson ml-dtypes mpi4py mpmath msgpack multidict multipledispatch \
mypy-extensions nanobind narwhals networkx ninja numba numba-cuda numpy numpyro onnx onnx-ir onnxruntime \
onnxscript opencv-python-headless optax opt-einsum opt-einsum-fx optimistix orbax-checkpoint packaging pandas \
pathspec patsy peft pillow pip pluggy portalocker prometheus-client propcache protobuf psutil pyarrow pybind11 \
py-cpuinfo pygments pyparsing pyproject-hooks pyre-extensions pytest python-dateutil pyyaml regex requests \
rich sacrebleu safetensors scikit-build-core scikit-image scikit-learn scipy seaborn sentencepiece \
sentence-transformers setuptools shellingham simplejson six sortedcontainers statsmodels sympy tabulate \
tensorboard tensorstore threadpoolctl tifffile tiktoken timm tokenizers toolz torch torchaudio torchdiffeq \
torchvision tqdm transformers treescope triton typer typing-inspect urllib3 uvloop wadler-lindig werkzeug \
wheel wrapt xarray xxhash yarl zipp"
# Optional back ends that offline generate with the torch sampler never imports (226 MB together): the
# FlashInfer sampler is off (VLLM_USE_FLASHINFER_SAMPLER=0), no video/audio decoding, no TileLang kernels.
# (apache-tvm-ffi is not optional: vLLM 0.26.0 imports tvm_ffi when it starts an engine.)
skip="flashinfer-python tokenspeed-triton tilelang z3-solver pynvvideocodec torchcodec"
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
rm -rf .gpu/deps
mkdir -p "$work/stub" .gpu/deps .whl
for s in torch:2.11.0 torchvision:0.26.0 torchaudio:2.11.0; do
  python3 - "$work/stub" "${s%%:*}" "${s##*:}+image" <<'PY'
import sys, zipfile
out, name, ver = sys.argv[1:]
dist = f"{name}-{ver}.dist-info"
files = {f"{dist}/METADATA": f"Metadata-Version: 2.1\nName: {name}\nVersion: {ver}\n",
         f"{dist}/WHEEL": "Wheel-Version: 1.0\nGenerator: stub\nRoot-Is-Purelib: true\nTag: py3-none-any\n"}
files[f"{dist}/RECORD"] = "".join(f"{k},,\n" for k in files) + f"{dist}/RECORD,,\n"
with zipfile.ZipFile(f"{out}/{name}-{ver}-py3-none-any.whl", "w") as z:
    for k, v in files.items():
        z.writestr(k, v)
PY
done
python3 -m pip install --dry-run --ignore-installed --target "$work/t" --find-links "$work/stub" "${plat[@]}" \
  --report "$work/report.json" "$vllm" >/dev/null
python3 - "$work/report.json" "$image $skip" > "$work/wanted.txt" <<'PY'
import json, re, sys
norm = lambda n: re.sub(r"[-_.]+", "-", n).lower()
image = {norm(n) for n in sys.argv[2].split()}
for item in json.load(open(sys.argv[1]))["install"]:
    name, url = norm(item["metadata"]["name"]), item["download_info"]["url"]
    if name in image or name.startswith("nvidia-") or "+image" in item["metadata"]["version"]:
        continue
    print(url)
PY
# pull each resolved file (the report's own URLs, so exactly what was resolved)
while read -r url; do
  f=${url##*/}; f=${f%%#*}
  case $f in vllm-*) dest=.gpu/dl ;; *) dest=.gpu/deps ;; esac
  mkdir -p $dest
  [ -s "$dest/$f" ] || python3 - "$url" "$dest/$f" <<'PY'
import shutil, sys, urllib.request
with urllib.request.urlopen(sys.argv[1]) as r, open(sys.argv[2], "wb") as f:
    shutil.copyfileobj(r, f)
PY
done < "$work/wanted.txt"
# the engines' wheels (gpu_chain.sh installs .whl/*.whl)
python3 -m pip download -q --no-deps "${plat[@]}" -d .whl megatron-core==0.16.1 hjson pydantic==2.14.4 pydantic-core==2.50.5 \
  annotated-types typing-inspection typing-extensions
python3 -m pip wheel -q --no-deps -w .whl deepspeed==0.19.8
# pydantic & co are also vllm deps: keep one copy of each (in .whl/, which gpu_chain.sh installs last)
for w in .whl/*.whl; do n=$(basename "$w" | cut -d- -f1); rm -f .gpu/deps/"$n"-*.whl; done
if [ -d .gpu/slurm-debs ] || command -v apt-get >/dev/null; then
  mkdir -p .gpu/slurm-debs
  (cd .gpu/slurm-debs && apt-get download slurmctld slurmd slurm-client slurm-wlm-basic-plugins libslurm38 munge \
    libmunge2 libdbus-1-3 libjson-c5 liblua5.1-0 libyaml-0-2 libnuma1 libreadline8 libhwloc15)
fi
# One bundle: every wheel unpacked as pip --target would (vllm, its deps, then .whl/ so its copies win), less what
# offline generation on Hopper never loads (FlashAttention 2's kernels, FA3 serves sm90; the vllm-rs server
# binary; deep_gemm's extensions for other Pythons), tarred and xz-compressed (about 153 MB from 355 MB of
# wheels): one part, or parts of PART_MIB MiB.
rm -rf .gpu/xz "$work/site"
python3 - "$work/site" .gpu/dl/vllm-*.whl .gpu/deps/*.whl .whl/*.whl <<'PY'
import shutil, sys, zipfile
from pathlib import Path
out = Path(sys.argv[1])
drop = {"vllm/vllm_flash_attn/_vllm_fa2_C.abi3.so", "vllm/vllm-rs"}
for wheel in sys.argv[2:]:
    with zipfile.ZipFile(wheel) as z:
        for info in z.infolist():
            name, parts = info.filename, info.filename.split("/")
            if name.endswith("/") or name in drop or ("deep_gemm/_C.cpython-3" in name and "cpython-312" not in name):
                continue
            if parts[0].endswith(".data"):
                if parts[1] not in ("purelib", "platlib"):
                    continue
                name = "/".join(parts[2:])
            dest = out / name
            dest.parent.mkdir(parents=True, exist_ok=True)
            with z.open(info) as src, open(dest, "wb") as f:
                shutil.copyfileobj(src, f)
            if (info.external_attr >> 16) & 0o111:
                dest.chmod(0o755)
PY
mkdir -p .gpu/xz
tar -C "$work/site" -cf - . | xz -6 -T0 > .gpu/xz/site.tar.xz
# one part unless PART_MIB asks for parts of that size; SHA256SUMS goes with the first part
size=$(stat -c %s .gpu/xz/site.tar.xz)
part=$(( ${PART_MIB:-0} > 0 ? PART_MIB * 1024 * 1024 : size + 1 ))
(cd .gpu/xz && sha256sum site.tar.xz > SHA256SUMS && split -b "$part" -d -a 2 site.tar.xz part- && rm site.tar.xz)
for p in .gpu/xz/part-*; do n=${p##*-}; mkdir -p .gpu/xz/p"$n" && mv "$p" .gpu/xz/p"$n"/; done
mv .gpu/xz/SHA256SUMS .gpu/xz/p00/
if [ -n "${WHEELHOUSE:-}" ]; then  # the wheels themselves, for scripts/install-gpu.sh --wheelhouse
  mkdir -p "$WHEELHOUSE" && cp .gpu/dl/*.whl .gpu/deps/*.whl .whl/*.whl "$WHEELHOUSE"/
fi
du -sh .gpu/dl .gpu/deps .whl .gpu/slurm-debs .gpu/xz/p* ${WHEELHOUSE:+"$WHEELHOUSE"} || true
