#!/usr/bin/env bash
# Build the DaemonSet's image from packaging/kubernetes/Dockerfile (docs/kubernetes.md, "The image").
#
#   packaging/kubernetes/build-image.sh [TAG]     TAG (or IMAGE): default ghcr.io/preemptd/preemptd:<version>
#
# Two ways, chosen by PREEMPTD_BUILDER (auto, buildx or local; auto: buildx where docker buildx works and
# the registry answers for RUNTIME_BASE, else local):
#
# buildx  docker buildx build for PLATFORMS (linux/amd64,linux/arm64) on the registry's bases
#         (BUILDER_BASE, default debian:bookworm-slim; RUNTIME_BASE, default gcr.io/distroless/python3-debian12).
#         A multi-platform image cannot be loaded into docker's local store: PUSH=1 pushes TAG, otherwise it
#         is written as an OCI archive to OCI_ARCHIVE (default dist/preemptd-image-<version>.oci.tar).
# local   no registry needed, the host's architecture only: Debian's mmdebstrap makes both bases from the
#         mirror apt uses (bookworm: python3, ca-certificates; the builder's also python3-venv), podman
#         imports them as localhost/preemptd-base:<kind>-<digest>, and buildah builds with --pull=never
#         --isolation chroot --layers into the local containers storage (podman run TAG). The bases are
#         cached as tarballs in PREEMPTD_IMAGE_CACHE (default /var/tmp/preemptd-image for root, else
#         $XDG_CACHE_HOME/preemptd-image) and made again after PREEMPTD_BASE_MAX_AGE_DAYS (7) days, for
#         Debian's security updates. Needs mmdebstrap, buildah and podman (apt-get install mmdebstrap buildah
#         podman uidmap), and root or subordinate ids for the user.
#         Behind a TLS-intercepting proxy, pip in the builder needs the proxy's CA: the host's bundle
#         (PREEMPTD_BUILD_CA, default $PIP_CERT, else $SSL_CERT_FILE, else /etc/ssl/certs/ca-certificates.crt)
#         is mounted over the builder's /etc/ssl/certs/ca-certificates.crt, and the host's pip configuration
#         (PREEMPTD_BUILD_PIP_CONF, default $PIP_CONFIG_FILE, else /etc/pip.conf) at /etc/pip.conf, in the
#         builder's RUN steps only: neither is in any layer of the image. PREEMPTD_BUILD_CA=none and
#         PREEMPTD_BUILD_PIP_CONF=none mount nothing.
#
# The build context is staged in a temporary directory: pyproject.toml, README.md, agent/ (without
# __pycache__) and packaging/kubernetes/requirements.lock from the working tree. The labels say the version
# (agent/__init__.py), the commit (with -dirty when those files differ from it) and its time.
set -euo pipefail
cd "$(dirname "$0")/../.."
here=packaging/kubernetes

