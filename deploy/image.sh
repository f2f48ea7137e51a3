#!/usr/bin/env bash
# Builds a function's image: a static binary built on this machine, packaged
# FROM scratch (deploy/Containerfile.scratch) with the host's CA
# certificates and a non-root user, so no base image is pulled.
# Usage: deploy/image.sh PKG IMAGE
#   PKG:   a directory holding the function's main package: ./functions/orders/cmd/orders,
#          or the cmd/NAME of a function module made by `kfn new` (built in its own module)
#   IMAGE: the image's name, e.g. kfn-orders
# The image is tagged IMAGE:VERSION and IMAGE:dev. VERSION is $VERSION, or
# else `git describe --tags --always --dirty` of PKG's checkout (a tag such
# as v0.1.0, or a commit), or else 0.0.0-dev outside a git checkout; deploy
# manifests pin IMAGE:VERSION, never a moving tag.
# deploy/Containerfile builds the same binary inside a golang image instead.
set -euo pipefail
pkg=${1:?say which function: go tool task image FN=orders, or PKG=path/to/cmd/name (usage: deploy/image.sh PKG IMAGE)}
image=${2:?usage: deploy/image.sh PKG IMAGE}
root=$(cd "$(dirname "$0")/.." && pwd)
[ -d "$pkg" ] || { echo "image.sh: $pkg is not a directory holding a main package" >&2; exit 2; }
version=${VERSION:-$(git -C "$pkg" describe --tags --always --dirty 2>/dev/null || echo 0.0.0-dev)}
[[ $version =~ ^[A-Za-z0-9_][A-Za-z0-9_.-]{0,127}$ ]] || { echo "image.sh: VERSION $version is not a valid image tag" >&2; exit 2; }
certs=${CA_CERTIFICATES:-/etc/ssl/certs/ca-certificates.crt}
[ -s "$certs" ] || { echo "image.sh: no CA certificates at $certs: install ca-certificates, or set CA_CERTIFICATES to a PEM bundle" >&2; exit 2; }
mkdir -p "$root/deploy/.build"
# Built in the package's own module (GOWORK=off: a function never needs kfn's tools).
(cd "$pkg" && CGO_ENABLED=0 GOWORK=off go build -trimpath -ldflags="-s -w" -o "$root/deploy/.build/function" .)
cp "$certs" "$root/deploy/.build/ca-certificates.crt"
# --no-cache: podman would otherwise reuse a layer cached with another
# VERSION's label (a few copied files: nothing worth caching).
podman build -q --no-cache -f "$root/deploy/Containerfile.scratch" --build-arg VERSION="$version" \
  -t "$image:$version" -t "$image:dev" "$root/deploy" >/dev/null
echo "built image $image:$version (also $image:dev; $(podman image inspect "$image:$version" --format '{{.Size}}') bytes) from $pkg"
