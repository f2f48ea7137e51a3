#!/usr/bin/env bash
# Local single-node Apache Kafka (KRaft, combined broker+controller) without Docker.
#
#   kafka.sh up      resolve jars (Maven, cached), format storage once, start, wait until it answers
#   kafka.sh down    stop (SIGTERM, bounded wait, then SIGKILL); exit 0 if not running
#   kafka.sh status  running or not, and the bootstrap address (exit 0 running, 3 not running)
#   kafka.sh reset   down, then delete the data dir
#   kafka.sh logs    print the last lines of the broker log (LINES=n, default 100)
#
# See README.md for the environment variables.
#
# KFN_KAFKA_SECURE=1 makes the client listener SASL_SSL (TLS with SCRAM-SHA-512
# logins) instead of PLAINTEXT: 'up' writes a CA and a broker certificate for
# 127.0.0.1/localhost into $KFN_KAFKA_DATA/tls (ca.pem is the CA clients
# trust) and creates the SCRAM users kfn (password in tls/kfn.password) and
# admin (the broker's own). Give it a data dir of its own: the mode is fixed
# when the storage is formatted.
set -euo pipefail

HERE="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd -P)"

abspath() { case "$1" in /*) printf '%s\n' "$1" ;; *) printf '%s/%s\n' "$PWD" "$1" ;; esac; }

CACHE="$(abspath "${KFN_KAFKA_CACHE:-$HERE/.cache}")"
DATA="$(abspath "${KFN_KAFKA_DATA:-$HERE/.data}")"
HOST=127.0.0.1
PORT="${KFN_KAFKA_PORT:-19092}"
CPORT="${KFN_KAFKA_CONTROLLER_PORT:-19093}"
HEAP="${KFN_KAFKA_HEAP:--Xms256m -Xmx768m}"
JVM_OPTS="${KFN_KAFKA_JVM_OPTS:-}"
START_TIMEOUT="${KFN_KAFKA_START_TIMEOUT:-120}"
STOP_TIMEOUT="${KFN_KAFKA_STOP_TIMEOUT:-60}"
JAVA="${JAVA_HOME:+$JAVA_HOME/bin/}java"

JARS="$CACHE/jars"
STAMP="$CACHE/jars.sha256"
LOGDIRS="$DATA/kraft-combined-logs"
PROPS="$DATA/server.properties"
PIDFILE="$DATA/broker.pid"
LOG="$DATA/broker.log"
BOOTSTRAP="$HOST:$PORT"
SECURE="${KFN_KAFKA_SECURE:-}"
TLSDIR="$DATA/tls"
CLIENT_PROPS="$DATA/client.properties"

say() { printf 'kafka.sh: %s\n' "$*"; }
die() { printf 'kafka.sh: error: %s\n' "$*" >&2; exit 1; }

# ---------------------------------------------------------------- helpers

lock() {
	# Serialise up/down/reset (e.g. several test packages calling `up` at once).
	mkdir -p "$DATA"
	exec 9>"$DATA/.lock"
	flock -w 300 9 || die "could not lock $DATA/.lock within 300 s"
}

check_java() {
	command -v "$JAVA" >/dev/null 2>&1 || die "java not found (need Java 17+: apt-get install -y openjdk-17-jre-headless)"
	local v major
	v="$("$JAVA" -version 2>&1 | head -n1)"
	major="$(printf '%s' "$v" | sed -n 's/.*version "\([0-9]*\).*/\1/p')"
	[[ -n "$major" && "$major" -ge 17 ]] || die "Kafka 4.x needs Java 17+, found: $v"
}

resolve_jars() {
	local want
	want="$(sha256sum "$HERE/pom.xml" | cut -d' ' -f1)"
	if [[ -f "$STAMP" && "$(cat "$STAMP")" == "$want" ]] && compgen -G "$JARS/kafka_2.13-*.jar" >/dev/null; then
		return 0
	fi
	command -v mvn >/dev/null 2>&1 || die "mvn not found (apt-get install -y maven)"
	mkdir -p "$CACHE"
	local tmp="$CACHE/jars.tmp.$$" t0=$SECONDS
	rm -rf "$tmp"
	say "resolving Kafka jars with Maven into $JARS ..."
	if ! mvn -B -q -Dstyle.color=never -f "$HERE/pom.xml" \
		dependency:copy-dependencies -DoutputDirectory="$tmp" >"$CACHE/mvn.log" 2>&1; then
		tail -n 50 "$CACHE/mvn.log" >&2
		rm -rf "$tmp"
		die "Maven could not resolve the Kafka jars (full output: $CACHE/mvn.log)"
	fi
	compgen -G "$tmp/kafka_2.13-*.jar" >/dev/null || die "Maven ran but kafka_2.13 jar is missing in $tmp"
	rm -rf "$JARS"
	mv "$tmp" "$JARS"
	printf '%s\n' "$want" >"$STAMP"
	say "resolved $(ls "$JARS" | wc -l) jars in $((SECONDS - t0)) s"
}

