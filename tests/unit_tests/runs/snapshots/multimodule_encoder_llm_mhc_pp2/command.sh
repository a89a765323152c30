#!/usr/bin/env bash
# megatron-ext torchrun run of recipes/multimodule_encoder_llm_mhc_pp2.yaml (platform cpu)
# multimodule, 4 ranks on cpu, 10 iterations (regular)
# Each rank runs `python -m ENTRY FLAGS` with torchrun's environment; this is the same.
set -euo pipefail
cd <REPO>
export CUDA_VISIBLE_DEVICES='' OMP_NUM_THREADS=1
# train
<PYTHON> -m torch.distributed.run --standalone --nproc_per_node 4 -m megatron_ext.pretrain_multimodule \
    --recipe <RUN_DIR>/recipe.yaml \
    --train-iters 10 \
    --micro-batch-size 2 \
    --global-batch-size 8 \
    --lr 0.003 \
    --min-lr 0.0 \
    --lr-decay-style constant \
    --lr-warmup-iters 0 \
    --lr-decay-iters 10 \
    --weight-decay 0.01 \
    --clip-grad 1.0 \
    --seed 1234 \
    --eval-iters 0 \
    --mock-data \
    --tokenizer-type NullTokenizer \
    --vocab-size 128 \
    --log-interval 1 \
    --distributed-backend gloo \
    --tensorboard-dir <RUN_DIR>/tensorboard \
    --log-timers-to-tensorboard \
    --log-throughput
