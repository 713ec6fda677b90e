#!/usr/bin/env bash
# The GPU check's kit: what scripts/gpu_check.sh needs on a GPU machine whose Python has torch (and
# torch's own dependencies: filelock, typing_extensions, sympy, networkx, jinja2, fsspec, triton, the
# nvidia-* libraries) and nothing of ours, no network, and whose carried files are limited (~64 MiB
# with the repository's tree).
#   scripts/gpu_kit.sh [OUT]                 build the kit into OUT (default gpu_kit, git-ignored)
#   scripts/gpu_kit.sh --device-python DIR   a stand-in for that machine's Python, to try the kit here:
#                                            a venv in DIR whose site-packages holds only torch and its
#                                            own dependencies (symlinks into .venv); no numpy
# The kit:
#   OUT/site.tar.gz  site/: every distribution below, copied from .venv's site-packages as its RECORD
#                    lists the files, without tests, docs, type stubs, bytecode or scripts (~105 MiB
#                    unpacked: numpy alone is ~45 MiB, so it travels packed; gpu_check.sh unpacks it)
#   OUT/site_stubs/  stand-ins for packages the jobs import that the kit cannot or need not carry
#                    (scripts/gpu_stubs/: each says which import pulls it in, and what it does)
#   OUT/kit.env      KIT_PYTHON / KIT_MACHINE: the Python (major.minor) and machine the kit was built on;
#                    KIT_NEEDS_PYTHON: that version when the kit carries extension modules built for it
#                    alone (numpy's, pydantic-core's...: cpython-312 .so files), empty if none
#   OUT/MANIFEST     each distribution's version and unpacked size, the .so files, the stubs
# gpu_check.sh puts OUT/site_stubs and OUT/site on PYTHONPATH (the rank processes inherit it).
# The closure was found by running each job of gpu_check.sh on the CPU with the kit under
# --device-python, in a copy of the repository's tree (no outputs/), until each one ran ok;
# tests/test_gpu_kit.py does that for the titan job.
set -euo pipefail
cd "$(dirname "$0")/.."
VENV_PY=.venv/bin/python
test -x "$VENV_PY" || { echo "gpu_kit: $VENV_PY missing (make venv)" >&2; exit 1; }

# torch's own dependencies (its wheel's Requires-Dist, and theirs): on the device with torch, not carried
TORCH_DISTS="torch filelock setuptools sympy mpmath networkx jinja2 markupsafe fsspec triton cuda-toolkit
cuda-bindings cuda-pathfinder nvidia-* typing-extensions"

# What the jobs import, pinned to the versions the project runs (pyproject.toml / Makefile).
# The frameworks and their import-time dependencies:
#   megatron-core: numpy packaging; deepspeed: pydantic (+ pydantic-core annotated-types typing-inspection)
#   hjson msgpack psutil py-cpuinfo tqdm einops; torchtitan: tyro (+ docstring-parser typeguard)
#   spmd_types torchdata tokenizers (the titan jobs' BPE, launchers/titan_assets.py), tensorboard
#   (torchtitan/components/metrics.py:15 imports torch.utils.tensorboard, which needs tensorboard,
#   protobuf, absl-py at import; nothing writes TensorBoard logs); launch.py: hydra-core omegaconf
#   antlr4-python3-runtime pyyaml, hydra-submitit-launcher submitit cloudpickle (the repo's
#   hydra_plugins/train_ledger imports them), rich (+ markdown-it-py mdurl pygments) for its tables.
# typing-extensions is torch's too; carried because pydantic 2.14 needs >= 4.16 (torch 2.11 does not).
KIT_DISTS="megatron-core==0.18.0 deepspeed==0.19.8 torchtitan==0.3.0
numpy==2.5.5 packaging==26.4
pydantic==2.14.4 pydantic-core==2.50.5 annotated-types==0.8.0 typing-inspection==0.4.5 typing-extensions==4.16.0
hjson==3.1.0 msgpack==1.2.4 psutil==7.2.2 py-cpuinfo==9.0.0 tqdm==4.70.1 einops==0.8.2
tyro==1.0.17 docstring-parser==0.18.0 typeguard==4.6.1 spmd_types==0.2.3 torchdata==0.11.0 tokenizers==0.23.3
tensorboard==2.21.0 protobuf==7.36.2 absl-py==2.5.1
hydra-core==1.3.8 omegaconf==2.3.1 antlr4-python3-runtime==4.9.3 pyyaml==6.0.4
hydra-submitit-launcher==1.2.0 submitit==1.5.4 cloudpickle==3.1.3
rich==15.0.0 markdown-it-py==4.3.0 mdurl==0.1.2 pygments==2.21.0"
# files of those left out: none is imported by a job (TensorBoard's web app, torchtitan's experiments,
# C headers, type stubs; tests/ and docs/ folders go anyway)
KIT_EXCLUDE="tensorboard/webfiles.zip torchtitan/experiments/* numpy/_core/include/* *.pyi"

