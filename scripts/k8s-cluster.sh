#!/usr/bin/env bash
# A real Kubernetes control plane for tests: etcd + kube-apiserver on loopback, no kubelet,
# scheduler or controllers (binaries from scripts/install-k8s.sh).
#
#   k8s-cluster.sh start DIR [--until-exit-of PID]
#                              start one in DIR (created, must not exist or be empty); with
#                              --until-exit-of it stops itself and removes DIR when PID exits (so
#                              a test script needs no EXIT trap of its own); prints the
#                              environment the tests read, also written to DIR/env:
#                                CRYO_TEST_KUBECONFIG        admin (system:masters)
#                                CRYO_TEST_AGENT_KUBECONFIG  the agent's identity: user
#                                  system:serviceaccount:cryo-system:cryo-agent, i.e. what the
#                                  DaemonSet's ServiceAccount is; it may do only what deploy/'s
#                                  ClusterRole grants (the tests apply that role)
#                                CRYO_TEST_KUBECTL           a kubectl of the same version
#   k8s-cluster.sh stop DIR    stop it and remove DIR
#   k8s-cluster.sh stop-apiserver DIR / start-apiserver DIR
#                              an outage: SIGKILL the API server only (etcd stays), then start it
#                              again on the same port (tests of what the agent does meanwhile)
#   k8s-cluster.sh pause-apiserver DIR / resume-apiserver DIR
#                              a hung API server: SIGSTOP it (connections hang), then SIGCONT
#
# Every cluster gets its own directory, certificates and free loopback ports, so test runs on the
# same machine do not meet. Authorization is Node,RBAC with the NodeRestriction admission plugin,
# as on a real cluster. Start-up to /readyz: ~4 s.
#
# Env: CRYO_K8S_BASE (where install-k8s.sh put the binaries, default /var/tmp/cryo-k8s).
set -euo pipefail

BASE="${CRYO_K8S_BASE:-/var/tmp/cryo-k8s}"
BIN="$BASE/bin"
SELF="$(readlink -f "$0")"

die() { echo "k8s-cluster: error: $*" >&2; exit 1; }
say() { echo "k8s-cluster: $*" >&2; }

# stop DIR: ends what DIR/*.pid name (only if it is still the binary this script started).
stop() {
    local dir=$1 p pid
    for p in apiserver etcd; do
        [ -f "$dir/$p.pid" ] || continue
        pid="$(cat "$dir/$p.pid")"
        if [ -n "$pid" ] && grep -qa -- "$dir" "/proc/$pid/cmdline" 2>/dev/null; then
            kill "$pid" 2>/dev/null || true
            for _ in $(seq 1 100); do kill -0 "$pid" 2>/dev/null || break; sleep 0.1; done
            kill -9 "$pid" 2>/dev/null || true
        fi
        rm -f "$dir/$p.pid"
    done
}