# Run a Kafka CLI class from the cached jars with a small, quiet JVM (bounded).
tool() {
	timeout 60 "$JAVA" -Xmx256m -XX:+UseSerialGC -XX:TieredStopAtLevel=1 -Djava.awt.headless=true \
		-Dlog4j2.configurationFile="$HERE/log4j2-tools.properties" \
		-cp "$JARS/*" "$@"
}

pid_of_broker() {
	# Prints the pid if the pid file points at a live kafka.Kafka process of ours.
	[[ -f "$PIDFILE" ]] || return 1
	local pid
	pid="$(cat "$PIDFILE" 2>/dev/null || true)"
	[[ "$pid" =~ ^[0-9]+$ ]] || return 1
	kill -0 "$pid" 2>/dev/null || return 1
	tr '\0' ' ' <"/proc/$pid/cmdline" 2>/dev/null | grep -q "kafka.Kafka $PROPS" || return 1
	printf '%s\n' "$pid"
}

port_open() { (exec 3<>"/dev/tcp/$HOST/$1") 2>/dev/null; }

new_cluster_id() {
	# Kafka cluster ids are 16 random bytes, base64url without padding (what
	# `kafka-storage random-uuid` prints); avoid a leading '-' like Kafka does.
	local id
	while :; do
		id="$(head -c 16 /dev/urandom | base64 | tr '+/' '-_' | tr -d '=\n')"
		[[ "$id" != -* ]] && { printf '%s\n' "$id"; return; }
	done
}

