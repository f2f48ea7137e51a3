#!/usr/bin/env bash
# Builds a function image the way deploy/Containerfile.scratch describes and
# runs it with podman: without configuration it must exit 2 naming every
# missing setting, and with unreachable services it must exit 1 saying which.
# Usage: deploy/container-smoke.sh [function]   (default: orders)
set -euo pipefail
cd "$(dirname "$0")/.."
fn=${1:-orders}
export CONTAINERS_CONF=${CONTAINERS_CONF:-$PWD/deploy/containers.conf}
mkdir -p deploy/.build
# GOWORK=off: built from the main module alone, as deploy/Containerfile does.
CGO_ENABLED=0 GOWORK=off go build -trimpath -ldflags="-s -w" -o deploy/.build/function "./functions/$fn/cmd/$fn"
podman build -q -f deploy/Containerfile.scratch -t "kfn-$fn" deploy >/dev/null
echo "built image kfn-$fn ($(podman image inspect "kfn-$fn" --format '{{.Size}}') bytes)"

run() { podman run --rm --runtime runc --network=host "$@"; }

set +e
out=$(run "kfn-$fn" 2>&1); code=$?
set -e
echo "$out"
[ $code -eq 2 ] || { echo "want exit 2 without configuration, got $code"; exit 1; }
for setting in KFN_KAFKA_BROKERS DATABASE_URL KFN_NATS_URL; do
  grep -q "$setting" <<<"$out" || { echo "the error does not name $setting"; exit 1; }
done

set +e
out=$(run -e KFN_KAFKA_BROKERS=127.0.0.1:1 -e DATABASE_URL='postgres://kfn@127.0.0.1:1/kfn?connect_timeout=2' \
  -e KFN_NATS_URL=nats://127.0.0.1:1 "kfn-$fn" 2>&1); code=$?
set -e
echo "$out"
[ $code -eq 1 ] || { echo "want exit 1 with unreachable services, got $code"; exit 1; }
grep -q "cannot reach Postgres" <<<"$out" || { echo "the error does not say Postgres is unreachable"; exit 1; }
echo "container smoke test passed"
