#!/usr/bin/env bash
# Package checks for CI (called from .ci/run; runs as root):
#   1. build the .deb with packaging/debian/build.sh and check its contents and control fields;
#   2. lintian: no errors (warnings are listed; overrides in packaging/debian/lintian-overrides);
#   3. install it with apt into a throwaway Debian root (debootstrap --variant=minbase, the same release as
#      this machine), then in that root: `preemptd version`, the user, the enabled units, the conffile,
#      `systemd-analyze verify --root`, and a purge that leaves nothing behind;
#   4. RPM: build packaging/rpm/preemptd.spec with rpmbuild where it is installed, else parse it.
# The throwaway root is unpacked from a cached minbase tarball (PREEMPTD_CI_CACHE, /var/tmp/preemptd-ci by
# default), so only the first run pays for debootstrap (about a minute and 70 MB of downloads).
# PREEMPTD_CI_ROOT=extract skips debootstrap: the .deb is unpacked with dpkg-deb -x and checked there
# without running its maintainer scripts (for machines that cannot reach a Debian mirror).
set -euo pipefail
cd "$(dirname "$0")/.."
repo=$(pwd)
mode=${PREEMPTD_CI_ROOT:-debootstrap}
cache=${PREEMPTD_CI_CACHE:-/var/tmp/preemptd-ci}
work=$(mktemp -d /tmp/preemptd-ci.XXXXXX)
cleanup() {
  for m in proc; do mountpoint -q "$work/root/$m" 2>/dev/null && umount "$work/root/$m"; done
  rm -rf "$work"
}
trap cleanup EXIT
fail() { echo "ci-check: FAILED: $*" >&2; exit 1; }
step() { echo "== packaging: $*"; }

