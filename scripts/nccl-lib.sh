# Sourced by the GPU-machine scripts that run NCCL builds (the train example with --features nccl,
# which the build linked against a stub of libnccl.so.2): puts the real library, from PyTorch's
# nvidia-nccl wheel in python3's site-packages, in front of LD_LIBRARY_PATH and sets NCCL_LIB to
# its folder (empty, and a non-zero status, when python3 has no such wheel).
NCCL_LIB=$(python3 - <<'PY'
import glob, site
for d in site.getsitepackages():
    hits = sorted(glob.glob(f"{d}/nvidia/**/libnccl.so.2", recursive=True))
    if hits:
        print(hits[0].rsplit("/", 1)[0])
        break
PY
)
if [[ -n $NCCL_LIB ]]; then
    export LD_LIBRARY_PATH=$NCCL_LIB${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}
else
    false
fi
