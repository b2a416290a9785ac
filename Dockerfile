# glm53 serving image: Ray's official GPU image of the pinned Ray version plus this package.
#
#   docker build -t glm53:0.1.0-ray2.60.0 .
#
# The tag is <package version>-ray<Ray version>; k8s/ references exactly this tag (the
# kustomization's `images:` entry renames it to your registry), and every manifest's rayVersion
# equals the Ray version below. scripts/validate_k8s.py checks all three against pyproject.toml.
# Not built in CI (no container engine there); keep it boring.

# Ray 2.60.0 must equal the `ray[serve]==2.60.0` pin in pyproject.toml, so pip keeps the image's
# Ray. py312 + CUDA ("-gpu"): the image ships the CUDA runtime that torch's wheels expect.
FROM rayproject/ray:2.60.0-py312-gpu

LABEL org.opencontainers.image.title="glm53" \
      org.opencontainers.image.version="0.1.0-ray2.60.0" \
      org.opencontainers.image.description="GLM-5.3-Flash on Ray Serve, one engine per GPU pair"

# The base image runs as the non-root user `ray` (uid 1000, group `users`/100) with its Python in
# /home/ray/anaconda3, which that user owns, so pip needs no root. Say so explicitly anyway:
# the pods set runAsNonRoot/runAsUser 1000 and would refuse a root image.
USER 1000:100
WORKDIR /home/ray

# Only what the wheel needs (see .dockerignore): no tests, benchmarks, venv or caches.
COPY --chown=1000:100 pyproject.toml README.md /home/ray/glm53/
COPY --chown=1000:100 kernels /home/ray/glm53/kernels
COPY --chown=1000:100 actors /home/ray/glm53/actors
COPY --chown=1000:100 raycluster /home/ray/glm53/raycluster
COPY --chown=1000:100 deployments /home/ray/glm53/deployments

# A regular (non-editable) install into the image's Python, with the `gpu` extra (fla-core for
# long KDA prefill). torch resolves to PyPI's CUDA build, which brings its matching Triton; the
# `triton` extra (an exact pin for CPU interpreter tests) is deliberately not installed, so it
# cannot fight torch's own requirement.
RUN pip install --no-cache-dir "/home/ray/glm53[gpu]" \
    && rm -rf /home/ray/glm53 \
    && python -c "import ray, glm53.deployments.app; assert ray.__version__ == '2.60.0', ray.__version__"

# Model checkpoints are not baked in: pods mount them read-only (k8s/ray-service.*.yaml).
# KubeRay supplies the command (`ray start ...`); the base image's default entrypoint stays.
