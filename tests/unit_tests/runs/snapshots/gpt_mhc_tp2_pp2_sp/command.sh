#!/usr/bin/env bash
# megatron-ext torchrun run of recipes/gpt_mhc_tp2_pp2_sp.yaml (platform cpu)
# gpt, 4x64, tp2 pp2 dp1 sp, mHC n=4 +recompute, 4 ranks on cpu, 8 iterations (ckpt-resume)
# Each rank runs `python -m ENTRY FLAGS` with torchrun's environment; this is the same.
set -euo pipefail
cd <REPO>
export CUDA_VISIBLE_DEVICES='' OMP_NUM_THREADS=1
# train
<PYTHON> -m torch.distributed.run --standalone --nproc_per_node 4 -m megatron_ext.pretrain_gpt \
    --tensor-model-parallel-size 2 \
    --pipeline-model-parallel-size 2 \
    --sequence-parallel \
    --num-layers 4 \
    --hidden-size 64 \
    --num-attention-heads 4 \
    --seq-length 32 \
    --max-position-embeddings 32 \
    --position-embedding-type learned_absolute \
    --normalization LayerNorm \
    --hidden-dropout 0.1 \
    --attention-dropout 0.1 \
    --enable-mhc-connections \
    --mhc-num-residual-streams 4 \
    --mhc-sinkhorn-iterations 20 \
    --mhc-init-gating-factor 0.01 \
    --log-mhc-stats \
    --recompute-granularity selective \
    --recompute-modules mhc \
    --mhc-recompute-layer-num 1 \
    --train-iters 8 \
    --micro-batch-size 2 \
    --global-batch-size 8 \
    --lr 0.001 \
    --min-lr 0.0 \
    --lr-decay-style constant \
    --lr-warmup-iters 0 \
    --lr-decay-iters 8 \
    --weight-decay 0.01 \
    --clip-grad 1.0 \
    --seed 1234 \
    --eval-iters 0 \
    --mock-data \
    --tokenizer-type NullTokenizer \
    --vocab-size 128 \
    --log-interval 1 \
    --log-num-zeros-in-grad \
    --distributed-backend gloo \
    --tensorboard-dir <RUN_DIR>/tensorboard \
    --log-timers-to-tensorboard \
    --log-throughput \
    --save <RUN_DIR>/checkpoints \
    --save-interval 4 \
    --ckpt-format torch_dist \
    --exit-interval 8
rm -rf <RUN_DIR>/checkpoints/iter_0000008 && echo 4 > <RUN_DIR>/checkpoints/latest_checkpointed_iteration.txt
# resume
<PYTHON> -m torch.distributed.run --standalone --nproc_per_node 4 -m megatron_ext.pretrain_gpt \
    --tensor-model-parallel-size 2 \
    --pipeline-model-parallel-size 2 \
    --sequence-parallel \
    --num-layers 4 \
    --hidden-size 64 \
    --num-attention-heads 4 \
    --seq-length 32 \
    --max-position-embeddings 32 \
    --position-embedding-type learned_absolute \
    --normalization LayerNorm \
    --hidden-dropout 0.1 \
    --attention-dropout 0.1 \
    --enable-mhc-connections \
    --mhc-num-residual-streams 4 \
    --mhc-sinkhorn-iterations 20 \
    --mhc-init-gating-factor 0.01 \
    --log-mhc-stats \
    --recompute-granularity selective \
    --recompute-modules mhc \
    --mhc-recompute-layer-num 1 \
    --train-iters 8 \
    --micro-batch-size 2 \
    --global-batch-size 8 \
    --lr 0.001 \
    --min-lr 0.0 \
    --lr-decay-style constant \
    --lr-warmup-iters 0 \
    --lr-decay-iters 8 \
    --weight-decay 0.01 \
    --clip-grad 1.0 \
    --seed 1234 \
    --eval-iters 0 \
    --mock-data \
    --tokenizer-type NullTokenizer \
    --vocab-size 128 \
    --log-interval 1 \
    --log-num-zeros-in-grad \
    --distributed-backend gloo \
    --tensorboard-dir <RUN_DIR>/tensorboard/resume \
    --log-timers-to-tensorboard \
    --log-throughput \
    --load <RUN_DIR>/checkpoints \
    --ckpt-format torch_dist
