#!/usr/bin/env bash
# Local Apache Kafka (KRaft, combined broker+controller nodes) without Docker:
# one node, or with KFN_KAFKA_NODES=N (N >= 3) a cluster of N nodes with a
# static controller quorum, replication factor 3 and min.insync.replicas 2.
#
#   kafka.sh up       resolve jars (Maven, cached), format storage once, start, wait until it answers
#   kafka.sh down     stop (SIGTERM, bounded wait, then SIGKILL); exit 0 if not running
#   kafka.sh status   running or not, and the bootstrap address (exit 0 running, 3 not running)
#   kafka.sh reset    down, then delete the data dir
#   kafka.sh logs [N] print the last lines of node N's log (LINES=n, default 100; N default 1)
#   kafka.sh kill N   SIGKILL node N (a crash: no controlled shutdown)
#   kafka.sh stop N   stop node N like down does
#   kafka.sh start N  start node N again (same ports and data) and wait until it answers
#   kafka.sh run N    run node N in the foreground, its log on stdout (for a supervisor)
#
# See README.md for the environment variables.
#
# KFN_KAFKA_SECURE=1 makes the client listener SASL_SSL (TLS with SCRAM-SHA-512
# logins) instead of PLAINTEXT: 'up' writes a CA and a broker certificate for
# 127.0.0.1/localhost into $KFN_KAFKA_DATA/tls (ca.pem is the CA clients
# trust) and creates the SCRAM users kfn (password in tls/kfn.password) and
# admin (the broker's own). Give it a data dir of its own: the mode is fixed
# when the storage is formatted.
#
# KFN_KAFKA_OAUTH_JWKS_URL=URL (with KFN_KAFKA_SECURE=1) also enables
# OAUTHBEARER on that listener: the broker validates the tokens' RS256
# signatures with the keys that URL serves (a JWKS; http, https or file),
# wants the issuer KFN_KAFKA_OAUTH_ISSUER (required) and the audience
# KFN_KAFKA_OAUTH_AUDIENCE (default kafka), and closes
# an OAUTHBEARER connection at its first request after its token expired
# (connections.max.reauth.ms), as a production broker that enforces token
# expiry does. Kafka 4 fetches only allowed URLs: kafka.sh allows this one
# (org.apache.kafka.sasl.oauthbearer.allowed.urls).
set -euo pipefail

HERE="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd -P)"