# Exit status 1: the build failed; 2: this machine cannot build (a tool missing, the mirror unreachable).
die() { echo "build-image.sh: $*" >&2; exit 1; }
cannot() { echo "build-image.sh: $*" >&2; exit 2; }
need() {
    local missing=() tool
    for tool in "$@"; do command -v "$tool" >/dev/null || missing+=("$tool"); done
    [ ${#missing[@]} -eq 0 ] || cannot "the $mode build needs ${missing[*]}, not found on PATH ($hint)"
}

version=$(sed -n 's/^__version__ = "\(.*\)"$/\1/p' agent/__init__.py)
[ -n "$version" ] || die "no __version__ in agent/__init__.py"
tag="${1:-${IMAGE:-ghcr.io/preemptd/preemptd:$version}}"
revision=unknown
created=$(date -u +%Y-%m-%dT%H:%M:%SZ)
if git rev-parse --verify -q HEAD >/dev/null 2>&1; then
    revision=$(git rev-parse HEAD)
    if [ -n "$(git status --porcelain -- pyproject.toml README.md agent "$here/requirements.lock" "$here/Dockerfile")" ]; then
        revision="$revision-dirty"
    else
        created=$(TZ=UTC0 git log -1 --format=%cd --date=format-local:%Y-%m-%dT%H:%M:%SZ)
    fi
fi

context=$(mktemp -d "${TMPDIR:-/tmp}/preemptd-image.XXXXXX")
trap 'rm -rf "$context"' EXIT
tar -c --exclude=__pycache__ --exclude='*.pyc' pyproject.toml README.md agent "$here/requirements.lock" \
    | tar -x -C "$context"
cp "$here/Dockerfile" "$context/Dockerfile"
build_args=(--build-arg "VERSION=$version"
    --label "org.opencontainers.image.revision=$revision" --label "org.opencontainers.image.created=$created")

mode="${PREEMPTD_BUILDER:-auto}"
BUILDER_BASE="${BUILDER_BASE:-docker.io/library/debian:bookworm-slim}"
RUNTIME_BASE="${RUNTIME_BASE:-gcr.io/distroless/python3-debian12:latest}"
if [ "$mode" = auto ]; then
    mode=local
    if command -v docker >/dev/null && docker buildx version >/dev/null 2>&1 \
        && timeout 30 docker buildx imagetools inspect "$RUNTIME_BASE" >/dev/null 2>&1; then
        mode=buildx
    fi
    echo "build-image.sh: building with $mode (PREEMPTD_BUILDER=buildx or local chooses)" >&2
fi

case "$mode" in
buildx)
    hint="docker with the buildx plug-in, and a registry for the bases"
    need docker
    docker buildx version >/dev/null 2>&1 || cannot "docker buildx does not work here ($hint)"
    platforms="${PLATFORMS:-linux/amd64,linux/arm64}"
    if [ "${PUSH:-0}" = 1 ]; then
        output=(--push)
    else
        archive="${OCI_ARCHIVE:-dist/preemptd-image-$version.oci.tar}"
        mkdir -p "$(dirname "$archive")"
        output=(--output "type=oci,dest=$archive")
    fi
    docker buildx build --platform "$platforms" "${build_args[@]}" \
        --build-arg "BUILDER_BASE=$BUILDER_BASE" --build-arg "RUNTIME_BASE=$RUNTIME_BASE" \
        --label "org.opencontainers.image.base.name=$RUNTIME_BASE" -t "$tag" "${output[@]}" "$context"
    ;;
local)
    hint="apt-get install mmdebstrap buildah podman uidmap"
    need mmdebstrap buildah podman tar sha256sum
    suite=bookworm
    arch=$(dpkg --print-architecture 2>/dev/null || uname -m)
    if [ "$(id -u)" = 0 ]; then default_cache=/var/tmp/preemptd-image; else default_cache="${XDG_CACHE_HOME:-$HOME/.cache}/preemptd-image"; fi
    cache="${PREEMPTD_IMAGE_CACHE:-$default_cache}"
    mkdir -p "$cache"
    builder_tar="$cache/$suite-$arch-builder.tar" runtime_tar="$cache/$suite-$arch-runtime.tar"
    max_age="${PREEMPTD_BASE_MAX_AGE_DAYS:-7}"
    if [ ! -s "$builder_tar" ] || [ ! -s "$runtime_tar" ] \
        || [ -n "$(find "$runtime_tar" -mtime "+$max_age" 2>/dev/null)" ]; then
        echo "build-image.sh: making the $suite bases with mmdebstrap into $cache" >&2
        # One bootstrap for both: the builder's tree is packed before the runtime's loses python3-venv and the
        # wheels of pip and setuptools. Documentation, manual pages and translations are left out.
        rm -rf "$builder_tar.part" "$runtime_tar.part"
        mmdebstrap --format=tar --variant=essential --include=python3,python3-venv,ca-certificates \
            --dpkgopt='path-exclude=/usr/share/doc/*' --dpkgopt='path-include=/usr/share/doc/*/copyright' \
            --dpkgopt='path-exclude=/usr/share/man/*' --dpkgopt='path-exclude=/usr/share/info/*' \
            --dpkgopt='path-exclude=/usr/share/locale/*' \
            --customize-hook="tar --one-file-system --numeric-owner --exclude=./var/cache/apt/archives/*.deb --exclude=./var/lib/apt/lists/* -C \"\$1\" -cf '$builder_tar.part' ." \
            --customize-hook='chroot "$1" dpkg --purge python3-venv python3.11-venv python3-pip-whl python3-setuptools-whl' \
            "$suite" "$runtime_tar.part" \
            || cannot "mmdebstrap could not make the $suite bases (it needs the Debian mirror that apt uses)"
        mv "$builder_tar.part" "$builder_tar"
        mv "$runtime_tar.part" "$runtime_tar"
    fi
    base_image() {  # the tarball imported once, named by its digest
        local kind=$1 tarball=$2 name
        name="localhost/preemptd-base:$kind-$(sha256sum "$tarball" | cut -c1-12)"
        if ! podman image exists "$name"; then
            podman import --quiet "$tarball" "$name" >/dev/null || die "podman could not import $tarball"
        fi
        # Older imports of this kind (a refreshed cache) go, unless a container still uses them.
        podman images --format '{{.Repository}}:{{.Tag}}' localhost/preemptd-base \
            | grep "^localhost/preemptd-base:$kind-" | grep -vx "$name" \
            | xargs -r podman rmi >/dev/null 2>&1 || true
        echo "$name"
    }
    builder_base=$(base_image builder "$builder_tar")
    runtime_base=$(base_image runtime "$runtime_tar")
    volumes=()
    ca="${PREEMPTD_BUILD_CA:-${PIP_CERT:-${SSL_CERT_FILE:-/etc/ssl/certs/ca-certificates.crt}}}"
    if [ "$ca" != none ] && [ -f "$ca" ]; then
        volumes+=(--volume "$(readlink -f "$ca"):/etc/ssl/certs/ca-certificates.crt:ro")
    fi
    pipconf="${PREEMPTD_BUILD_PIP_CONF:-${PIP_CONFIG_FILE:-/etc/pip.conf}}"
    if [ "$pipconf" != none ] && [ -f "$pipconf" ]; then
        volumes+=(--volume "$(readlink -f "$pipconf"):/etc/pip.conf:ro")
    fi
    previous=$(podman image inspect --format '{{.Id}}' "$tag" 2>/dev/null || true)
    buildah bud --pull=never --isolation chroot --layers "${volumes[@]}" "${build_args[@]}" \
        --build-arg "BUILDER_BASE=$builder_base" --build-arg "RUNTIME_BASE=$runtime_base" \
        --label "org.opencontainers.image.base.name=$runtime_base" -f "$context/Dockerfile" -t "$tag" "$context" \
        || die "buildah could not build $tag (its output is above)"
    # The image this tag named before, when nothing else names it now (its labels differ: a new commit).
    if [ -n "$previous" ] && [ "$previous" != "$(podman image inspect --format '{{.Id}}' "$tag")" ] \
        && [ -z "$(podman image inspect --format '{{join .RepoTags " "}}' "$previous" 2>/dev/null)" ]; then
        podman rmi "$previous" >/dev/null 2>&1 || true
    fi
    echo "build-image.sh: built $tag (podman image inspect $tag)" >&2
    ;;
*)
    cannot "PREEMPTD_BUILDER is '$mode': auto, buildx or local"
    ;;
esac
