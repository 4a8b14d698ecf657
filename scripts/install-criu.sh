#!/usr/bin/env bash
# Install CRIU >= 4.2 as /usr/local/sbin/criu, built from Debian's source package, and CRIU's own
# cuda plugin (plugins/cuda of the same source) in CRIU's plugin directory (the `--libdir` default
# that `criu --help` prints, /usr/lib/criu/). The plugin execs `cuda-checkpoint` from PATH; cryo's
# front end serves it (`cryo install-compat`), and crates/cli/tests/criu_cuda_plugin.rs drives it.
# Without /proc/driver/nvidia the plugin disables itself (so plain CRIU runs are unchanged) unless
# CRIU's fault injection 138 forces it on (CRIU_FAULT=138); on a GPU host it is active for every
# `criu` run whose image or process has CUDA state.
#
# Why: Debian bookworm's criu 3.17 fails on current kernels ("vdso: Unexpected rt vDSO area
# bounds"); 4.1.1 dumps processes but not their TCP sockets on Linux >= 6.16 ("Can't get 1:16 opt:
# Operation not supported", SO_PASSCRED is restricted to unix/netlink sockets since 6.16; fixed in
# CRIU 4.2), and every inference server listens on TCP. 4.2.1 built from Debian testing's source
# package works. The source is
# fetched with `apt-get source` from a deb-src entry derived at run time from this machine's own
# apt sources (no host is written into the repo), into a private apt state so the system's
# sources and lists are left as they are. The orig tarball's SHA-256 is checked against the .dsc.
#
# Also copies the binary and the shared libraries it needs (other than glibc's) into
# REPO/.carry/criu/ so it can be carried to another machine: `LD_LIBRARY_PATH=.carry/criu`.
#
# Idempotent: does nothing (beyond refreshing .carry/criu) when /usr/local/sbin/criu already
# reports >= 4.2, `criu check` passes and the plugin is installed; builds only the plugin when it
# alone is missing and the source tree is still in CRIU_WORK. Needs root and a Debian bookworm-like system.
#
# Env: CRIU_SUITE (default: forky, Debian testing), CRIU_WORK (build dir, default: /var/tmp/cryo-criu-build),
#      CRIU_FORCE=1 to rebuild even when a good criu is installed.
set -euo pipefail

SUITE="${CRIU_SUITE:-forky}"
WORK="${CRIU_WORK:-/var/tmp/cryo-criu-build}"
PREFIX_BIN=/usr/local/sbin/criu
NEED_MAJOR=4
NEED_MINOR=2
REPO="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
CARRY="$REPO/.carry/criu"

die() { echo "install-criu: error: $*" >&2; exit 1; }
say() { echo "install-criu: $*" >&2; }

[ "$(id -u)" -eq 0 ] || die "must run as root (apt-get and install into /usr/local/sbin)"

# Prints the version of the criu binary $1 as MAJOR*100+MINOR, or nothing if it does not run.
criu_major() {
    local v
    v="$("$1" --version 2>/dev/null | sed -n 's/^Version: *\([0-9][0-9]*\)\.\([0-9][0-9]*\).*/\1 \2/p' | head -n1)" || true
    [ -n "$v" ] && set -- $v && echo $(( $1 * 100 + $2 ))
    return 0
}
NEED=$(( NEED_MAJOR * 100 + NEED_MINOR ))

# The library closure of criu minus glibc and the loader, which every target has.
refresh_carry() {
    mkdir -p "$CARRY"
    install -m 0755 "$PREFIX_BIN" "$CARRY/criu"
    local lib
    ldd "$PREFIX_BIN" | awk '/=> \//{print $3}' | while read -r lib; do
        case "$(basename "$lib")" in
            libc.so.*|libm.so.*|libpthread.so.*|libdl.so.*|librt.so.*|ld-linux*|libresolv.so.*) ;;
            *) cp -L "$lib" "$CARRY/" ;;
        esac
    done
    say "carry: $(cd "$CARRY" && ls | tr '\n' ' ')-> $CARRY"
}

good_installed() {
    [ -x "$PREFIX_BIN" ] || return 1
    local major
    major="$(criu_major "$PREFIX_BIN")"
    [ -n "$major" ] && [ "$major" -ge "$NEED" ] || return 1
    "$PREFIX_BIN" check >/dev/null 2>&1 || return 1
}

# CRIU's plugin directory: the default the binary was built with.
plugin_dir() {
    "$PREFIX_BIN" --help 2>/dev/null | sed -n 's/.*--libdir.*(by default \([^)]*\)).*/\1/p' | head -n1 | sed 's:\(.\)/*$:\1:'
}