abspath() { case "$1" in /*) printf '%s\n' "$1" ;; *) printf '%s/%s\n' "$PWD" "$1" ;; esac; }

say() { printf 'kafka.sh: %s\n' "$*"; }
die() { printf 'kafka.sh: error: %s\n' "$*" >&2; exit 1; }

NODES="${KFN_KAFKA_NODES:-1}"
[[ "$NODES" =~ ^[0-9]+$ ]] && { ((NODES == 1)) || ((NODES >= 3)); } ||
	die "KFN_KAFKA_NODES=$NODES: want 1 (one node) or 3 or more (a cluster with replication factor 3)"
CLUSTER=""
((NODES == 1)) || CLUSTER=1

CACHE="$(abspath "${KFN_KAFKA_CACHE:-$HERE/.cache}")"
DATA="$(abspath "${KFN_KAFKA_DATA:-$HERE/.data${CLUSTER:+-cluster}}")"
HOST=127.0.0.1
# A cluster's default ports (19192-19197) leave the single node's free.
BASE_PORT="${KFN_KAFKA_PORT:-$((CLUSTER ? 19192 : 19092))}"
BASE_CPORT="${KFN_KAFKA_CONTROLLER_PORT:-$((CLUSTER ? 19193 : 19093))}"
if [[ -n "$CLUSTER" ]]; then
	# Several JVMs on one small machine: a smaller heap, and only the quick
	# JIT compiler (C1), which halves a node's CPU time to start.
	HEAP="${KFN_KAFKA_HEAP:--Xms128m -Xmx384m}"
	JVM_OPTS="${KFN_KAFKA_JVM_OPTS--XX:TieredStopAtLevel=1}"
else
	HEAP="${KFN_KAFKA_HEAP:--Xms256m -Xmx768m}"
	JVM_OPTS="${KFN_KAFKA_JVM_OPTS:-}"
fi
START_TIMEOUT="${KFN_KAFKA_START_TIMEOUT:-120}"
STOP_TIMEOUT="${KFN_KAFKA_STOP_TIMEOUT:-60}"
JAVA="${JAVA_HOME:+$JAVA_HOME/bin/}java"

JARS="$CACHE/jars"
STAMP="$CACHE/jars.sha256"
SECURE="${KFN_KAFKA_SECURE:-}"
OAUTH_JWKS="${KFN_KAFKA_OAUTH_JWKS_URL:-}"
OAUTH_AUDIENCE="${KFN_KAFKA_OAUTH_AUDIENCE:-kafka}"
OAUTH_ISSUER="${KFN_KAFKA_OAUTH_ISSUER:-}"
[[ -n "$OAUTH_ISSUER" || -z "$OAUTH_JWKS" ]] || die "KFN_KAFKA_OAUTH_JWKS_URL needs KFN_KAFKA_OAUTH_ISSUER: the issuer (iss) of the tokens the broker takes"
TLSDIR="$DATA/tls"
CLIENT_PROPS="$DATA/client.properties"
CLUSTER_ID_FILE="$DATA/cluster.id"
[[ -z "$SECURE" || -z "$CLUSTER" ]] || die "KFN_KAFKA_SECURE=1 is for one node only; unset KFN_KAFKA_NODES or KFN_KAFKA_SECURE"
[[ -z "$OAUTH_JWKS" || -n "$SECURE" ]] || die "KFN_KAFKA_OAUTH_JWKS_URL needs KFN_KAFKA_SECURE=1 (OAUTHBEARER is enabled on the SASL_SSL listener)"

# Node i's client and controller ports: KFN_KAFKA_PORTS and
# KFN_KAFKA_CONTROLLER_PORTS (comma-separated, one per node), else node i
# takes KFN_KAFKA_PORT + 2(i-1) and KFN_KAFKA_CONTROLLER_PORT + 2(i-1).
IFS=, read -r -a PORTS <<<"${KFN_KAFKA_PORTS:-}"
IFS=, read -r -a CPORTS <<<"${KFN_KAFKA_CONTROLLER_PORTS:-}"
if ((${#PORTS[@]} == 0)); then
	for ((i = 0; i < NODES; i++)); do PORTS+=($((BASE_PORT + 2 * i))); done
fi
if ((${#CPORTS[@]} == 0)); then
	for ((i = 0; i < NODES; i++)); do CPORTS+=($((BASE_CPORT + 2 * i))); done
fi
((${#PORTS[@]} == NODES)) || die "KFN_KAFKA_PORTS=${KFN_KAFKA_PORTS:-} names ${#PORTS[@]} ports for KFN_KAFKA_NODES=$NODES nodes"
((${#CPORTS[@]} == NODES)) || die "KFN_KAFKA_CONTROLLER_PORTS=${KFN_KAFKA_CONTROLLER_PORTS:-} names ${#CPORTS[@]} ports for KFN_KAFKA_NODES=$NODES nodes"
for p in "${PORTS[@]}" "${CPORTS[@]}"; do
	[[ "$p" =~ ^[0-9]+$ ]] && ((p > 0 && p < 65536)) || die "port '$p' is not a TCP port (KFN_KAFKA_PORT, KFN_KAFKA_CONTROLLER_PORT, KFN_KAFKA_PORTS, KFN_KAFKA_CONTROLLER_PORTS)"
done
[[ "$(printf '%s\n' "${PORTS[@]}" "${CPORTS[@]}" | sort -u | wc -l)" -eq $((2 * NODES)) ]] ||
	die "the client and controller ports ${PORTS[*]} / ${CPORTS[*]} are not all different"

# Every node's client address, comma-separated.
BOOTSTRAP_ALL="$(printf "$HOST:%s," "${PORTS[@]}")"
BOOTSTRAP_ALL="${BOOTSTRAP_ALL%,}"

# select_node N points the per-node names (ports, config, logs, pid file)
# at node N. One node keeps its files at the top of the data dir, as
# before; a cluster's node N keeps them in node-N/.
select_node() {
	local n="$1" dir="$DATA"
	[[ "$n" =~ ^[0-9]+$ ]] && ((n >= 1 && n <= NODES)) || die "no node '$n': the nodes are 1..$NODES (KFN_KAFKA_NODES)"
	[[ -z "$CLUSTER" ]] || dir="$DATA/node-$n"
	NODE="$n"
	NODE_DIR="$dir"
	PORT="${PORTS[n - 1]}"
	CPORT="${CPORTS[n - 1]}"
	LOGDIRS="$dir/kraft-combined-logs"
	PROPS="$dir/server.properties"
	PIDFILE="$dir/broker.pid"
	LOG="$dir/broker.log"
	BOOTSTRAP="$HOST:$PORT"
}
select_node 1

# ---------------------------------------------------------------- helpers

lock() {
	# Serialise up/down/reset (e.g. several test packages calling `up` at once).
	# $1: the directory to lock, the data dir unless given.
	local dir="${1:-$DATA}"
	mkdir -p "$dir"
	exec 9>"$dir/.lock"
	flock -w 300 9 || die "could not lock $dir/.lock within 300 s"
}

check_java() {
	command -v "$JAVA" >/dev/null 2>&1 || die "java not found (need Java 17+: apt-get install -y openjdk-17-jre-headless)"
	local v major
	v="$("$JAVA" -version 2>&1 | head -n1)"
	major="$(printf '%s' "$v" | sed -n 's/.*version "\([0-9]*\).*/\1/p')"
	[[ -n "$major" && "$major" -ge 17 ]] || die "Kafka 4.x needs Java 17+, found: $v"
}

