# megatron-ext on GPU clusters.
#
# What Megatron-LM core_v0.19.0's LTS CI image (docker/Dockerfile.ci.lts, base in
# docker/.ngc_version.lts) brings for the features the gpu-cluster recipes use: NVIDIA's PyTorch
# 25.09 image (CUDA, NCCL, cuDNN, torch, apex), Transformer Engine built from the commit that
# image builds, and Megatron's "ssm" extra for Mamba layers ('M' in hybrid patterns) at the
# versions of its uv.lock. Then megatron-core (the release megatron-ext is verified on),
# megatron-ext, its recipes and its tests.
#
#   docker build -t megatron-ext .
#   docker run --gpus all --rm megatron-ext                          # megatron-ext doctor
#   docker run --gpus all --rm megatron-ext make test-gpu            # the gpu-marked tests, one GPU
#   docker run --gpus all --rm megatron-ext megatron-ext run recipes/gpt_tp2_pp2.yaml --platform gpu-cluster
#   megatron-ext submit recipes/gpt_mhc_tp2_pp2_sp.yaml --slurm --container-image <registry>/megatron-ext:<tag>
#
# tests/unit_tests/test_dockerfile.py checks the pins against setup.py and requirements.txt and
# that every gpu-cluster recipe's layers have their modules declared in MEGATRON_EXT_GPU_MODULES.
ARG BASE_IMAGE=nvcr.io/nvidia/pytorch:25.09-py3
FROM ${BASE_IMAGE}

# The NGC images pin their own packages through a pip constraint file; Megatron's images unset it.
ENV PIP_CONSTRAINT="" \
    PYTHONUNBUFFERED=1 \
    CUDA_DEVICE_MAX_CONNECTIONS=1 \
    NVTE_CUDA_ARCHS="80;90;100"

# Transformer Engine as Megatron-LM core_v0.19.0's LTS image builds it (against this image's torch).
ARG TE_COMMIT=b9d690e042b1c4e455214e7dab65d6d3512c05d6
RUN pip install --no-cache-dir --no-build-isolation \
        "transformer-engine @ git+https://github.com/NVIDIA/TransformerEngine.git@${TE_COMMIT}"

# Mamba layers: megatron-core's "ssm" extra, at the versions of Megatron-LM core_v0.19.0's uv.lock.
ARG MAMBA_COMMIT=0048fbf2e7b2f214dcbe703ea3dec2b9647595e1
RUN pip install --no-cache-dir --no-build-isolation "causal-conv1d==1.6.2.post1" \
 && pip install --no-cache-dir --no-build-isolation \
        "mamba-ssm @ git+https://github.com/state-spaces/mamba.git@${MAMBA_COMMIT}"

WORKDIR /opt/megatron-ext
COPY setup.py pyproject.toml README.md requirements.txt Makefile ./
COPY megatron_ext ./megatron_ext
COPY recipes ./recipes
COPY patches ./patches
COPY tests ./tests
COPY scripts ./scripts
COPY bench ./bench

# Keep the image's torch, transformer-engine and apex (built for its CUDA); add megatron-core,
# megatron-ext's own small dependencies, then megatron-ext itself without re-resolving torch.
# Every module the GPU recipes' layers need must import, or the build fails here.
ENV MEGATRON_EXT_GPU_MODULES="transformer_engine.pytorch apex mamba_ssm causal_conv1d"
RUN pip install --no-cache-dir "megatron-core==0.19.2" psutil pyyaml pytest tensorboard \
 && pip install --no-cache-dir --no-deps . \
 && for module in megatron.core megatron_ext ${MEGATRON_EXT_GPU_MODULES}; do python -c "import ${module}"; done \
 && megatron-ext --version

CMD ["megatron-ext", "doctor"]
