#!/bin/sh
# Build our native kernels (service/engine/native/*.c) into service/engine/native/libcosyvoice_lite_native.so.
# `make native` and docker/Dockerfile run this one script, so the flags are the same everywhere. The kernels pick
# their instructions at run time (function target attributes), so the library built on one x86-64 host runs on any.
#   sh scripts/build_native.sh            no C compiler: print a notice and exit 0 (the engine runs ONNX Runtime's graphs)
#   sh scripts/build_native.sh --require  no C compiler: fail (the image build installs one)
set -eu
dir="$(cd "$(dirname "$0")/.." && pwd)/service/engine/native"
cc="${CC:-cc}"
if ! command -v "$cc" >/dev/null 2>&1; then
    if [ "${1:-}" = "--require" ]; then
        echo "build_native.sh: no C compiler ($cc)" >&2
        exit 1
    fi
    echo "native kernels not built: no C compiler ($cc); ONNX Runtime's graphs run instead (apt-get install gcc)"
    exit 0
fi
"$cc" -O3 -fPIC -shared -std=gnu11 -Wall -Wextra -Werror -o "$dir/libcosyvoice_lite_native.so" "$dir"/*.c -lpthread
