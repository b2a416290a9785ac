# Source on a bare GPU machine (the device image: torch + triton, no glm53 install) from the
# repo root:  . scripts/gpu_env.sh
# Installs any wheels carried in .whl/ (scripts/gpu_wheels.sh fetches them) into /tmp/site and
# makes the four folders importable as glm53.* without an install (symlinks under /tmp/pkg).
set -e
if compgen -G ".whl/*.whl" >/dev/null; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
    --target /tmp/site .whl/*.whl
fi
mkdir -p /tmp/pkg/glm53
for d in kernels actors raycluster deployments; do ln -sfn "$PWD/$d" "/tmp/pkg/glm53/$d"; done
export PYTHONPATH="/tmp/pkg:/tmp/site${PYTHONPATH:+:$PYTHONPATH}"
export NCCL_NVLS_ENABLE=0 PYTHONUNBUFFERED=1
set +e