if [ "${1:-}" = "--device-python" ]; then
    DIR=${2:?usage: scripts/gpu_kit.sh --device-python DIR}
    BASE=$("$VENV_PY" -c 'import sys; print(sys._base_executable)')
    rm -rf "$DIR"
    "$BASE" -m venv --without-pip "$DIR"
    DEST=$("$DIR/bin/python" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')
    "$VENV_PY" - "$DEST" $TORCH_DISTS <<'EOF'
import fnmatch, os, sys
from importlib import metadata
dest, pats = sys.argv[1], sys.argv[2:]
norm = lambda n: n.lower().replace("_", "-")
tops = set()
for d in metadata.distributions():
    if any(fnmatch.fnmatch(norm(d.metadata["Name"]), norm(p)) for p in pats):
        tops |= {f.parts[0] for f in d.files or () if f.parts[0] not in ("..", "__pycache__")
                 and not f.parts[0].endswith(".pth")}
src = os.path.dirname(str(metadata.distribution("torch").locate_file("torch")))
for t in sorted(tops):
    if os.path.exists(os.path.join(src, t)):
        os.symlink(os.path.join(src, t), os.path.join(dest, t))
print(f"gpu_kit: {dest}: {len(tops)} entries of torch's distributions (symlinks), nothing else")
EOF
    exit 0
fi

OUT=${1:-gpu_kit}
STAGE=$(mktemp -d)
trap 'rm -rf "$STAGE"' EXIT
mkdir -p "$STAGE/site"
KIT_EXCLUDE=$KIT_EXCLUDE "$VENV_PY" - "$STAGE" $KIT_DISTS <<'EOF'
import fnmatch, os, platform, shutil, sys
from importlib import metadata
stage, pins = sys.argv[1], sys.argv[2:]
exclude = os.environ["KIT_EXCLUDE"].split()
SKIP_DIRS = {"tests", "test", "docs", "doc", "examples", "benchmarks", "__pycache__"}
site = os.path.join(stage, "site")
lines, sos, total = [], [], 0
for pin in pins:
    name, want = pin.split("==")
    d = metadata.distribution(name)
    if d.version != want:
        sys.exit(f"gpu_kit: .venv has {name} {d.version}, the kit pins {want}")
    size = 0
    for f in d.files or ():
        parts, rel = f.parts, "/".join(f.parts)
        if parts[0] == ".." or f.suffix in (".pyc", ".pth") or SKIP_DIRS & set(parts[1:-1]):
            continue
        if parts[0].endswith(".dist-info") and parts[-1] in ("RECORD", "INSTALLER", "REQUESTED", "direct_url.json"):
            continue
        if any(fnmatch.fnmatch(rel, x) for x in exclude):
            continue
        src = str(d.locate_file(f))
        if not os.path.isfile(src):
            continue
        dst = os.path.join(site, *parts)
        os.makedirs(os.path.dirname(dst), exist_ok=True)
        shutil.copy2(src, dst)
        size += os.path.getsize(dst)
        if ".so" in f.suffixes:
            sos.append(rel)
    total += size
    lines.append(f"{name} {d.version} {size / 2**20:.2f} MiB")
py = "%d.%d" % sys.version_info[:2]
tag = f"cpython-{sys.version_info[0]}{sys.version_info[1]}-"
bound = [s for s in sos if tag in s]  # abi3 and plain shared libraries load on any CPython 3
with open(os.path.join(stage, "MANIFEST"), "w") as fh:
    fh.write(f"# distribution version unpacked-size (scripts/gpu_kit.sh, from .venv; Python {py}, {platform.machine()})\n")
    fh.write("\n".join(lines) + f"\n# total {total / 2**20:.1f} MiB unpacked\n")
    fh.write(f"# extension modules and shared libraries ({len(bound)} built for CPython {py} alone: 'so{py}')\n")
    fh.write("".join(f"{'so' + py if s in bound else 'so'} {s}\n" for s in sos))
with open(os.path.join(stage, "kit.env"), "w") as fh:
    fh.write(f"KIT_PYTHON={py}\nKIT_MACHINE={platform.machine()}\nKIT_NEEDS_PYTHON={py if bound else ''}\n")
print(f"gpu_kit: {len(pins)} distributions, {total / 2**20:.1f} MiB unpacked, {len(sos)} .so files "
      f"({len(bound)} for CPython {py} alone)")
EOF
rm -rf "$OUT"
mkdir -p "$OUT/site_stubs"
tar czf "$OUT/site.tar.gz" -C "$STAGE" site
cp "$STAGE/kit.env" "$STAGE/MANIFEST" "$OUT/"
cp -r scripts/gpu_stubs/. "$OUT/site_stubs/"
find "$OUT/site_stubs" -name __pycache__ -prune -exec rm -rf {} +
for s in "$OUT"/site_stubs/*; do
    case $s in */_*) ;; *) echo "stub $(basename "$s" .py)" >>"$OUT/MANIFEST" ;; esac
done
echo "gpu_kit: $OUT: $(du -sb "$OUT" | cut -f1) bytes ($(du -sh "$OUT" | cut -f1)), $(cat "$OUT/kit.env" | tr '\n' ' ')"