# make_tls writes (once) a CA and a broker certificate signed by it, as PEM,
# the client properties of the Kafka tools, and the SCRAM users' passwords.
make_tls() {
	[[ -f "$TLSDIR/broker.pem" && -f "$CLIENT_PROPS" ]] && return 0
	command -v openssl >/dev/null 2>&1 || die "openssl not found (apt-get install -y openssl)"
	mkdir -p "$TLSDIR"
	(
		cd "$TLSDIR"
		openssl req -x509 -newkey rsa:2048 -nodes -days 3650 -subj "/CN=kfn local Kafka CA" \
			-keyout ca.key -out ca.pem 2>/dev/null
		openssl genpkey -algorithm RSA -pkeyopt rsa_keygen_bits:2048 -out broker.key 2>/dev/null
		openssl req -new -key broker.key -subj "/CN=localhost" -out broker.csr 2>/dev/null
		printf 'subjectAltName=IP:127.0.0.1,DNS:localhost\nextendedKeyUsage=serverAuth,clientAuth\n' >broker.ext
		openssl x509 -req -in broker.csr -CA ca.pem -CAkey ca.key -CAcreateserial -days 3650 \
			-extfile broker.ext -out broker.crt 2>/dev/null
		# A PEM keystore: the PKCS#8 key, then the chain.
		cat broker.key broker.crt ca.pem >broker.pem
		head -c 18 /dev/urandom | base64 | tr -d '/+=\n' >kfn.password
		head -c 18 /dev/urandom | base64 | tr -d '/+=\n' >admin.password
		chmod 600 ./*.key broker.pem ./*.password
	)
	cat >"$CLIENT_PROPS" <<EOF
security.protocol=SASL_SSL
sasl.mechanism=SCRAM-SHA-512
sasl.jaas.config=org.apache.kafka.common.security.scram.ScramLoginModule required username="admin" password="$(cat "$TLSDIR/admin.password")";
ssl.truststore.type=PEM
ssl.truststore.location=$TLSDIR/ca.pem
EOF
}

write_props() {
	mkdir -p "$DATA"
	local proto=PLAINTEXT
	[[ -z "$SECURE" ]] || proto=SASL_SSL
	cat >"$PROPS" <<EOF
# Written by deploy/local/kafka/kafka.sh on every 'up'; edits are overwritten.
# One combined KRaft broker+controller on $HOST.
process.roles=broker,controller
node.id=1
controller.quorum.voters=1@$HOST:$CPORT
controller.listener.names=CONTROLLER
listeners=$proto://$HOST:$PORT,CONTROLLER://$HOST:$CPORT
advertised.listeners=$proto://$HOST:$PORT
inter.broker.listener.name=$proto
listener.security.protocol.map=$proto:$proto,CONTROLLER:PLAINTEXT
log.dirs=$LOGDIRS

# Single node: internal topics must not ask for more replicas than exist.
offsets.topic.replication.factor=1
transaction.state.log.replication.factor=1
transaction.state.log.min.isr=1
share.coordinator.state.topic.replication.factor=1
share.coordinator.state.topic.min.isr=1
group.initial.rebalance.delay.ms=0
auto.create.topics.enable=true
num.partitions=1
EOF
	if [[ -n "$SECURE" ]]; then
		cat >>"$PROPS" <<EOF

# KFN_KAFKA_SECURE: TLS with SCRAM-SHA-512 logins (users made at format time).
sasl.enabled.mechanisms=SCRAM-SHA-512
sasl.mechanism.inter.broker.protocol=SCRAM-SHA-512
listener.name.sasl_ssl.scram-sha-512.sasl.jaas.config=org.apache.kafka.common.security.scram.ScramLoginModule required username="admin" password="$(cat "$TLSDIR/admin.password")";
ssl.keystore.type=PEM
ssl.keystore.location=$TLSDIR/broker.pem
ssl.truststore.type=PEM
ssl.truststore.location=$TLSDIR/ca.pem
ssl.client.auth=none
EOF
	fi
}

format_storage() {
	if [[ -f "$LOGDIRS/meta.properties" ]]; then
		return 0
	fi
	local id out
	id="$(new_cluster_id)"
	say "formatting KRaft storage in $LOGDIRS (cluster id $id)"
	local -a scram=()
	if [[ -n "$SECURE" ]]; then
		scram=(--add-scram "SCRAM-SHA-512=[name=admin,password=$(cat "$TLSDIR/admin.password")]"
			--add-scram "SCRAM-SHA-512=[name=kfn,password=$(cat "$TLSDIR/kfn.password")]")
	fi
	if ! out="$(tool kafka.tools.StorageTool format --config "$PROPS" --cluster-id "$id" ${scram[@]+"${scram[@]}"} 2>&1)"; then
		printf '%s\n' "$out" >&2
		die "storage format failed"
	fi
}

broker_version() {
	# The broker logs its own version and commit at startup (AppInfoParser).
	local v c
	v="$(grep -m1 -o 'Kafka version: [^ ]*' "$LOG" 2>/dev/null | sed 's/Kafka version: //' || true)"
	c="$(grep -m1 -o 'Kafka commitId: [^ ]*' "$LOG" 2>/dev/null | sed 's/Kafka commitId: //' || true)"
	printf 'Apache Kafka %s (commit %s)\n' "${v:-unknown}" "${c:-unknown}"
}

fail_start() {
	say "$1" >&2
	if [[ -f "$LOG" ]]; then
		printf -- '---- last 50 lines of %s ----\n' "$LOG" >&2
		tail -n 50 "$LOG" >&2
		printf -- '----\n' >&2
	fi
	exit 1
}

# --------------------------------------------------------------- commands

cmd_up() {
	check_java
	lock
	local pid
	if pid="$(pid_of_broker)"; then
		say "already running (pid $pid) at $BOOTSTRAP"
		return 0
	fi
	rm -f "$PIDFILE"
	if port_open "$PORT"; then
		die "port $PORT on $HOST is already in use by another process (set KFN_KAFKA_PORT?)"
	fi
	if port_open "$CPORT"; then
		die "controller port $CPORT on $HOST is already in use (set KFN_KAFKA_CONTROLLER_PORT?)"
	fi

	local t0=$SECONDS
	resolve_jars
	[[ -z "$SECURE" ]] || make_tls
	write_props
	format_storage

	[[ -f "$LOG" ]] && mv -f "$LOG" "$LOG.prev"
	local -a heap jvm
	read -r -a heap <<<"$HEAP"
	read -r -a jvm <<<"$JVM_OPTS"
	# setsid: own session, so the broker outlives the caller's process group.
	# 9>&-: the broker must not inherit (and hold) our lock.
	setsid "$JAVA" "${heap[@]}" -server -XX:+UseG1GC -XX:MaxGCPauseMillis=20 \
		-XX:InitiatingHeapOccupancyPercent=35 -XX:+ExplicitGCInvokesConcurrent \
		-Djava.awt.headless=true \
		-Dlog4j2.configurationFile="$HERE/log4j2.properties" \
		-Dkafka.logs.dir="$DATA" \
		${jvm[@]+"${jvm[@]}"} \
		-cp "$JARS/*" kafka.Kafka "$PROPS" \
		</dev/null >"$LOG" 2>&1 9>&- &
	pid=$!
	printf '%s\n' "$pid" >"$PIDFILE"
	say "starting broker (pid $pid, log $LOG)"

	# Wait until the broker really answers Kafka requests (ApiVersions via the
	# bootstrap address), bounded by KFN_KAFKA_START_TIMEOUT.
	local deadline=$((SECONDS + START_TIMEOUT)) out=""
	while :; do
		if ! kill -0 "$pid" 2>/dev/null; then
			rm -f "$PIDFILE"
			fail_start "broker process exited during startup"
		fi
		if port_open "$PORT" &&
			out="$(tool org.apache.kafka.tools.BrokerApiVersionsCommand --bootstrap-server "$BOOTSTRAP" ${SECURE:+--command-config "$CLIENT_PROPS"} 2>&1)" &&
			grep -q 'ApiVersions(' <<<"$out"; then
			break
		fi
		if ((SECONDS >= deadline)); then
			fail_start "broker did not answer on $BOOTSTRAP within ${START_TIMEOUT} s (still running as pid $pid; run '$0 down')"
		fi
		sleep 1
	done
	say "ready in $((SECONDS - t0)) s: $(broker_version)"
	say "bootstrap: $BOOTSTRAP${SECURE:+ (SASL_SSL, SCRAM-SHA-512 user kfn, password in $TLSDIR/kfn.password, CA $TLSDIR/ca.pem)}"
}

cmd_down() {
	[[ -d "$DATA" ]] || { say "not running"; return 0; }
	lock
	local pid
	if ! pid="$(pid_of_broker)"; then
		rm -f "$PIDFILE"
		say "not running"
		return 0
	fi
	say "stopping broker (pid $pid)"
	kill -TERM "$pid" 2>/dev/null || true
	local deadline=$((SECONDS + STOP_TIMEOUT))
	while kill -0 "$pid" 2>/dev/null && ((SECONDS < deadline)); do
		sleep 0.5
	done
	if kill -0 "$pid" 2>/dev/null; then
		say "still running after ${STOP_TIMEOUT} s, sending SIGKILL"
		kill -KILL "$pid" 2>/dev/null || true
		deadline=$((SECONDS + 10))
		while kill -0 "$pid" 2>/dev/null && ((SECONDS < deadline)); do
			sleep 0.2
		done
	fi
	rm -f "$PIDFILE"
	say "stopped"
}

cmd_status() {
	local pid
	if pid="$(pid_of_broker)"; then
		if port_open "$PORT"; then
			say "running (pid $pid) at $BOOTSTRAP"
		else
			say "process running (pid $pid) but $BOOTSTRAP not accepting connections yet"
		fi
		return 0
	fi
	if port_open "$PORT"; then
		say "not running from $DATA, but something else listens on $BOOTSTRAP"
	else
		say "not running (address would be $BOOTSTRAP)"
	fi
	return 3
}

cmd_reset() {
	cmd_down
	case "$DATA" in
	/ | "$HOME" | "$HERE" | "") die "refusing to delete $DATA" ;;
	esac
	rm -rf "$DATA"
	say "deleted $DATA"
}

cmd_logs() { tail -n "${LINES:-100}" "$LOG"; }

case "${1:-}" in
up) cmd_up ;;
down) cmd_down ;;
status) cmd_status ;;
reset) cmd_reset ;;
logs) cmd_logs ;;
*)
	echo "usage: $0 {up|down|status|reset|logs}" >&2
	exit 2
	;;
esac