plugin_installed() {
    local dir
    dir="$(plugin_dir)"
    [ -n "$dir" ] && [ -f "$dir/cuda_plugin.so" ]
}

# Builds plugins/cuda in the source tree $WORK/build (criu built there already: the plugin
# needs its compel) and installs it into CRIU's plugin directory.
install_plugin() {
    local dir built="$WORK/build/plugins/cuda/cuda_plugin.so"
    dir="$(plugin_dir)"
    [ -n "$dir" ] || die "cannot read the plugin directory from '$PREFIX_BIN --help' (-L|--libdir)"
    # One build at a time (test runs of several worktrees start this script concurrently).
    exec 8>"$WORK/.plugin.lock"
    flock 8
    say "building CRIU's cuda plugin (log: $WORK/build.log)"
    (export PATH=/usr/sbin:/usr/bin:/sbin:/bin
     make -C "$WORK/build" -j"$(nproc)" NO_GNUTLS=1 cuda_plugin) >>"$WORK/build.log" 2>&1 \
        || { tail -n 30 "$WORK/build.log" >&2; die "cuda plugin build failed (log: $WORK/build.log)"; }
    [ -f "$built" ] || die "plugin build finished but $built is missing"
    # Atomically: CRIU loads every *.so of the directory, and a concurrent run may start it.
    install -D -m 0755 "$built" "$dir/.cuda_plugin.so.$$"
    mv -f "$dir/.cuda_plugin.so.$$" "$dir/cuda_plugin.so"
    exec 8>&-
    say "cuda plugin installed at $dir/cuda_plugin.so"
}

# The source tree matches the installed binary: same version line.
tree_matches() {
    [ -x "$WORK/build/criu/criu" ] && [ -f "$WORK/build/plugins/cuda/cuda_plugin.c" ] &&
        [ "$("$WORK/build/criu/criu" --version 2>/dev/null | head -n1)" = "$("$PREFIX_BIN" --version | head -n1)" ]
}

if [ "${CRIU_FORCE:-0}" != 1 ] && good_installed; then
    if ! plugin_installed && tree_matches; then
        install_plugin
    fi
    if plugin_installed; then
        say "$("$PREFIX_BIN" --version | head -n1) already installed at $PREFIX_BIN, check passes, cuda plugin in $(plugin_dir)"
        refresh_carry
        exit 0
    fi
    say "the cuda plugin is missing and $WORK holds no matching CRIU source tree: building both"
fi

start=$(date +%s)
command -v apt-get >/dev/null || die "apt-get not found: this script needs a Debian system"

# --- the mirror URI, from the system's own sources -------------------------------------------
. "$REPO/scripts/lib/debian.sh"
uri="$(debian_mirror_uri)"
[ -n "$uri" ] || die "could not find a Debian mirror URI in /etc/apt/sources.list{,.d/*}"
say "deb-src $uri $SUITE main (derived from the system sources)"

keyring=/usr/share/keyrings/debian-archive-keyring.gpg
[ -r "$keyring" ] || die "$keyring missing: install debian-archive-keyring"

# --- private apt state for the source fetch ---------------------------------------------------
rm -rf "$WORK"
mkdir -p "$WORK/apt/lists/partial" "$WORK/apt/parts" "$WORK/apt/cache/archives/partial" "$WORK/src"
LOG="$WORK/build.log"
: >"$LOG"
echo "deb-src [signed-by=$keyring] $uri $SUITE main" >"$WORK/apt/sources.list"
APT_OPTS=(
    -o "Dir::Etc::SourceList=$WORK/apt/sources.list"
    -o "Dir::Etc::SourceParts=$WORK/apt/parts"
    -o "Dir::State::Lists=$WORK/apt/lists"
    -o "Dir::Cache=$WORK/apt/cache"
    -o "APT::Sandbox::User=root"
)
say "fetching $SUITE source index"
apt-get "${APT_OPTS[@]}" update >>"$LOG" 2>&1 || { tail -n 20 "$LOG" >&2; die "apt-get update for deb-src $SUITE failed (log: $LOG)"; }

say "downloading criu source package"
# The .dsc and the Debian diff may be absent from the mirror (seen: 404), while the orig tarball,
# which is all the build needs, is there. apt verifies what it fetches against the signed Sources
# index; a missing .dsc is tolerated and the index entry (the same Checksums-Sha256) used instead.
(cd "$WORK/src" && apt-get "${APT_OPTS[@]}" source --download-only criu) >>"$LOG" 2>&1 \
    || say "apt-get source reported errors (log: $LOG); continuing if the orig tarball arrived"

