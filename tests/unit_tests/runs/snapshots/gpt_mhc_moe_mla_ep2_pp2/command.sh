#!/usr/bin/env bash
# megatron-ext torchrun run of recipes/gpt_mhc_moe_mla_ep2_pp2.yaml (platform cpu)
# gpt, 4x64, tp1 pp2 ep2 dp2, mHC n=4, 4 ranks on cpu, 8 iterations (ckpt-resume)
# Each rank runs `python -m ENTRY FLAGS` with torchrun's environment; this is the same.
set -euo pipefail
cd <REPO>
export CUDA_VISIBLE_DEVICES='' OMP_NUM_THREADS=1
# train
<PYTHON> -m torch.distributed.run --standalone --nproc_per_node 4 -m megatron_ext.pretrain_gpt \
    --tensor-model-parallel-size 1 \
    --pipeline-model-parallel-size 2 \
    --expert-model-parallel-size 2 \
    --num-layers 4 \
    --hidden-size 64 \
    --num-attention-heads 4 \
    --seq-length 32 \
    --max-position-embeddings 32 \
    --position-embedding-type rope \
    --normalization RMSNorm \
    --hidden-dropout 0.1 \
    --attention-dropout 0.1 \
    --num-experts 4 \
    --moe-router-topk 2 \
    --enable-mhc-connections \
    --mhc-num-residual-streams 4 \
    --mhc-sinkhorn-iterations 20 \
    --mhc-init-gating-factor 0.01 \
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
    --multi-latent-attention \
    --q-lora-rank 32 \
    --kv-lora-rank 32 \
    --qk-head-dim 16 \
    --qk-pos-emb-head-dim 8 \
    --v-head-dim 16 \
    --moe-layer-freq '[0,1,1,1]' \
    --moe-ffn-hidden-size 64 \
    --moe-shared-expert-intermediate-size 64 \
    --moe-aux-loss-coeff 0.01 \
    --moe-token-dispatcher-type alltoall \
    --disable-bias-linear \
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
    --tensor-model-parallel-size 1 \
    --pipeline-model-parallel-size 2 \
    --expert-model-parallel-size 2 \
    --num-layers 4 \
    --hidden-size 64 \
    --num-attention-heads 4 \
    --seq-length 32 \
    --max-position-embeddings 32 \
    --position-embedding-type rope \
    --normalization RMSNorm \
    --hidden-dropout 0.1 \
    --attention-dropout 0.1 \
    --num-experts 4 \
    --moe-router-topk 2 \
    --enable-mhc-connections \
    --mhc-num-residual-streams 4 \
    --mhc-sinkhorn-iterations 20 \
    --mhc-init-gating-factor 0.01 \
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
    --multi-latent-attention \
    --q-lora-rank 32 \
    --kv-lora-rank 32 \
    --qk-head-dim 16 \
    --qk-pos-emb-head-dim 8 \
    --v-head-dim 16 \
    --moe-layer-freq '[0,1,1,1]' \
    --moe-ffn-hidden-size 64 \
    --moe-shared-expert-intermediate-size 64 \
    --moe-aux-loss-coeff 0.01 \
    --moe-token-dispatcher-type alltoall \
    --disable-bias-linear \
    --tensorboard-dir <RUN_DIR>/tensorboard/resume \
    --log-timers-to-tensorboard \
    --log-throughput \
    --load <RUN_DIR>/checkpoints \
    --ckpt-format torch_dist
