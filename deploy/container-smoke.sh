#!/usr/bin/env bash
# Builds a function image with deploy/image.sh (FROM scratch) and runs it
# with podman: the image must hold the CA certificates and the non-root user
# it runs as, be tagged and labelled with the version, and its binary's
# --version must print it; without configuration it must
# exit 2 naming every missing setting; with unreachable services it must
# exit 1 saying which; its health check must fail naming KFN_METRICS_ADDR
# when there is no metrics address. It also checks that .containerignore
# keeps .git, bin/ and the Kafka cache out of a build from the repository root.
# Usage: deploy/container-smoke.sh [function]   (default: orders)
set -euo pipefail
cd "$(dirname "$0")/.."
fn=${1:-orders}
export CONTAINERS_CONF=${CONTAINERS_CONF:-$PWD/deploy/containers.conf}
export VERSION=${VERSION:-$(git describe --tags --always --dirty 2>/dev/null || echo 0.0.0-dev)}
image="kfn-$fn:$VERSION"
deploy/image.sh "./functions/$fn/cmd/$fn" "kfn-$fn"
fail() { echo "container smoke test: $*"; exit 1; }

# What the image holds: the files of a created (never started) container.
ctr=$(podman create "$image")
files=$(podman export "$ctr" | tar -t)
passwd=$(podman export "$ctr" | tar -xO etc/passwd)
podman rm "$ctr" >/dev/null
for f in function etc/passwd etc/group etc/ssl/certs/ca-certificates.crt; do
  grep -qx "$f" <<<"$files" || fail "the image has no /$f"
done
user=$(podman image inspect "$image" --format '{{.Config.User}}')
[ "${user%%:*}" != 0 ] && [ -n "$user" ] || fail "the image runs as root ($user)"
grep -q "^[^:]*:x:${user%%:*}:" <<<"$passwd" || fail "user ${user%%:*} has no /etc/passwd entry"
[ "$(podman image inspect "$image" --format '{{index .Config.Labels "org.opencontainers.image.version"}}')" = "$VERSION" ] ||
  fail "the image's version label is not $VERSION"
for label in revision created source; do
  [ -n "$(podman image inspect "$image" --format "{{index .Config.Labels \"org.opencontainers.image.$label\"}}")" ] ||
    fail "the image has no org.opencontainers.image.$label label"
done
echo "image $image: user $user ($(grep "^[^:]*:x:${user%%:*}:" <<<"$passwd" | cut -d: -f1)), CA certificates, version $VERSION"

run() { podman run --rm --runtime runc --network=host "$@"; }

# The binary is stamped with the image's version (internal/buildinfo).
out=$(run "$image" --version)
echo "$out"
grep -qx "$fn $VERSION" <<<"$(head -1 <<<"$out")" || fail "--version does not print $fn $VERSION"
grep -q "^built " <<<"$out" || fail "--version has no build time"

set +e
out=$(run "$image" 2>&1); code=$?
set -e
echo "$out"
[ $code -eq 2 ] || fail "want exit 2 without configuration, got $code"
for setting in KFN_KAFKA_BROKERS DATABASE_URL KFN_NATS_URL; do
  grep -q "$setting" <<<"$out" || fail "the error does not name $setting"
done

set +e
out=$(run -e KFN_KAFKA_BROKERS=127.0.0.1:1 -e DATABASE_URL='postgres://kfn@127.0.0.1:1/kfn?connect_timeout=2' \
  -e KFN_NATS_URL=nats://127.0.0.1:1 "$image" 2>&1); code=$?
set -e
echo "$out"
[ $code -eq 1 ] || fail "want exit 1 with unreachable services, got $code"
grep -q "cannot reach Postgres" <<<"$out" || fail "the error does not say Postgres is unreachable"

set +e
out=$(run "$image" --healthcheck 2>&1); code=$?
set -e
echo "$out"
[ $code -eq 1 ] && grep -q KFN_METRICS_ADDR <<<"$out" || fail "--healthcheck without a metrics address: want exit 1 naming KFN_METRICS_ADDR, got $code"
set +e
out=$(run -e KFN_METRICS_ADDR=127.0.0.1:1 "$image" --healthcheck 2>&1); code=$?
set -e
echo "$out"
[ $code -eq 1 ] && grep -q "not ready" <<<"$out" || fail "--healthcheck with nothing serving: want exit 1, not ready, got $code"

# .containerignore: what a build from the repository root sees.
ctx=kfn-context-check-$$
printf 'FROM scratch\nCOPY . /ctx\n' | podman build -q -f - -t "$ctx" . >/dev/null
ctr=$(podman create "$ctx" /none)
seen=$(podman export "$ctr" | tar -t)
podman rm "$ctr" >/dev/null
podman rmi "$ctx" >/dev/null
grep -qx 'ctx/go.mod' <<<"$seen" || fail "the build context has no go.mod"
for junk in .git bin deploy/local/kafka/.cache deploy/.build; do
  ! grep -qE "^ctx/$junk(/|$)" <<<"$seen" || fail "the build context holds $junk: .containerignore must keep it out"
done
echo "build context from the repository root: $(wc -l <<<"$seen") entries, without .git, bin/, deploy/.build or the Kafka cache"
echo "container smoke test passed"
