"""What rewritten graphs call at run time, one folder per kind of loop:
``log_softmax/`` (the hand-derived log-softmax statistics: on given logits, with the lm_head
matmul chunk by chunk, with the loss's gradients in the forward, per vocab-parallel shard),
``row_local/`` (the row-local engine: one chunk loop and the op of each place its logits come
from or its gradients are made), ``ops/`` (how an op is built: arguments and autograd by
name, the run-time registries, the one body compiler, bodies made of the user's own ops).
What every loop shares is here: ``tiling`` (the sizing rules: a budget to chunk rows, vocabulary
blocks and backward plans), ``chunk_gemm`` (the logits of row chunks against one weight) and
``rows`` (the rows a loss leaves out, read once a step).  Kernels know no graph matching.

May import: fx (no graph of the user's), reporting, config, env, compat."""