step "tools"
[ "$(id -u)" = 0 ] || fail "run as root (it installs tools, and installs the package in a chroot)"
need=()
command -v dpkg-deb >/dev/null || need+=(dpkg)
command -v lintian >/dev/null || need+=(lintian)
command -v strip >/dev/null || need+=(binutils)
command -v systemd-analyze >/dev/null || need+=(systemd)
[ -x /usr/bin/python3 ] || need+=(python3)
/usr/bin/python3 -c 'import venv, ensurepip' 2>/dev/null || need+=(python3-venv)
/usr/bin/python3 -m pip --version >/dev/null 2>&1 || need+=(python3-pip)
[ "$mode" = debootstrap ] && ! command -v debootstrap >/dev/null && need+=(debootstrap)
command -v rpmbuild >/dev/null || need+=(rpm)
if [ ${#need[@]} -gt 0 ]; then
  apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends "${need[@]}" >/dev/null
fi

step "build the .deb"
bash packaging/debian/build.sh "$work/dist" 2>&1 | grep -v "^WARNING: Location '" || true
deb=$(ls "$work"/dist/preemptd_*.deb 2>/dev/null | head -1)
[ -n "$deb" ] || fail "no .deb was built"
version=$(sed -n 's/^__version__ = "\(.*\)"$/\1/p' agent/__init__.py)

step "contents of $(basename "$deb")"
dpkg-deb -c "$deb" | awk '{print $6}' | sed 's|^\./|/|' > "$work/files"
for path in /opt/preemptd/bin/preemptd /opt/preemptd/bin/python /opt/preemptd/pyvenv.cfg /usr/bin/preemptd \
  /lib/systemd/system/preemptd.service /lib/systemd/system/preemptd.socket /usr/lib/sysusers.d/preemptd.conf \
  /usr/lib/tmpfiles.d/preemptd.conf /etc/preemptd/config.toml /usr/share/doc/preemptd/copyright \
  /usr/share/doc/preemptd/changelog.Debian.gz; do
  grep -qx "$path" "$work/files" || fail "$path is not in the package"
done
grep -q '^/opt/preemptd/lib/python3[.0-9]*/site-packages/agent/actions/component.py$' "$work/files" \
  || fail "the agent package is not in the virtual environment"
! grep -q '\.pyc$' "$work/files" || fail "the package ships .pyc files"
[ "$(dpkg-deb -f "$deb" Package)" = preemptd ] || fail "Package field"
[ "$(dpkg-deb -f "$deb" Version)" = "$version-1" ] || fail "Version field is not $version-1"
dpkg-deb --ctrl-tarfile "$deb" | tar -xO ./conffiles | grep -qx /etc/preemptd/config.toml || fail "config.toml is not a conffile"
mkdir -p "$work/x" && dpkg-deb -x "$deb" "$work/x"
! grep -rlI "/tmp/preemptd-build" "$work/x" || fail "files above name the build's staging directory"
echo "ok: $(wc -l < "$work/files") paths, $(dpkg-deb -f "$deb" Installed-Size) KiB installed"

step "lintian"
lintian --fail-on error --suppress-tags unusual-interpreter,script-not-executable "$deb" 2>&1 \
  | grep -v 'running with root privileges' || true
lintian --fail-on error "$deb" >/dev/null 2>&1 || fail "lintian reports errors (run: lintian $deb)"
echo "ok: no lintian errors"

root=$work/root
if [ "$mode" = debootstrap ]; then
  step "install into a throwaway Debian root"
  codename=$(. /etc/os-release && echo "${VERSION_CODENAME:-bookworm}")
  mirror=${PREEMPTD_CI_MIRROR:-http://deb.debian.org/debian}
  tarball="$cache/$codename-minbase.tar"
  if [ ! -s "$tarball" ]; then
    mkdir -p "$cache"
    debootstrap --variant=minbase "$codename" "$work/seed" "$mirror" >"$work/debootstrap.log" 2>&1 \
      || { tail -20 "$work/debootstrap.log"; fail "debootstrap $codename from $mirror"; }
    tar -C "$work/seed" -cf "$tarball.tmp" . && mv "$tarball.tmp" "$tarball"
    rm -rf "$work/seed"
  fi
  mkdir -p "$root" && tar -C "$root" -xf "$tarball"
  cp /etc/resolv.conf "$root/etc/resolv.conf"
  cp "$deb" "$root/tmp/preemptd.deb"
  in_root() { chroot "$root" env -i PATH=/usr/sbin:/usr/bin:/sbin:/bin DEBIAN_FRONTEND=noninteractive LANG=C.UTF-8 "$@"; }
  in_root apt-get update -qq >/dev/null
  in_root apt-get install -y -qq /tmp/preemptd.deb >"$work/install.log" 2>&1 || { tail -30 "$work/install.log"; fail "apt-get install"; }
  echo "installed: $(in_root dpkg-query -W -f='${Package} ${Version} ${Status}' preemptd)"
  in_root preemptd version | tee "$work/version"
  grep -q "^preemptd $version " "$work/version" || fail "preemptd version in the root"
  in_root getent passwd preemptd >/dev/null || fail "no preemptd user"
  [ -d "$root/var/lib/preemptd" ] || fail "no /var/lib/preemptd"
  [ -L "$root/etc/systemd/system/sockets.target.wants/preemptd.socket" ] || fail "preemptd.socket is not enabled"
  [ -L "$root/etc/systemd/system/multi-user.target.wants/preemptd.service" ] || fail "preemptd.service is not enabled"
  in_root dpkg-query -W -f='${Conffiles}' preemptd | grep -q /etc/preemptd/config.toml || fail "conffile not registered"
  in_root preemptd run --help >/dev/null || fail "preemptd run --help"
  # The installed /etc/preemptd/config.toml loads, and it turns the RAM tier on.
  in_root preemptd run --print-config >"$work/config.json" || fail "preemptd run --print-config"
  python3 -c 'import json, sys; sys.exit(json.load(open(sys.argv[1]))["ram_tier"]["enabled"] is not True)' \
    "$work/config.json" || fail "the packaged config.toml does not turn the RAM tier on"
  (cd "$root" && systemd-analyze verify --root="$root" preemptd.socket preemptd.service) || fail "systemd-analyze verify"
  echo "ok: units verify in the root"
  in_root apt-get purge -y -qq preemptd >"$work/purge.log" 2>&1 || { tail -20 "$work/purge.log"; fail "purge"; }
  [ ! -e "$root/opt/preemptd" ] || fail "/opt/preemptd is left after purge: $(find "$root/opt/preemptd" | head)"
  [ ! -e "$root/etc/systemd/system/sockets.target.wants/preemptd.socket" ] || fail "enablement left after purge"
  [ ! -e "$root/etc/preemptd/config.toml" ] || fail "config left after purge"
  echo "ok: purge leaves nothing behind"
else
  step "unpack into a throwaway root (no maintainer scripts)"
  # The units need the standard targets and /bin/kill to verify: take this machine's.
  mkdir -p "$root/lib/systemd" "$root/bin" && cp -a /lib/systemd/system "$root/lib/systemd/" && cp /bin/kill "$root/bin/"
  dpkg-deb -x "$deb" "$root"
  "$root/opt/preemptd/bin/python" -m agent version | grep -q "^preemptd $version " || fail "preemptd version"
  systemd-analyze verify --root="$root" preemptd.socket preemptd.service || fail "systemd-analyze verify"
  echo "ok: preemptd version runs and the units verify in the unpacked root"
fi

step "rpm"
if command -v rpmbuild >/dev/null; then
  bash packaging/rpm/build.sh "$work/rpm" >"$work/rpm.log" 2>&1 || { tail -40 "$work/rpm.log"; fail "rpmbuild"; }
  rpm=$(ls "$work"/rpm/RPMS/*/preemptd-*.rpm 2>/dev/null | head -1)
  [ -n "$rpm" ] || fail "no rpm was built"
  rpm -qpl "$rpm" 2>/dev/null > "$work/rpmfiles"
  for path in /opt/preemptd/bin/preemptd /usr/bin/preemptd /usr/lib/systemd/system/preemptd.service \
    /usr/lib/systemd/system/preemptd.socket /usr/lib/sysusers.d/preemptd.conf /etc/preemptd/config.toml; do
    grep -qx "$path" "$work/rpmfiles" || fail "$path is not in the rpm"
  done
  rpm -qp --configfiles "$rpm" 2>/dev/null | grep -qx /etc/preemptd/config.toml || fail "config.toml is not %config"
  echo "ok: $(basename "$rpm"), $(wc -l < "$work/rpmfiles") paths"
elif command -v rpmspec >/dev/null; then
  rpmspec -P packaging/rpm/preemptd.spec >/dev/null || fail "rpmspec cannot parse the spec"
  echo "ok: the spec parses (rpmbuild not available)"
else
  echo "skipped: neither rpmbuild nor rpmspec is available"
fi
echo "packaging checks passed"
