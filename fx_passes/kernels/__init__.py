"""What rewritten graphs call at run time: ``stats`` (``row_stats``, the fused per-row
log-softmax statistics), ``lm_head`` (the lm_head chunk loop and its backward),
``lm_head_bodies`` (its per-chunk bodies), ``body_compiler`` (the one way a chunk body is
compiled), ``tiling`` (chunk sizes and backward plans), ``gpu_plan`` (the ``"gpu"``
backward: model-precision GEMMs, FP32 sums through ``out_dtype``), ``lm_head_loss`` (the
lm_head loop that also computes the gradients in the forward when the loss is in the graph),
``row_local`` (a row-local region's loop over row chunks; ``row_local_head`` and
``row_local_sweeps`` when it runs the lm_head matmul, whole or chunk by chunk, the latter on
the body's gradient split by ``row_split``), ``user_bodies`` and ``shard_lm_head`` (bodies
made of the user's own ops, for vocab-parallel stages and row-local regions, and the
vocab-parallel lm_head loop); ``op_args`` (the ops' arguments by name: a custom op's flat
schema is unpacked there, and rewrites read an emitted call's arguments through it),
``op_pair`` (each op's autograd by name: what the forward saves, what the backward reads and
passes on). Kernels know no graph matching.

May import: fx (no graph of the user's), reporting, config, env, compat."""
