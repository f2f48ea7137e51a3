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
# manifests pin IMAGE:VERSION, never a moving tag. The binary is stamped
# with VERSION, the commit ($COMMIT, else PKG's HEAD) and the build time
# ($BUILD_TIME, RFC 3339 UTC, else now), which its --version prints
# (internal/buildinfo), and the image carries them as OCI labels
# (org.opencontainers.image.version, .revision, .created, .source).
# deploy/Containerfile builds the same binary inside a golang image instead.
set -euo pipefail
pkg=${1:?say which function: go tool task image FN=orders, or PKG=path/to/cmd/name (usage: deploy/image.sh PKG IMAGE)}
image=${2:?usage: deploy/image.sh PKG IMAGE}
root=$(cd "$(dirname "$0")/.." && pwd)
[ -d "$pkg" ] || { echo "image.sh: $pkg is not a directory holding a main package" >&2; exit 2; }
version=${VERSION:-$(git -C "$pkg" describe --tags --always --dirty 2>/dev/null || echo 0.0.0-dev)}
[[ $version =~ ^[A-Za-z0-9_][A-Za-z0-9_.-]{0,127}$ ]] || { echo "image.sh: VERSION $version is not a valid image tag" >&2; exit 2; }
commit=${COMMIT:-$(git -C "$pkg" rev-parse HEAD 2>/dev/null || true)}
created=${BUILD_TIME:-$(date -u +%Y-%m-%dT%H:%M:%SZ)}
source=${SOURCE_URL:-https://github.com/kfn-dev/kfn}
certs=${CA_CERTIFICATES:-/etc/ssl/certs/ca-certificates.crt}
[ -s "$certs" ] || { echo "image.sh: no CA certificates at $certs: install ca-certificates, or set CA_CERTIFICATES to a PEM bundle" >&2; exit 2; }
mkdir -p "$root/deploy/.build"
# Built in the package's own module (GOWORK=off: a function never needs kfn's tools).
stamp=github.com/kfn-dev/kfn/internal/buildinfo
(cd "$pkg" && CGO_ENABLED=0 GOWORK=off go build -trimpath \
  -ldflags="-s -w -X $stamp.version=$version -X $stamp.commit=$commit -X $stamp.date=$created" \
  -o "$root/deploy/.build/function" .)
cp "$certs" "$root/deploy/.build/ca-certificates.crt"
# --no-cache: podman would otherwise reuse a layer cached with another
# VERSION's label (a few copied files: nothing worth caching).
podman build -q --no-cache -f "$root/deploy/Containerfile.scratch" --build-arg VERSION="$version" \
  --build-arg REVISION="$commit" --build-arg CREATED="$created" --build-arg SOURCE="$source" \
  -t "$image:$version" -t "$image:dev" "$root/deploy" >/dev/null
echo "built image $image:$version (also $image:dev; $(podman image inspect "$image:$version" --format '{{.Size}}') bytes) from $pkg"
