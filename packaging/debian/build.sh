#!/usr/bin/env bash
# Build dist/preemptd_<version>-1_<arch>.deb: the agent in its own virtual environment under /opt/preemptd
# (Debian's python3 plus the project's wheel and its dependencies from PyPI), /usr/bin/preemptd, the systemd
# units, sysusers and tmpfiles snippets from systemd/, and /etc/preemptd/config.toml as a conffile.
#
# The virtual environment is built in a staging root at <stage>/opt/preemptd and then made to live at
# /opt/preemptd: its interpreter links point at the system's /usr/bin/python3.X (absolute), and the only
# files that record the staging path (script shebangs, activate scripts, pip's direct_url.json) are rewritten
# or dropped (pyvenv.cfg's informational 'command' line too); the build fails if any staging path is left. No .pyc files are shipped: postinst compiles them
# and prerm removes them.
#
# Usage: packaging/debian/build.sh [OUTPUT_DIR]     (default: dist/)
# Environment: PYTHON (default: the interpreter /usr/bin/python3 points to), PIP_* as usual,
#              DEB_REVISION (default 1), DEB_MAINTAINER.
set -euo pipefail
umask 022
here=$(cd "$(dirname "$0")" && pwd)
repo=$(cd "$here/../.." && pwd)
out=$(mkdir -p "${1:-$repo/dist}" && cd "${1:-$repo/dist}" && pwd)
python=${PYTHON:-$(readlink -f /usr/bin/python3)}
prefix=/opt/preemptd
revision=${DEB_REVISION:-1}
maintainer=${DEB_MAINTAINER:-preemptd developers <preemptd@users.noreply.github.com>}

version=$(sed -n 's/^__version__ = "\(.*\)"$/\1/p' "$repo/agent/__init__.py")
[ -n "$version" ] || { echo "build.sh: no __version__ in agent/__init__.py" >&2; exit 1; }
arch=$(dpkg --print-architecture)
pyver=$("$python" -c 'import sys; print("%d.%d" % sys.version_info[:2])')
for unit in preemptd.service preemptd.socket preemptd.sysusers preemptd.tmpfiles; do
  [ -f "$repo/systemd/$unit" ] || { echo "build.sh: systemd/$unit is missing" >&2; exit 1; }
done

work=$(mktemp -d /tmp/preemptd-build.XXXXXX)
trap 'rm -rf "$work"' EXIT
stage=$work/root
mkdir -p "$stage"

echo "== wheel (preemptd $version)"
mkdir -p "$work/src"
cp -r "$repo/pyproject.toml" "$repo/README.md" "$repo/agent" "$work/src/"
find "$work/src" -name __pycache__ -prune -exec rm -rf {} +
"$python" -m pip wheel -q --no-deps -w "$work/wheels" "$work/src"

