# syntax=docker/dockerfile:1
# One image for every gpudra component: `gpudra node` (runs as root, set by the chart's
# DaemonSet, for the host's kubelet and CDI directories) and `gpudra webhook` (non-root,
# the image's default user).
#
# `make image` builds the same layout without a Docker engine (e2e/image/build.py):
# Debian bookworm with its python3, and a virtual environment in /opt/gpudra.
ARG DEBIAN_SUITE=bookworm

# --- build: the wheel and its dependencies in a virtual environment ------------------------
FROM debian:${DEBIAN_SUITE}-slim AS build
RUN apt-get update \
 && apt-get install -y --no-install-recommends python3 python3-venv ca-certificates \
 && rm -rf /var/lib/apt/lists/*
WORKDIR /src
COPY pyproject.toml README.md ./
COPY api api
COPY cli cli
COPY common common
COPY driver driver
COPY webhook webhook
RUN python3 -m venv /opt/gpudra \
 && /opt/gpudra/bin/pip install --no-cache-dir --no-compile . \
 && /opt/gpudra/bin/pip uninstall -y pip \
 && find /opt/gpudra -name __pycache__ -prune -exec rm -rf {} + \
 && python3 -m compileall -q --invalidation-mode unchecked-hash /opt/gpudra

# --- runtime: Debian's python3 and the environment, nothing else ---------------------------
FROM debian:${DEBIAN_SUITE}-slim
RUN apt-get update \
 && apt-get install -y --no-install-recommends python3 tini \
 && rm -rf /var/lib/apt/lists/* /var/cache/apt/* /var/log/apt /var/log/dpkg.log
COPY --from=build /opt/gpudra /opt/gpudra
ENV PATH=/opt/gpudra/bin:/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin \
    PYTHONUNBUFFERED=1 \
    PYTHONDONTWRITEBYTECODE=1
USER 65532:65532
# tini reaps what the agent's children leave behind (MPS control daemons daemonize).
ENTRYPOINT ["tini", "--", "gpudra"]
CMD ["--help"]