# jars_current reports whether the cache holds the jars of pom.xml (hash $1).
jars_current() { [[ -f "$STAMP" && "$(cat "$STAMP")" == "$1" ]] && compgen -G "$JARS/kafka_2.13-*.jar" >/dev/null; }

resolve_jars() {
	local want
	want="$(sha256sum "$HERE/pom.xml" | cut -d' ' -f1)"
	jars_current "$want" && return 0
	command -v mvn >/dev/null 2>&1 || die "mvn not found (apt-get install -y maven)"
	# Several data dirs (tests, a cluster's nodes) may share the cache: one
	# resolves, the others wait and find it done.
	mkdir -p "$CACHE"
	exec 8>"$CACHE/.lock"
	flock -w 300 8 || die "could not lock $CACHE/.lock within 300 s"
	if jars_current "$want"; then
		exec 8>&-
		return 0
	fi
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
	exec 8>&-
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
	mkdir -p "$NODE_DIR"
	local proto=PLAINTEXT
	[[ -z "$SECURE" ]] || proto=SASL_SSL
	local voters="" i
	for ((i = 1; i <= NODES; i++)); do voters+="${voters:+,}$i@$HOST:${CPORTS[i - 1]}"; done
	cat >"$PROPS" <<EOF
# Written by deploy/local/kafka/kafka.sh on every 'up'; edits are overwritten.
# Node $NODE of $NODES: a combined KRaft broker+controller on $HOST.
process.roles=broker,controller
node.id=$NODE
controller.quorum.voters=$voters
controller.listener.names=CONTROLLER
listeners=$proto://$HOST:$PORT,CONTROLLER://$HOST:$CPORT
advertised.listeners=$proto://$HOST:$PORT
inter.broker.listener.name=$proto
listener.security.protocol.map=$proto:$proto,CONTROLLER:PLAINTEXT
log.dirs=$LOGDIRS
group.initial.rebalance.delay.ms=0
auto.create.topics.enable=true
num.partitions=1
EOF
	if [[ -z "$CLUSTER" ]]; then
		cat >>"$PROPS" <<EOF

# Single node: internal topics must not ask for more replicas than exist.
offsets.topic.replication.factor=1
transaction.state.log.replication.factor=1
transaction.state.log.min.isr=1
share.coordinator.state.topic.replication.factor=1
share.coordinator.state.topic.min.isr=1
EOF
	else
		cat >>"$PROPS" <<EOF

# Cluster: every topic (internal ones too) has 3 replicas, and a write
# acknowledged by all in-sync replicas is on at least 2 of them, so one node
# can die without losing a record or refusing a write.
default.replication.factor=3
min.insync.replicas=2
offsets.topic.replication.factor=3
offsets.topic.num.partitions=10
transaction.state.log.replication.factor=3
transaction.state.log.min.isr=2
transaction.state.log.num.partitions=10
share.coordinator.state.topic.replication.factor=3
share.coordinator.state.topic.min.isr=2
unclean.leader.election.enable=false
# A node that stops heartbeating is fenced (its partitions get new leaders)
# after 4 s instead of 9 s: a killed leader's partitions move sooner.
broker.session.timeout.ms=4000
broker.heartbeat.interval.ms=1000
# Small machines run several of these: fewer threads, a small cleaner buffer.
num.network.threads=2
num.io.threads=2
background.threads=2
log.cleaner.dedupe.buffer.size=16777216
EOF
	fi
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
	if [[ -n "$OAUTH_JWKS" ]]; then
		cat >>"$PROPS" <<EOF

# KFN_KAFKA_OAUTH_JWKS_URL: OAUTHBEARER too, with tokens (JWTs) validated
# against the keys of that URL. The OAUTHBEARER sessions end with their
# token: a connection that has not logged in again by then is closed at
# its next request (connections.max.reauth.ms caps a session at an hour).
sasl.enabled.mechanisms=SCRAM-SHA-512,OAUTHBEARER
listener.name.sasl_ssl.oauthbearer.sasl.jaas.config=org.apache.kafka.common.security.oauthbearer.OAuthBearerLoginModule required ;
listener.name.sasl_ssl.oauthbearer.sasl.server.callback.handler.class=org.apache.kafka.common.security.oauthbearer.OAuthBearerValidatorCallbackHandler
listener.name.sasl_ssl.oauthbearer.connections.max.reauth.ms=3600000
sasl.oauthbearer.jwks.endpoint.url=$OAUTH_JWKS
sasl.oauthbearer.expected.audience=$OAUTH_AUDIENCE
sasl.oauthbearer.expected.issuer=$OAUTH_ISSUER
sasl.oauthbearer.clock.skew.seconds=1
EOF
	fi
}

