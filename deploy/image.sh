#!/usr/bin/env bash
# Builds a function's image: a static binary built on this machine, packaged
# FROM scratch (deploy/Containerfile.scratch), so no base image is pulled.
# Usage: deploy/image.sh PKG IMAGE
#   PKG:   a directory holding the function's main package: ./functions/orders/cmd/orders,
#          or the cmd/NAME of a function module made by `kfn new` (built in its own module)
#   IMAGE: the image's name, e.g. kfn-orders
# deploy/Containerfile builds the same binary inside a golang image instead.
set -euo pipefail
pkg=${1:?say which function: go tool task image FN=orders, or PKG=path/to/cmd/name (usage: deploy/image.sh PKG IMAGE)}
image=${2:?usage: deploy/image.sh PKG IMAGE}
root=$(cd "$(dirname "$0")/.." && pwd)
[ -d "$pkg" ] || { echo "image.sh: $pkg is not a directory holding a main package" >&2; exit 2; }
mkdir -p "$root/deploy/.build"
# Built in the package's own module (GOWORK=off: a function never needs kfn's tools).
(cd "$pkg" && CGO_ENABLED=0 GOWORK=off go build -trimpath -ldflags="-s -w" -o "$root/deploy/.build/function" .)
podman build -q -f "$root/deploy/Containerfile.scratch" -t "$image" "$root/deploy" >/dev/null
echo "built image $image ($(podman image inspect "$image" --format '{{.Size}}') bytes) from $pkg"
