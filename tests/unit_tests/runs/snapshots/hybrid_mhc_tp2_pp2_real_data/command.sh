#!/usr/bin/env bash
# megatron-ext torchrun run of recipes/hybrid_mhc_tp2_pp2_real_data.yaml (platform cpu)
# hybrid, pattern '*-*-|*-*-', tp2 pp2 dp1, mHC n=4, 4 ranks on cpu, 8 iterations (regular)
# Each rank runs `python -m ENTRY FLAGS` with torchrun's environment; this is the same.
set -euo pipefail
cd <REPO>
export CUDA_VISIBLE_DEVICES='' OMP_NUM_THREADS=1
# train
<PYTHON> -m torch.distributed.run --standalone --nproc_per_node 4 -m megatron_ext.pretrain_hybrid \
    --tensor-model-parallel-size 2 \
    --pipeline-model-parallel-size 2 \
    --hybrid-layer-pattern '*-*-|*-*-' \
    --hidden-size 64 \
    --num-attention-heads 4 \
    --seq-length 32 \
    --max-position-embeddings 32 \
    --position-embedding-type rope \
    --normalization RMSNorm \
    --hidden-dropout 0.1 \
    --attention-dropout 0.1 \
    --enable-mhc-connections \
    --mhc-num-residual-streams 4 \
    --mhc-sinkhorn-iterations 20 \
    --mhc-init-gating-factor 0.01 \
    --train-iters 8 \
    --micro-batch-size 2 \
    --global-batch-size 8 \
    --lr 0.003 \
    --min-lr 0.0 \
    --lr-decay-style constant \
    --lr-warmup-iters 0 \
    --lr-decay-iters 8 \
    --weight-decay 0.01 \
    --clip-grad 1.0 \
    --seed 1234 \
    --eval-interval 2 \
    --eval-iters 1 \
    --data-path 0.7 /nonexistent/megatron-ext-example-data/data/sentencepiece/stdlib_a_m_text_document 0.3 /nonexistent/megatron-ext-example-data/data/sentencepiece/stdlib_n_z_text_document \
    --split 98,1,1 \
    --data-cache-path <RUN_DIR>/data_cache \
    --tokenizer-type SentencePieceTokenizer \
    --tokenizer-model /nonexistent/megatron-ext-example-data/tokenizers/sentencepiece/tokenizer.model \
    --log-interval 1 \
    --log-num-zeros-in-grad \
    --distributed-backend gloo \
    --tensorboard-dir <RUN_DIR>/tensorboard \
    --log-timers-to-tensorboard \
    --log-throughput \
    --save <RUN_DIR>/checkpoints \
    --save-interval 8 \
    --ckpt-format torch_dist \
    --exit-signal-handler \
    --exit-signal SIGUSR1
