#!/usr/bin/env bash
# The author's path to an image, end to end: `kfn new` makes a function
# module, deploy/image.sh builds its image, and the container runs against a
# `kfn dev` stack: 20 records produced with `kfn produce` must land in its
# table. CI runs this after the container smoke test.
set -euo pipefail
cd "$(dirname "$0")/.."
export CONTAINERS_CONF=${CONTAINERS_CONF:-$PWD/deploy/containers.conf}
work=$(mktemp -d)
container=kfn-e2e-payments-$$
dev_pid=
cleanup() {
  podman rm -f "$container" >/dev/null 2>&1 || true
  [ -n "$dev_pid" ] && kill "$dev_pid" 2>/dev/null && wait "$dev_pid" 2>/dev/null || true
  rm -rf "$work"
}
trap cleanup EXIT

GOWORK=off go build -o "$work/kfn" ./cmd/kfn
"$work/kfn" new payments --topic payments --dir "$work/payments" --kfn "$PWD"
VERSION=e2e deploy/image.sh "$work/payments/cmd/payments" kfn-e2e-payments

"$work/kfn" dev --duration 5m --rate 1 >"$work/dev.out" 2>&1 &
dev_pid=$!
for _ in $(seq 1 120); do grep -q '^export KFN_KAFKA_BROKERS=' "$work/dev.out" && break; sleep 1; done
grep -q '^export KFN_KAFKA_BROKERS=' "$work/dev.out" || { cat "$work/dev.out"; echo "kfn dev printed no stack"; exit 1; }
eval "$(grep '^export ' "$work/dev.out")"

"$work/kfn" topic create payments --partitions 2
podman run -d --name "$container" --runtime runc --network=host \
  -e DATABASE_URL -e KFN_NATS_URL -e KFN_KAFKA_BROKERS -e KFN_METRICS_ADDR=127.0.0.1:0 kfn-e2e-payments:e2e >/dev/null
for i in $(seq 1 20); do echo "{\"key\": \"p-$i\", \"value\": {\"id\": \"p-$i\", \"amount_cents\": $((100 + i))}}"; done >"$work/records.jsonl"
"$work/kfn" produce payments --file "$work/records.jsonl"

rows=0
for _ in $(seq 1 120); do
  rows=$(psql "$DATABASE_URL" -Atc 'SELECT count(*) FROM payments_records' 2>/dev/null || echo 0)
  [ "$rows" = 20 ] && break
  sleep 0.5
done
if [ "$rows" != 20 ]; then
  podman logs "$container" | tail -20
  echo "the function's container stored $rows rows, want 20"
  exit 1
fi
# The image's health check (no shell in it: the binary asks its own /readyz).
addr=$(podman logs "$container" 2>&1 | sed -n 's/.*"msg":"serving metrics","addr":"\([^"]*\)".*/\1/p' | head -1)
[ -n "$addr" ] || { podman logs "$container" | tail -20; echo "the container logged no metrics address"; exit 1; }
podman exec -e KFN_METRICS_ADDR="$addr" "$container" /function --healthcheck ||
  { echo "the container's health check (/function --healthcheck on $addr) failed while it applies records"; exit 1; }
echo "image end to end: the kfn new function's container applied 20 records and its health check passed"
