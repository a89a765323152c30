# megatron-ext on GPU clusters.
#
# NVIDIA's PyTorch image brings CUDA, NCCL, cuDNN, transformer-engine and apex, matched to its
# torch build; this image adds megatron-core (pinned to the release megatron-ext is verified
# on) and megatron-ext with its recipes. Build and use:
#
#   docker build -t megatron-ext .
#   docker run --gpus all --rm megatron-ext                                  # megatron-ext doctor
#   docker run --gpus all --rm megatron-ext megatron-ext run recipes/gpt_tp2_pp2.yaml --platform gpu-cluster
#   megatron-ext submit recipes/gpt_mhc_tp2_pp2_sp.yaml --slurm --container-image <registry>/megatron-ext:<tag>
#
# The base image and the megatron-core pin are checked by tests/unit_tests/test_dockerfile.py
# (the pin must equal setup.py's and requirements.txt's).
ARG BASE_IMAGE=nvcr.io/nvidia/pytorch:25.09-py3
FROM ${BASE_IMAGE}

# The NGC images pin their own packages through a pip constraint file; megatron-core's
# install instructions unset it.
ENV PIP_CONSTRAINT="" \
    PYTHONUNBUFFERED=1 \
    CUDA_DEVICE_MAX_CONNECTIONS=1

WORKDIR /opt/megatron-ext
COPY setup.py README.md requirements.txt ./
COPY megatron_ext ./megatron_ext
COPY recipes ./recipes
COPY patches ./patches

# Keep the image's torch, transformer-engine and apex (built for its CUDA); add megatron-core,
# megatron-ext's own small dependencies, then megatron-ext itself without re-resolving torch.
RUN pip install --no-cache-dir "megatron-core==0.19.2" psutil pyyaml \
 && pip install --no-cache-dir --no-deps . \
 && python -c "import megatron.core, megatron_ext, transformer_engine.pytorch" \
 && megatron-ext --version

CMD ["megatron-ext", "doctor"]