orig="$(ls "$WORK"/src/criu_*.orig.tar.* 2>/dev/null | grep -v '\.asc$' | head -n1 || true)"
[ -n "$orig" ] || { tail -n 20 "$LOG" >&2; die "apt-get source criu did not fetch the orig tarball (log: $LOG)"; }
dsc="$(ls "$WORK"/src/criu_*.dsc 2>/dev/null | head -n1 || true)"
if [ -n "$dsc" ]; then
    meta="$dsc"
else
    meta="$WORK/src/criu.showsrc"
    apt-cache "${APT_OPTS[@]}" showsrc --only-source criu >"$meta" 2>>"$LOG" \
        || die "apt-cache showsrc criu failed (log: $LOG)"
fi
# First stanza only: the one apt-get source chose (highest version).
ver="$(sed -n 's/^Version: *//p' "$meta" | head -n1)"
say "criu source $ver, checksums from $(basename "$meta")"
case "$ver" in
    [0-9]*) vmaj="${ver%%.*}"; vmin="${ver#*.}"; vmin="${vmin%%[!0-9]*}"
            [ $(( vmaj * 100 + vmin )) -ge "$NEED" ] || die "suite $SUITE has criu $ver, need >= $NEED_MAJOR.$NEED_MINOR (set CRIU_SUITE)";;
    *) die "bad version '$ver' in $meta";;
esac

# Explicit check on top of apt's: the tarball's SHA-256 as listed in Checksums-Sha256.
want="$(awk -v f="$(basename "$orig")" '
    /^Checksums-Sha256:/ { on=1; next }
    /^[^ ]/ { on=0 }
    on && $3 == f { print $1; exit }' "$meta")"
[ -n "$want" ] || die "$(basename "$orig") not listed in Checksums-Sha256 of $meta"
got="$(sha256sum "$orig" | cut -d' ' -f1)"
[ "$got" = "$want" ] || die "checksum mismatch for $(basename "$orig"): $(basename "$meta") says $want, file has $got"
say "sha256 ok: $(basename "$orig") $got"

# --- build dependencies (from the system's own suite) ----------------------------------------
say "installing build dependencies"
export DEBIAN_FRONTEND=noninteractive
DEPS=(gcc make pkg-config libc6-dev libprotobuf-c-dev libprotobuf-dev protobuf-c-compiler protobuf-compiler libnl-3-dev
      libnet1-dev libcap-dev libbsd-dev uuid-dev iproute2 iptables)
mapfile -t missing < <(debian_missing_packages "${DEPS[@]}")
if [ "${#missing[@]}" -eq 0 ]; then
    say "build dependencies already installed"
else
    say "apt-get install ${missing[*]}"
    apt-get update >>"$LOG" 2>&1 || { tail -n 20 "$LOG" >&2; die "apt-get update failed (log: $LOG)"; }
    apt-get install -y --no-install-recommends "${missing[@]}" >>"$LOG" 2>&1 \
        || { tail -n 20 "$LOG" >&2; die "apt-get install of build dependencies failed (log: $LOG)"; }
fi

# --- build only the criu binary --------------------------------------------------------------
mkdir -p "$WORK/build"
tar -xf "$orig" -C "$WORK/build" --strip-components=1
say "building criu (log: $LOG)"
# Plain system tools: a pyenv shim or a user's PYTHON must not leak into the build.
export PATH=/usr/sbin:/usr/bin:/sbin:/bin
# No GnuTLS (TLS page server) and no nftables: fewer libraries to carry; network locking
# falls back to iptables, which cryo does not use (no tcp_established).
make -C "$WORK/build" -j"$(nproc)" NO_GNUTLS=1 criu >>"$LOG" 2>&1 \
    || { tail -n 30 "$LOG" >&2; die "criu build failed (log: $LOG)"; }
built="$WORK/build/criu/criu"
[ -x "$built" ] || die "build finished but $built is missing"

install -D -m 0755 "$built" "$PREFIX_BIN"
major="$(criu_major "$PREFIX_BIN")"
[ -n "$major" ] && [ "$major" -ge "$NEED" ] || die "$PREFIX_BIN does not report version >= $NEED_MAJOR.$NEED_MINOR"
"$PREFIX_BIN" check >>"$LOG" 2>&1 || { tail -n 20 "$LOG" >&2; die "'criu check' failed (log: $LOG)"; }
install_plugin
refresh_carry
say "$("$PREFIX_BIN" --version | head -n1) installed at $PREFIX_BIN in $(( $(date +%s) - start ))s (log: $LOG)"
