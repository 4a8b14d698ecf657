#!/usr/bin/env bash
# Install what the Kubernetes tests need, from Debian's archive only, into $CRYO_K8S_BASE/bin
# (default /var/tmp/cryo-k8s/bin), outside the repository so a re-run is fast:
#   etcd            from the binary package etcd-server (3.4 on bookworm), extracted, not installed
#                   (installing it would start a system etcd on machines with systemd);
#   kubectl         from the binary package kubernetes-client (1.20 on bookworm), extracted, so it
#                   does not collide with a kubectl the machine may already have;
#   kube-apiserver  built from Debian's `kubernetes` *source* package (the upstream tree with its
#                   vendored dependencies) with Debian's golang-go, the way debian/rules builds it.
#
# Why a build: no registry reachable here ships a kube-apiserver binary, and Debian stopped
# packaging the server parts; its source package still holds the whole tree. Two fixes are needed
# on top of the upstream 1.20 tree: the vendored reflect2 1.0.1 segfaults the server under
# Go >= 1.18 (at the first write) and is replaced by Debian's reflect2 1.0.2 (same API); the code
# generation step needs rsync.
#
# Verification: apt checks every download against the signed index; on top of that the .debs'
# SHA-256 are compared with the index's and the orig tarball's with the .dsc's (as install-criu.sh).
# The source is fetched through a private apt state with a deb-src entry derived at run time from
# this machine's own apt sources (no host is written into the repo); the system's sources are left
# as they are.
#
# Idempotent: does nothing when the three binaries are there and report the expected versions.
# Cold: ~4-4.5 min on 2 cores (the Go build), ~1.3 GB peak memory, ~2 GB disk while building.
# Needs root on a Debian bookworm-like system.
#
# Env: CRYO_K8S_BASE (default /var/tmp/cryo-k8s), CRYO_K8S_FORCE=1 to rebuild everything.
set -euo pipefail

BASE="${CRYO_K8S_BASE:-/var/tmp/cryo-k8s}"
. "$(dirname "${BASH_SOURCE[0]}")/lib/debian.sh"
BIN="$BASE/bin"
WORK="$BASE/work"
STAMP="$BIN/VERSIONS"

die() { echo "install-k8s: error: $*" >&2; exit 1; }
say() { echo "install-k8s: $*" >&2; }

[ "$(id -u)" -eq 0 ] || die "must run as root (apt-get)"
command -v apt-get >/dev/null || die "apt-get not found: this script needs a Debian system"

# The versions the binaries report, one line each; the stamp of a finished install.
versions() {
    "$BIN/etcd" --version 2>/dev/null | sed -n 's/^etcd Version: /etcd /p'
    "$BIN/kubectl" version --client --short 2>/dev/null | sed -n 's/^Client Version: /kubectl /p'
    "$BIN/kube-apiserver" --version 2>/dev/null | sed -n 's/^Kubernetes /kube-apiserver /p'
}

if [ "${CRYO_K8S_FORCE:-0}" != 1 ] && [ -f "$STAMP" ] \
    && [ -x "$BIN/etcd" ] && [ -x "$BIN/kubectl" ] && [ -x "$BIN/kube-apiserver" ] \
    && [ "$(versions)" = "$(cat "$STAMP")" ]; then
    say "already installed in $BIN: $(tr '\n' ' ' < "$STAMP")"
    exit 0
fi

start=$(date +%s)
export DEBIAN_FRONTEND=noninteractive
mkdir -p "$BIN" "$WORK"
LOG="$WORK/build.log"
: >"$LOG"

# --- etcd and kubectl: binary packages, checked and extracted ------------------------------
# Prints the SHA-256 the signed index lists for the candidate of package $1.
index_sha256() { apt-cache show --no-all-versions "$1" 2>/dev/null | sed -n 's/^SHA256: //p' | head -n1; }

