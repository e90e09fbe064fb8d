#!/usr/bin/env bash
# Build the Debian package of vouch from this workspace:
#
#   scripts/deb.sh [--binary PATH] [--out DIR]
#
# It holds /usr/bin/vouch (stripped), a manual page per command (generated
# by that binary: `vouch man DIR`), the systemd units from dist/systemd/,
# and the copyright, changelog and maintainer scripts from dist/debian/.
# Without --binary it builds one (cargo build --release -p vouch). The
# .deb lands in DIR (default target/debian) and its path is printed last.
# Install it with: apt install ./target/debian/vouch_*.deb
#
# A script around dpkg-deb rather than cargo-deb: dpkg-deb and
# dpkg-shlibdeps come with every Debian system (dpkg, dpkg-dev), while
# cargo-deb is one more tool to compile and keep; and this way the
# package can be built from any binary already built (the tests use the
# ci-profile one).
set -euo pipefail
cd "$(dirname "$0")/.."

binary=""
out="target/debian"
while [ $# -gt 0 ]; do
    case "$1" in
        --binary) binary="$2"; shift 2 ;;
        --out) out="$2"; shift 2 ;;
        -h|--help) sed -n '2,12p' "$0" | sed 's/^# \{0,1\}//'; exit 0 ;;
        *) echo "deb.sh: unknown argument $1 (see --help)" >&2; exit 2 ;;
    esac
done
for tool in dpkg-deb dpkg-shlibdeps strip; do
    if ! command -v "$tool" >/dev/null 2>&1; then
        echo "deb.sh: $tool not found: apt-get install -y dpkg-dev binutils" >&2
        exit 2
    fi
done
if [ -z "$binary" ]; then
    cargo build --release -p vouch
    binary="target/release/vouch"
fi

version="$("$binary" --version | awk '{print $2}')"
changelog_version="$(sed -n '1s/^vouch (\([^)]*\)).*/\1/p' dist/debian/changelog)"
if [ "$version" != "$changelog_version" ]; then
    echo "deb.sh: the binary is version $version but dist/debian/changelog starts at $changelog_version: add a changelog entry" >&2
    exit 2
fi
arch="$(dpkg --print-architecture)"

stage="$(mktemp -d)"
trap 'rm -rf "$stage"' EXIT
root="$stage/root"
doc="$root/usr/share/doc/vouch"

install -d "$root/usr/bin" "$root/usr/lib/systemd/system" "$root/usr/share/man/man1" "$doc/examples" "$root/DEBIAN"
# Where vouch@NAME.service finds NAME.conf, and its volumes by default.
install -d -m 0755 "$root/etc/vouch"
install -d -m 0700 "$root/var/lib/vouch"
strip --strip-unneeded --remove-section=.comment -o "$root/usr/bin/vouch" "$binary"
chmod 0755 "$root/usr/bin/vouch"
install -m 0644 dist/systemd/vouch.socket dist/systemd/vouch@.service "$root/usr/lib/systemd/system/"
"$root/usr/bin/vouch" man "$stage/man" >/dev/null
for page in "$stage"/man/*.1; do
    gzip -9n <"$page" >"$root/usr/share/man/man1/$(basename "$page").gz"
done
install -m 0644 dist/debian/copyright "$doc/copyright"
gzip -9n <dist/debian/changelog >"$doc/changelog.gz"
install -m 0644 dist/debian/vouch.conf.example "$doc/examples/vouch.conf"
install -m 0755 dist/debian/postinst dist/debian/prerm dist/debian/postrm "$root/DEBIAN/"

# The shared libraries the binary needs, as dpkg-shlibdeps words them.
mkdir -p "$stage/debian"
printf 'Source: vouch\n\nPackage: vouch\nArchitecture: any\n' >"$stage/debian/control"
depends="$(cd "$stage" && dpkg-shlibdeps -O -e"root/usr/bin/vouch" 2>/dev/null | sed -n 's/^shlibs:Depends=//p')"
installed_size="$(du -sk --exclude=DEBIAN "$root" | cut -f1)"
{
    echo "Package: vouch"
    echo "Version: $version"
    echo "Architecture: $arch"
    echo "Installed-Size: $installed_size"
    echo "Depends: $depends"
    sed -n '/^Package:/d; p' dist/debian/control
} >"$root/DEBIAN/control"

mkdir -p "$out"
deb="$out/vouch_${version}_${arch}.deb"
dpkg-deb --root-owner-group --build "$root" "$deb" >/dev/null
echo "$deb"
