"""What rewritten graphs call at run time: ``stats`` (``row_stats``, the fused per-row
log-softmax statistics), ``lm_head`` (the lm_head chunk loop and its backward), ``bodies``
(its per-chunk bodies), ``tiling`` (chunk sizes and backward plans), ``graph_bodies`` and
``shard_lm_head`` (vocab-parallel stage bodies and their lm_head loop).  Kernels know no
graph matching.

May import: fx (no graph of the user's), reporting, config, env, compat."""
