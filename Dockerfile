# memtrain on a CUDA PyTorch base, with the DeepSpeed, FP8 (torchao), bitsandbytes, LoRA (peft) and TensorBoard extras.
# Not built in development (no Docker engine there); build with:  docker build -t memtrain .
FROM pytorch/pytorch:2.6.0-cuda12.4-cudnn9-devel

ENV PIP_DISABLE_PIP_VERSION_CHECK=1 \
    TORCH_EXTENSIONS_DIR=/cache/torch_extensions \
    PYTHONUNBUFFERED=1
WORKDIR /opt/memtrain
COPY pyproject.toml README.md ./
COPY src ./src
COPY recipes ./recipes
COPY configs ./configs
COPY data ./data
COPY scripts ./scripts
# The base image's torch satisfies memtrain's range, so pip keeps it; deepspeed builds against it.
RUN pip install --no-build-isolation ".[deepspeed,fp8,bnb,lora,tensorboard]"
ENTRYPOINT ["memtrain"]
CMD ["--help"]