if [ -z "$(index_sha256 etcd-server)" ] || [ -z "$(index_sha256 kubernetes-client)" ]; then
    say "apt-get update (etcd-server or kubernetes-client unknown to apt)"
    apt-get update >>"$LOG" 2>&1 || { tail -n 20 "$LOG" >&2; die "apt-get update failed (log: $LOG)"; }
fi

# fetch_bin PACKAGE PATH-IN-PACKAGE NAME: downloads PACKAGE, checks it, installs PATH as $BIN/NAME.
fetch_bin() {
    local pkg=$1 path=$2 name=$3 want got deb dir
    want="$(index_sha256 "$pkg")"
    [ -n "$want" ] || die "package $pkg not found in the apt index"
    dir="$WORK/deb-$pkg"
    rm -rf "$dir"; mkdir -p "$dir"
    (cd "$dir" && apt-get download "$pkg") >>"$LOG" 2>&1 \
        || { tail -n 20 "$LOG" >&2; die "apt-get download $pkg failed (log: $LOG)"; }
    deb="$(ls "$dir"/*.deb | head -n1)"
    got="$(sha256sum "$deb" | cut -d' ' -f1)"
    [ "$got" = "$want" ] || die "checksum mismatch for $(basename "$deb"): index says $want, file has $got"
    dpkg-deb -x "$deb" "$dir/root"
    install -m 0755 "$dir/root/$path" "$BIN/$name"
    say "$name from $(basename "$deb") (sha256 ok)"
    rm -rf "$dir"
}
fetch_bin etcd-server usr/bin/etcd etcd
fetch_bin kubernetes-client usr/bin/kubectl kubectl

# --- kube-apiserver: from the source package ------------------------------------------------
if [ "${CRYO_K8S_FORCE:-0}" != 1 ] && [ -x "$BIN/kube-apiserver" ] \
    && "$BIN/kube-apiserver" --version 2>/dev/null | grep -q '^Kubernetes v1\.20\.'; then
    say "kube-apiserver already built: $("$BIN/kube-apiserver" --version)"