certs() {
    local d=$1/pki
    mkdir -p "$d"
    (
        cd "$d"
        # A CA and a server certificate signed by it (rustls rejects a self-signed CA used
        # directly as the server certificate).
        openssl req -x509 -newkey rsa:2048 -nodes -keyout ca.key -out ca.crt -days 30 -subj "/CN=cryo-test-ca"
        openssl req -newkey rsa:2048 -nodes -keyout apiserver.key -out apiserver.csr -subj "/CN=kube-apiserver"
        printf 'subjectAltName=IP:127.0.0.1,DNS:localhost\nextendedKeyUsage=serverAuth\nbasicConstraints=CA:FALSE\nkeyUsage=digitalSignature,keyEncipherment\n' > ext.cnf
        openssl x509 -req -in apiserver.csr -CA ca.crt -CAkey ca.key -CAcreateserial -out apiserver.crt -days 30 -extfile ext.cnf
        openssl genrsa -out sa.key 2048
        openssl rsa -in sa.key -pubout -out sa.pub
    ) >"$1/openssl.log" 2>&1 || { cat "$1/openssl.log" >&2; die "certificate generation failed"; }
    # token,user,uid,"groups"
    local admin agent
    admin="$(head -c 24 /dev/urandom | od -An -tx1 | tr -d ' \n')"
    agent="$(head -c 24 /dev/urandom | od -An -tx1 | tr -d ' \n')"
    printf '%s,cryo-test-admin,1,"system:masters"\n' "$admin" >"$d/tokens.csv"
    printf '%s,system:serviceaccount:cryo-system:cryo-agent,2,"system:serviceaccounts,system:serviceaccounts:cryo-system,system:authenticated"\n' "$agent" >>"$d/tokens.csv"
    chmod 600 "$d/tokens.csv" "$d"/*.key
    kubeconfig "$1" admin "$admin"
    kubeconfig "$1" agent "$agent"
}

# kubeconfig DIR NAME TOKEN: writes DIR/NAME.kubeconfig (the server line is filled in by start).
kubeconfig() {
    local ca
    ca="$(base64 -w0 <"$1/pki/ca.crt")"
    cat >"$1/$2.kubeconfig" <<EOF
apiVersion: v1
kind: Config
clusters:
- name: cryo-test
  cluster: {server: "https://127.0.0.1:APORT", certificate-authority-data: "$ca"}
users:
- name: $2
  user: {token: "$3"}
contexts:
- name: $2
  context: {cluster: cryo-test, user: $2, namespace: default}
current-context: $2
EOF
    chmod 600 "$1/$2.kubeconfig"
}

# A loopback TCP port nobody listens on now (the start retries if it is taken meanwhile).
free_port() {
    local p
    for _ in $(seq 1 50); do
        p=$(( 20000 + RANDOM % 30000 ))
        ss -Hltn "sport = :$p" | grep -q . || { echo "$p"; return 0; }
    done
    die "no free loopback port found"
}

# try_start DIR: one attempt with fresh ports; returns 1 when a port was taken (retry), dies on
# anything else.
try_start() {
    local dir=$1 eport epeer aport
    eport=$(free_port); epeer=$(free_port); aport=$(free_port)
    rm -rf "$dir/etcd-data"
    "$BIN/etcd" --name cryo-test --data-dir "$dir/etcd-data" \
        --listen-client-urls "http://127.0.0.1:$eport" --advertise-client-urls "http://127.0.0.1:$eport" \
        --listen-peer-urls "http://127.0.0.1:$epeer" --initial-advertise-peer-urls "http://127.0.0.1:$epeer" \
        --initial-cluster "cryo-test=http://127.0.0.1:$epeer" \
        >"$dir/etcd.log" 2>&1 &
    echo $! >"$dir/etcd.pid"
    for _ in $(seq 1 300); do
        grep -q 'ready to serve client requests' "$dir/etcd.log" && break
        if ! kill -0 "$(cat "$dir/etcd.pid")" 2>/dev/null; then
            grep -q 'address already in use' "$dir/etcd.log" && { rm -f "$dir/etcd.pid"; return 1; }
            tail -n 20 "$dir/etcd.log" >&2; die "etcd died (log: $dir/etcd.log)"
        fi
        sleep 0.05
    done
    grep -q 'ready to serve client requests' "$dir/etcd.log" || { stop "$dir"; die "etcd not ready after 15 s (log: $dir/etcd.log)"; }

    echo "$eport $aport" >"$dir/ports"
    run_apiserver "$dir" "$eport" "$aport"
    sed -i "s/127.0.0.1:APORT/127.0.0.1:$aport/" "$dir/admin.kubeconfig" "$dir/agent.kubeconfig"
    if ! wait_ready "$dir"; then
        if grep -q 'address already in use' "$dir/apiserver.log"; then
            stop "$dir"
            sed -i "s/127.0.0.1:$aport/127.0.0.1:APORT/" "$dir/admin.kubeconfig" "$dir/agent.kubeconfig"
            return 1
        fi
        tail -n 20 "$dir/apiserver.log" >&2; stop "$dir"; die "kube-apiserver did not become ready (log: $dir/apiserver.log)"
    fi
}

# run_apiserver DIR EPORT APORT: starts kube-apiserver in the background (log appended).
run_apiserver() {
    local dir=$1 eport=$2 aport=$3
    local p=$dir/pki
    "$BIN/kube-apiserver" \
        --etcd-servers "http://127.0.0.1:$eport" \
        --bind-address 127.0.0.1 --advertise-address 127.0.0.1 --secure-port "$aport" \
        --tls-cert-file "$p/apiserver.crt" --tls-private-key-file "$p/apiserver.key" \
        --client-ca-file "$p/ca.crt" --token-auth-file "$p/tokens.csv" \
        --authorization-mode Node,RBAC --enable-admission-plugins NodeRestriction \
        --disable-admission-plugins ServiceAccount \
        --service-account-issuer https://kubernetes.default.svc \
        --service-account-key-file "$p/sa.pub" --service-account-signing-key-file "$p/sa.key" \
        --service-cluster-ip-range 10.0.0.0/24 --endpoint-reconciler-type none \
        --cert-dir "$dir/certs" >>"$dir/apiserver.log" 2>&1 &
    echo $! >"$dir/apiserver.pid"
}

# wait_ready DIR: 0 once /readyz answers, 1 if the API server died or is not ready in 60 s.
wait_ready() {
    local dir=$1
    for _ in $(seq 1 600); do
        # Our CA in the kubeconfig: another server on that port could not answer.
        if "$BIN/kubectl" --kubeconfig "$dir/admin.kubeconfig" get --raw /readyz >/dev/null 2>&1; then
            return 0
        fi
        kill -0 "$(cat "$dir/apiserver.pid")" 2>/dev/null || return 1
        sleep 0.1
    done
    return 1
}

# stop_apiserver DIR: ends the API server only (etcd and the directory stay), as an outage.
stop_apiserver() {
    local dir=$1 pid
    [ -f "$dir/apiserver.pid" ] || die "$dir has no running API server"
    pid="$(cat "$dir/apiserver.pid")"
    if grep -qa -- "$dir" "/proc/$pid/cmdline" 2>/dev/null; then
        kill -9 "$pid"
        for _ in $(seq 1 100); do kill -0 "$pid" 2>/dev/null || break; sleep 0.05; done
    fi
    rm -f "$dir/apiserver.pid"
}

# signal_apiserver DIR SIG: SIGSTOP (a hung API server: connections are accepted by the kernel,
# never answered) or SIGCONT.
signal_apiserver() {
    local dir=$1 pid
    [ -f "$dir/apiserver.pid" ] || die "$dir has no running API server"
    pid="$(cat "$dir/apiserver.pid")"
    grep -qa -- "$dir" "/proc/$pid/cmdline" 2>/dev/null || die "pid $pid is not $dir's API server"
    kill "-$2" "$pid"
}

# start_apiserver DIR: starts it again on the same port after stop_apiserver.
start_apiserver() {
    local dir=$1 eport aport
    [ -f "$dir/ports" ] || die "$dir is not a cluster this script started"
    [ ! -f "$dir/apiserver.pid" ] || die "$dir's API server runs already"
    read -r eport aport <"$dir/ports"
    run_apiserver "$dir" "$eport" "$aport"
    wait_ready "$dir" || { tail -n 20 "$dir/apiserver.log" >&2; die "kube-apiserver did not come back (log: $dir/apiserver.log)"; }
    say "API server back on 127.0.0.1:$aport"
}

start() {
    local dir=$1
    for b in etcd kube-apiserver kubectl; do
        [ -x "$BIN/$b" ] || die "$BIN/$b missing: run scripts/install-k8s.sh first"
    done
    if [ -e "$dir" ] && [ -n "$(ls -A "$dir")" ]; then die "$dir exists and is not empty"; fi
    mkdir -p "$dir"; chmod 700 "$dir"
    local t0; t0=$(date +%s%3N)
    certs "$dir"
    local ok=""
    for _ in 1 2 3 4 5; do
        if try_start "$dir"; then ok=1; break; fi
        say "a port was taken meanwhile; retrying with others"
    done
    [ -n "$ok" ] || die "could not find free ports after 5 tries"
    cat >"$dir/env" <<EOF
CRYO_TEST_KUBECONFIG=$dir/admin.kubeconfig
CRYO_TEST_AGENT_KUBECONFIG=$dir/agent.kubeconfig
CRYO_TEST_KUBECTL=$BIN/kubectl
EOF
    if [ -n "${2:-}" ]; then
        # A watcher outside the caller's process group and output: when PID exits, stop.
        setsid bash -c 'tail --pid="$1" -f /dev/null; bash "$2" stop "$3"' _ "$2" "$SELF" "$dir" \
            </dev/null >/dev/null 2>&1 &
    fi
    say "API server $(sed -n 's/.*server: "\([^"]*\)".*/\1/p' "$dir/admin.kubeconfig") ready in $(( $(date +%s%3N) - t0 )) ms (state: $dir)"
    sed 's/^/export /' "$dir/env"
}

