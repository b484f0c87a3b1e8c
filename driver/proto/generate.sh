#!/usr/bin/env bash
# Regenerates the Python code for the kubelet plugin protos. Run from the repository
# root: `driver/proto/generate.sh [OUT_DIR]` (default: driver/proto). The output is
# committed; tests regenerate into a temporary folder and compare, so keep this
# deterministic. PYTHON picks the interpreter (default: .venv/bin/python), which
# must have grpcio-tools.
set -euo pipefail

PYTHON="${PYTHON:-.venv/bin/python}"
SRC="driver/proto"
OUT="${1:-$SRC}"
PKG="gpudra.driver.proto"

if [[ ! -d "$SRC" ]]; then
  echo "generate.sh: run from the repository root (no $SRC here)" >&2
  exit 2
fi
mkdir -p "$OUT"

for proto in "$SRC"/*.proto; do
  name="$(basename "$proto" .proto)"
  "$PYTHON" -m grpc_tools.protoc -I "$SRC" \
    --python_out="$OUT" --pyi_out="$OUT" --grpc_python_out="$OUT" "$proto"
  # protoc writes top-level imports; the code lives in a package, so make them absolute.
  sed -i -E "s/^import ${name}_pb2 as /from ${PKG} import ${name}_pb2 as /" \
    "$OUT/${name}_pb2_grpc.py"
  # Message classes report this as their __module__; give them the importable name.
  sed -i -E "s/BuildTopDescriptorsAndMessages\(DESCRIPTOR, '${name}_pb2'/BuildTopDescriptorsAndMessages(DESCRIPTOR, '${PKG}.${name}_pb2'/" \
    "$OUT/${name}_pb2.py"
done