else
    uri="$(debian_mirror_uri)"
    [ -n "$uri" ] || die "could not find a Debian mirror URI in the system's apt sources"
    suite="$(. /etc/os-release && echo "${VERSION_CODENAME:-}")"
    [ -n "$suite" ] || die "no VERSION_CODENAME in /etc/os-release"
    keyring=/usr/share/keyrings/debian-archive-keyring.gpg
    [ -r "$keyring" ] || die "$keyring missing: install debian-archive-keyring"

    apt_dir="$WORK/apt"
    rm -rf "$apt_dir" "$WORK/src"
    mkdir -p "$apt_dir/lists/partial" "$apt_dir/parts" "$apt_dir/cache/archives/partial" "$WORK/src"
    echo "deb-src [signed-by=$keyring] $uri $suite main" >"$apt_dir/sources.list"
    APT_OPTS=(
        -o "Dir::Etc::SourceList=$apt_dir/sources.list"
        -o "Dir::Etc::SourceParts=$apt_dir/parts"
        -o "Dir::State::Lists=$apt_dir/lists"
        -o "Dir::Cache=$apt_dir/cache"
        -o "APT::Sandbox::User=root"
    )
    say "deb-src $suite main (derived from the system sources): fetching the kubernetes source"
    apt-get "${APT_OPTS[@]}" update >>"$LOG" 2>&1 || { tail -n 20 "$LOG" >&2; die "apt-get update for deb-src failed (log: $LOG)"; }
    (cd "$WORK/src" && apt-get "${APT_OPTS[@]}" source --download-only kubernetes) >>"$LOG" 2>&1 \
        || { tail -n 20 "$LOG" >&2; die "apt-get source kubernetes failed (log: $LOG)"; }
    dsc="$(ls "$WORK"/src/kubernetes_*.dsc 2>/dev/null | head -n1 || true)"
    orig="$(ls "$WORK"/src/kubernetes_*.orig.tar.* 2>/dev/null | grep -v '\.asc$' | head -n1 || true)"
    [ -n "$dsc" ] && [ -n "$orig" ] || die "apt-get source did not fetch the .dsc and the orig tarball (log: $LOG)"
    ver="$(sed -n 's/^Version: *//p' "$dsc" | head -n1)"
    # 1.20.5+really1.20.2-1.1+deb12u1 -> 1.20.2 (what the tarball really holds)
    upstream="${ver#*:}"; upstream="${upstream%-*}"; upstream="${upstream##*really}"
    case "$upstream" in 1.20.*) ;; *) die "kubernetes source $ver is not 1.20.x: this script knows how to build 1.20 only";; esac
    want="$(awk -v f="$(basename "$orig")" '/^Checksums-Sha256:/{on=1;next} /^[^ ]/{on=0} on && $3==f {print $1; exit}' "$dsc")"
    got="$(sha256sum "$orig" | cut -d' ' -f1)"
    [ -n "$want" ] && [ "$got" = "$want" ] || die "checksum mismatch for $(basename "$orig"): .dsc says '$want', file has $got"
    say "kubernetes source $ver, sha256 ok: $(basename "$orig")"

    DEPS=(golang-go make rsync golang-github-modern-go-reflect2-dev)
    mapfile -t missing < <(debian_missing_packages "${DEPS[@]}")
    if [ "${#missing[@]}" -gt 0 ]; then
        say "apt-get install ${missing[*]}"
        apt-get update >>"$LOG" 2>&1 || { tail -n 20 "$LOG" >&2; die "apt-get update failed (log: $LOG)"; }
        apt-get install -y --no-install-recommends "${missing[@]}" >>"$LOG" 2>&1 \
            || { tail -n 20 "$LOG" >&2; die "apt-get install of build dependencies failed (log: $LOG)"; }
    fi

    tree="$WORK/build"
    rm -rf "$tree"; mkdir -p "$tree"
    tar -xf "$orig" -C "$tree" --strip-components=1
    rm -rf "$tree/vendor/github.com/modern-go/reflect2"
    cp -r /usr/share/gocode/src/github.com/modern-go/reflect2 "$tree/vendor/github.com/modern-go/reflect2"
    say "building kube-apiserver $upstream (log: $LOG; ~4 min on 2 cores)"
    commit="$(sed -n 's/^gitCommit=//p' "$tree/.git-commit" 2>/dev/null || true)"
    (
        cd "$tree"
        export PATH=/usr/lib/go/bin:/usr/sbin:/usr/bin:/sbin:/bin CGO_ENABLED=0 HOME="$WORK/home" \
            GOCACHE="$WORK/go-cache" GOFLAGS=
        # 1.20's build runs in GOPATH mode and generates code first; version stamps as debian/rules.
        export KUBE_GIT_VERSION="v$upstream" KUBE_GIT_MAJOR=1 KUBE_GIT_MINOR=20 KUBE_GIT_TREE_STATE=clean \
            KUBE_GIT_COMMIT="${commit:-unknown}"
        make WHAT=cmd/kube-apiserver GOLDFLAGS="-s -w"
    ) >>"$LOG" 2>&1 || { tail -n 30 "$LOG" >&2; die "kube-apiserver build failed (log: $LOG)"; }
    install -m 0755 "$tree/_output/bin/kube-apiserver" "$BIN/kube-apiserver"
    # The tree and the build cache are ~2 GB; the binary is all the tests need.
    rm -rf "$tree" "$WORK/go-cache" "$WORK/home" "$apt_dir"
fi

versions >"$STAMP"
[ "$(wc -l <"$STAMP")" = 3 ] || { cat "$STAMP" >&2; die "a binary in $BIN does not run or reports no version"; }
say "installed in $BIN in $(( $(date +%s) - start )) s: $(tr '\n' ' ' < "$STAMP")"