case "${1:-}" in
    start)
        [ -n "${2:-}" ] || die "usage: $0 start DIR [--until-exit-of PID]"
        owner=""
        if [ "${3:-}" = --until-exit-of ]; then
            owner="${4:-}"
            [[ "$owner" =~ ^[0-9]+$ ]] && kill -0 "$owner" 2>/dev/null || die "--until-exit-of needs a live pid"
        fi
        start "$(realpath -m "$2")" "$owner" ;;
    stop) [ -n "${2:-}" ] || die "usage: $0 stop DIR"; d="$(realpath -m "$2")"; [ -d "$d" ] && { stop "$d"; rm -rf "$d"; }; true ;;
    stop-apiserver) [ -n "${2:-}" ] || die "usage: $0 stop-apiserver DIR"; stop_apiserver "$(realpath -m "$2")" ;;
    start-apiserver) [ -n "${2:-}" ] || die "usage: $0 start-apiserver DIR"; start_apiserver "$(realpath -m "$2")" ;;
    pause-apiserver) [ -n "${2:-}" ] || die "usage: $0 pause-apiserver DIR"; signal_apiserver "$(realpath -m "$2")" STOP ;;
    resume-apiserver) [ -n "${2:-}" ] || die "usage: $0 resume-apiserver DIR"; signal_apiserver "$(realpath -m "$2")" CONT ;;
    *) die "usage: $0 start|stop|stop-apiserver|start-apiserver|pause-apiserver|resume-apiserver DIR" ;;
esac