# cluster_id prints the cluster's id, made once per data dir: every node of
# a cluster is formatted with the same one. Nodes started at once (run N)
# race to make it; the hard link is atomic, so the first one wins.
cluster_id() {
	if [[ ! -s "$CLUSTER_ID_FILE" ]]; then
		mkdir -p "$DATA"
		local tmp="$CLUSTER_ID_FILE.$$"
		new_cluster_id >"$tmp"
		ln "$tmp" "$CLUSTER_ID_FILE" 2>/dev/null || true
		rm -f "$tmp"
	fi
	cat "$CLUSTER_ID_FILE"
}

format_storage() {
	if [[ -f "$LOGDIRS/meta.properties" ]]; then
		return 0
	fi
	local id out
	id="$(cluster_id)"
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

# label names the selected node in messages: "broker" alone, "node N" in a cluster.
label() { if [[ -n "$CLUSTER" ]]; then printf 'node %s' "$NODE"; else printf 'broker'; fi; }

# check_ports_free fails if the selected node's ports are taken.
check_ports_free() {
	if port_open "$PORT"; then
		die "port $PORT on $HOST is already in use by another process (set KFN_KAFKA_PORT${CLUSTER:+ or KFN_KAFKA_PORTS}?)"
	fi
	if port_open "$CPORT"; then
		die "controller port $CPORT on $HOST is already in use (set KFN_KAFKA_CONTROLLER_PORT${CLUSTER:+ or KFN_KAFKA_CONTROLLER_PORTS}?)"
	fi
}

# prepare_node writes the selected node's config and formats its storage
# (once); the jars must be resolved.
prepare_node() {
	write_props
	format_storage
}

# jvm_args fills the array named by $1 with the broker's java command line.
jvm_args() {
	local -n args="$1"
	local -a heap jvm
	read -r -a heap <<<"$HEAP"
	read -r -a jvm <<<"$JVM_OPTS"
	args=("$JAVA" "${heap[@]}" -server -XX:+UseG1GC -XX:MaxGCPauseMillis=20
		-XX:InitiatingHeapOccupancyPercent=35 -XX:+ExplicitGCInvokesConcurrent
		-Djava.awt.headless=true
		-Dlog4j2.configurationFile="$HERE/log4j2.properties"
		-Dkafka.logs.dir="$NODE_DIR"
		${jvm[@]+"${jvm[@]}"}
		${OAUTH_JWKS:+"-Dorg.apache.kafka.sasl.oauthbearer.allowed.urls=$OAUTH_JWKS"}
		-cp "$JARS/*" kafka.Kafka "$PROPS")
}

# launch_node starts the selected node in the background, its log in $LOG.
launch_node() {
	[[ -f "$LOG" ]] && mv -f "$LOG" "$LOG.prev"
	local -a cmd
	jvm_args cmd
	# setsid: own session, so the broker outlives the caller's process group.
	# 9>&-: the broker must not inherit (and hold) our lock.
	setsid "${cmd[@]}" </dev/null >"$LOG" 2>&1 9>&- &
	local pid=$!
	printf '%s\n' "$pid" >"$PIDFILE"
	say "starting $(label) (pid $pid, log $LOG)"
}

# wait_started waits until the selected node (pid $1) has logged that it
# started, which a broker does once the controller has unfenced it, and
# takes connections; it gives up at SECONDS $2.
wait_started() {
	local pid="$1" deadline="$2"
	while :; do
		if ! kill -0 "$pid" 2>/dev/null; then
			rm -f "$PIDFILE"
			fail_start "$(label) exited during startup"
		fi
		if port_open "$PORT" && grep -q 'Kafka Server started' "$LOG" 2>/dev/null; then
			return 0
		fi
		if ((SECONDS >= deadline)); then
			fail_start "$(label) did not start on $BOOTSTRAP within ${START_TIMEOUT} s (still running as pid $pid; run '$0 down')"
		fi
		sleep 0.5
	done
}

# wait_answers waits until every node answers Kafka requests (ApiVersions;
# the tool asks each broker the metadata lists, and a fenced broker is not
# listed), giving up at SECONDS $1.
wait_answers() {
	local deadline="$1" out="" n=0
	while :; do
		if out="$(tool org.apache.kafka.tools.BrokerApiVersionsCommand --bootstrap-server "$BOOTSTRAP_ALL" ${SECURE:+--command-config "$CLIENT_PROPS"} 2>&1)"; then
			n="$(grep -c 'ApiVersions(' <<<"$out" || true)"
			((n >= NODES)) && return 0
		fi
		if ((SECONDS >= deadline)); then
			fail_start "$n of $NODES nodes answered on $BOOTSTRAP_ALL within ${START_TIMEOUT} s (run '$0 down')"
		fi
		sleep 1
	done
}

cmd_up() {
	check_java
	lock
	local t0=$SECONDS n pid
	local -a todo=() pids=()
	for ((n = 1; n <= NODES; n++)); do
		select_node "$n"
		if pid="$(pid_of_broker)"; then
			say "$(label) already running (pid $pid) at $BOOTSTRAP"
			continue
		fi
		rm -f "$PIDFILE"
		check_ports_free
		todo+=("$n")
	done
	((${#todo[@]} > 0)) || return 0

	resolve_jars
	[[ -z "$SECURE" ]] || make_tls
	# Format the nodes' storage in parallel: on a busy machine, three JVMs
	# one after the other take three times as long.
	cluster_id >/dev/null
	local -a formats=()
	for n in "${todo[@]}"; do
		select_node "$n"
		prepare_node &
		formats+=("$!")
	done
	for pid in "${formats[@]}"; do
		wait "$pid" || exit 1
	done
	# A cluster's controllers need a quorum: launch every node, then wait.
	for n in "${todo[@]}"; do
		select_node "$n"
		launch_node
		pids+=("$!")
	done
	local deadline=$((SECONDS + START_TIMEOUT)) i
	for i in "${!todo[@]}"; do
		select_node "${todo[i]}"
		wait_started "${pids[i]}" "$deadline"
	done
	wait_answers "$deadline"
	say "ready in $((SECONDS - t0)) s: $(broker_version)"
	say "bootstrap: $BOOTSTRAP_ALL${SECURE:+ (SASL_SSL, SCRAM-SHA-512 user kfn, password in $TLSDIR/kfn.password, CA $TLSDIR/ca.pem)}"
}

# stop_nodes signals the given nodes' processes with $1 at once, waits
# (bounded by KFN_KAFKA_STOP_TIMEOUT), then SIGKILLs what is left.
stop_nodes() {
	local sig="$1" n pid
	shift
	local -a pids=()
	for n in "$@"; do
		select_node "$n"
		if pid="$(pid_of_broker)"; then
			say "stopping $(label) (pid $pid${sig:+, SIG$sig})"
			kill -"$sig" "$pid" 2>/dev/null || true
			pids+=("$pid")
		else
			say "$(label) not running"
		fi
		rm -f "$PIDFILE"
	done
	((${#pids[@]} > 0)) || return 0
	local deadline=$((SECONDS + STOP_TIMEOUT))
	while ((SECONDS < deadline)) && alive "${pids[@]}"; do
		sleep 0.2
	done
	if alive "${pids[@]}"; then
		say "still running after ${STOP_TIMEOUT} s, sending SIGKILL"
		kill -KILL "${pids[@]}" 2>/dev/null || true
		deadline=$((SECONDS + 10))
		while ((SECONDS < deadline)) && alive "${pids[@]}"; do
			sleep 0.2
		done
	fi
	say "stopped"
}

# alive reports whether any of the given pids is still running.
alive() {
	local pid
	for pid in "$@"; do
		kill -0 "$pid" 2>/dev/null && return 0
	done
	return 1
}

all_nodes() { seq 1 "$NODES"; }

cmd_down() {
	[[ -d "$DATA" ]] || { say "not running"; return 0; }
	lock
	# All at once: a cluster's last node cannot finish a controlled shutdown
	# once the other controllers are gone.
	# shellcheck disable=SC2046
	stop_nodes TERM $(all_nodes)
}

cmd_kill() {
	lock
	select_node "$1"
	local pid
	if ! pid="$(pid_of_broker)"; then
		rm -f "$PIDFILE"
		die "$(label) is not running"
	fi
	stop_nodes KILL "$1"
}

cmd_stop() {
	lock
	stop_nodes TERM "$1"
}

cmd_start() {
	check_java
	lock
	select_node "$1"
	local pid t0=$SECONDS
	if pid="$(pid_of_broker)"; then
		say "$(label) already running (pid $pid) at $BOOTSTRAP"
		return 0
	fi
	rm -f "$PIDFILE"
	check_ports_free
	resolve_jars
	[[ -z "$SECURE" ]] || make_tls
	prepare_node
	launch_node
	wait_started "$!" $((SECONDS + START_TIMEOUT))
	say "$(label) ready in $((SECONDS - t0)) s at $BOOTSTRAP"
}

# cmd_run runs node N in the foreground, its log on stdout: for a
# supervisor (a test harness, systemd) that owns the nodes; up, down and
# start are not for nodes started this way. The java
# process replaces this script, so signals reach the broker directly.
cmd_run() {
	check_java
	select_node "$1"
	# A lock of the node's own: its siblings start (and format) at the
	# same time.
	lock "$NODE_DIR"
	local pid
	if pid="$(pid_of_broker)"; then
		die "$(label) is already running (pid $pid) at $BOOTSTRAP"
	fi
	check_ports_free
	resolve_jars
	[[ -z "$SECURE" ]] || make_tls
	prepare_node
	printf '%s\n' "$$" >"$PIDFILE" # exec keeps the pid
	local -a cmd
	jvm_args cmd
	exec 9>&- # release the lock
	exec "${cmd[@]}"
}

cmd_status() {
	local n pid up=0
	for ((n = 1; n <= NODES; n++)); do
		select_node "$n"
		if pid="$(pid_of_broker)"; then
			up=$((up + 1))
			if port_open "$PORT"; then
				say "$(label) running (pid $pid) at $BOOTSTRAP"
			else
				say "$(label) process running (pid $pid) but $BOOTSTRAP not accepting connections yet"
			fi
		elif port_open "$PORT"; then
			say "$(label) not running from $DATA, but something else listens on $BOOTSTRAP"
		else
			say "$(label) not running (address would be $BOOTSTRAP)"
		fi
	done
	((up == NODES)) && return 0
	[[ -z "$CLUSTER" ]] || say "$up of $NODES nodes running"
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

cmd_logs() {
	select_node "${1:-1}"
	tail -n "${LINES:-100}" "$LOG"
}

# need_node fails unless a node number follows the command.
need_node() { [[ -n "${2:-}" ]] || die "usage: $0 $1 N (a node number, 1..$NODES)"; }

case "${1:-}" in
up) cmd_up ;;
down) cmd_down ;;
status) cmd_status ;;
reset) cmd_reset ;;
logs) cmd_logs "${2:-}" ;;
kill | stop | start | run)
	need_node "$@"
	"cmd_$1" "$2"
	;;
*)
	echo "usage: $0 {up|down|status|reset|logs [N]|kill N|stop N|start N|run N}" >&2
	exit 2
	;;
esac
