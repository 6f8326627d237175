#!/usr/bin/env bash
# Build the RPM from this checkout: make the source tarball, then rpmbuild -bb packaging/rpm/preemptd.spec.
# Usage: packaging/rpm/build.sh [TOPDIR]      (default: dist/rpm; the package lands in TOPDIR/RPMS/<arch>/)
# On a non-RPM host (the Debian CI machine) the build dependencies cannot be checked against an RPM database:
# it passes --nodeps and uses this machine's python3 (PYTHON overrides) in place of python3.11.
set -euo pipefail
here=$(cd "$(dirname "$0")" && pwd)
repo=$(cd "$here/../.." && pwd)
top=$(mkdir -p "${1:-$repo/dist/rpm}" && cd "${1:-$repo/dist/rpm}" && pwd)
version=$(sed -n 's/^__version__ = "\(.*\)"$/\1/p' "$repo/agent/__init__.py")
python=${PYTHON:-$( [ -x /usr/bin/python3.11 ] && echo /usr/bin/python3.11 || readlink -f /usr/bin/python3)}
mkdir -p "$top"/{SOURCES,SPECS,BUILD,RPMS,SRPMS}
src=$(mktemp -d)
trap 'rm -rf "$src"' EXIT
mkdir -p "$src/preemptd-$version/packaging" "$src/preemptd-$version/docs"
cp -r "$repo/pyproject.toml" "$repo/README.md" "$repo/agent" "$repo/systemd" "$src/preemptd-$version/"
cp "$repo/packaging/config.toml" "$src/preemptd-$version/packaging/"
cp "$repo/docs/operator-guide.md" "$repo/docs/kubernetes.md" "$src/preemptd-$version/docs/"
find "$src" -name __pycache__ -prune -exec rm -rf {} +
tar -C "$src" -czf "$top/SOURCES/preemptd-$version.tar.gz" "preemptd-$version"
nodeps=()
rpm -q rpm >/dev/null 2>&1 || nodeps=(--nodeps)
rpmbuild -bb "${nodeps[@]}" --define "_topdir $top" --define "pkg_version $version" \
  --define "python3_bin $python" "$here/preemptd.spec"
