# megatron-ext on a GPU cluster: NVIDIA's PyTorch image brings CUDA, transformer-engine and apex.
# The recipes issue will add the training entry points and Slurm use of this image.
FROM nvcr.io/nvidia/pytorch:25.09-py3

WORKDIR /opt/megatron-ext
COPY setup.py README.md requirements.txt ./
COPY megatron_ext ./megatron_ext
# Keep the image's torch (CUDA build matched to the image); add megatron-core and the rest.
RUN pip install --no-cache-dir "megatron-core==0.19.2" psutil pyyaml pytest \
 && pip install --no-cache-dir --no-deps -e .

CMD ["megatron-ext", "doctor"]
