"""The hand-derived log-softmax statistics and the loops that run them: ``given`` (per-row
statistics of given logits, ``row_stats``, and their gradient), ``lm_head`` (the same with the
lm_head matmul chunk by chunk, ``lm_head_row_stats``; ``lm_head_sweeps``: its backward plans;
``lm_head_masked``: on the rows a mask leaves in), ``bodies`` (its per-chunk bodies),
``gpu_plan`` (the ``"gpu"`` backward: model-precision GEMMs, FP32 sums through
``out_dtype``), ``loss`` (``lm_head_loss``: the loop that also computes the gradients in the
forward when the loss is in the graph; ``loss_parts``: what it shares with ``row_local_loss``)
and ``shard`` (``shard_lm_head``: the lm_head loop of one vocab-parallel shard)."""
