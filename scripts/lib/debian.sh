# Sourced by the install scripts: helpers for fetching from the machine's own Debian archive.

# Prints the first Debian mirror URI of the system's apt sources that is not the security
# archive (deb822 debian.sources first, then the one-line format), or nothing.
debian_mirror_uri() {
    local uri=""
    if [ -r /etc/apt/sources.list.d/debian.sources ]; then
        uri="$(awk '/^URIs:/ && $2 !~ /security/ { print $2; exit }' /etc/apt/sources.list.d/debian.sources)"
    fi
    if [ -z "$uri" ]; then
        # one-line format: first "deb [opts] URI suite main" that is not a security mirror.
        uri="$(cat /etc/apt/sources.list /etc/apt/sources.list.d/*.list 2>/dev/null \
            | sed -n 's/^deb\(-src\)\?[[:space:]]\+\(\[[^]]*\][[:space:]]\+\)\?\([^[:space:]]\+\)[[:space:]].*/\3/p' \
            | grep -v security | head -n1 || true)"
    fi
    echo "$uri"
}

# Prints those of the packages named that are not installed, one a line.
debian_missing_packages() {
    local p
    for p in "$@"; do
        dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q 'ok installed' || echo "$p"
    done
}