echo "== virtual environment at $prefix ($python, Python $pyver)"
"$python" -m venv --without-pip "$stage$prefix"
"$python" -m pip --python "$stage$prefix/bin/python" install -q --no-compile "$work"/wheels/preemptd-*.whl
# Relocate from the staging root to /opt/preemptd.
for f in "$stage$prefix"/bin/* "$stage$prefix/pyvenv.cfg"; do
  if [ -f "$f" ] && [ ! -L "$f" ] && grep -qI "$stage" "$f"; then
    sed -i "s|$stage$prefix|$prefix|g" "$f"
  fi
done
rm -f "$stage$prefix"/bin/Activate.ps1 "$stage$prefix"/lib/python*/site-packages/*.dist-info/direct_url.json
find "$stage$prefix" -name __pycache__ -prune -exec rm -rf {} +
rmdir "$stage$prefix"/include/python* "$stage$prefix/include" 2>/dev/null || true
# Wheels ship their extension modules with symbols; Debian wants them stripped (lintian's
# unstripped-binary-or-object is an error). pip never re-checks RECORD hashes at run time.
find "$stage$prefix" -name '*.so' -type f -exec strip --strip-unneeded --remove-section=.comment --remove-section=.note {} +
if grep -rlI "$work" "$stage$prefix" >&2; then
  echo "build.sh: the files above still name the staging directory" >&2
  exit 1
fi
# RECORD files list installed files with hashes; pip never reads them back to run anything, and the
# shebang rewrite above changed some: drop the stale hashes so `pip check` and uninstall stay coherent.
sed -i -E 's|^(\.\./\.\./\.\./bin/[^,]+),[^,]*,[^,]*$|\1,,|' "$stage$prefix"/lib/python*/site-packages/*.dist-info/RECORD
"$stage$prefix/bin/python" -c 'import agent.service.daemon, agent.actions' # imports resolve in the staged venv

echo "== files"
install -d "$stage/usr/bin" "$stage/lib/systemd/system" "$stage/usr/lib/sysusers.d" "$stage/usr/lib/tmpfiles.d" \
  "$stage/etc/preemptd" "$stage/usr/share/doc/preemptd" "$stage/usr/share/lintian/overrides"
ln -s "$prefix/bin/preemptd" "$stage/usr/bin/preemptd"
install -m 0644 "$repo/systemd/preemptd.service" "$repo/systemd/preemptd.socket" "$stage/lib/systemd/system/"
install -m 0644 "$repo/systemd/preemptd.sysusers" "$stage/usr/lib/sysusers.d/preemptd.conf"
install -m 0644 "$repo/systemd/preemptd.tmpfiles" "$stage/usr/lib/tmpfiles.d/preemptd.conf"
install -m 0644 "$repo/packaging/config.toml" "$stage/etc/preemptd/config.toml"
install -m 0644 "$here/copyright" "$stage/usr/share/doc/preemptd/copyright"
install -m 0644 "$here/lintian-overrides" "$stage/usr/share/lintian/overrides/preemptd"
for doc in README.md docs/operator-guide.md docs/kubernetes.md; do
  [ -f "$repo/$doc" ] && install -m 0644 "$repo/$doc" "$stage/usr/share/doc/preemptd/"
done
date=$(date -R -d "@${SOURCE_DATE_EPOCH:-$(git -C "$repo" log -1 --format=%ct 2>/dev/null || date +%s)}")
printf 'preemptd (%s-%s) unstable; urgency=medium\n\n  * Release %s; see /usr/share/doc/preemptd/README.md.\n\n -- %s  %s\n' \
  "$version" "$revision" "$version" "$maintainer" "$date" | gzip -9n > "$stage/usr/share/doc/preemptd/changelog.Debian.gz"
chmod -R u=rwX,go=rX "$stage"

echo "== control"
install -d "$stage/DEBIAN"
install -m 0755 "$here/postinst" "$here/prerm" "$here/postrm" "$stage/DEBIAN/"
echo /etc/preemptd/config.toml > "$stage/DEBIAN/conffiles"
size=$(du -sk --exclude=DEBIAN "$stage" | cut -f1)
cat > "$stage/DEBIAN/control" <<CONTROL
Package: preemptd
Version: $version-$revision
Architecture: $arch
Maintainer: $maintainer
Installed-Size: $size
Depends: python$pyver, libc6 (>= 2.28), adduser, procps
Recommends: systemd
Section: admin
Priority: optional
Homepage: https://github.com/preemptd/preemptd
Description: node agent that warns GPU training jobs before their host goes away
 preemptd runs on every GPU training host. It learns as early as possible that
 the host is about to go away or break (a spot or preemptible termination
 notice, a scheduled maintenance, a fatal GPU fault) and tells the training
 processes at once over a local Unix socket, with the deadline, so they can
 save a checkpoint in time. It can also signal programs that never connect,
 run hooks, call webhooks and acknowledge the event to the cloud.
 .
 The agent and its Python dependencies live in a private virtual environment
 under /opt/preemptd.
CONTROL
(cd "$stage" && find . -path ./DEBIAN -prune -o -type f -print0 | sort -z | xargs -0 md5sum | sed 's|  \./|  |' > DEBIAN/md5sums)
chmod 0644 "$stage/DEBIAN/control" "$stage/DEBIAN/conffiles" "$stage/DEBIAN/md5sums"

deb="$out/preemptd_${version}-${revision}_${arch}.deb"
dpkg-deb --root-owner-group -Zxz --build "$stage" "$deb" >/dev/null
echo "$deb"
