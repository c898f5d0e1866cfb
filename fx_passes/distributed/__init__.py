"""Vocab-parallel (tensor-parallel) regions: ``shard_regions`` (find a loss written on a
vocabulary shard with collectives, and its stages), ``shard_stages`` (rewrite each stage
into one call), ``shard_reduce`` (the op a stage becomes when its lm_head is not fused) and
``one_pass`` (all of a fused region's stages in one pass over the rows).

May import: rewrite, match, kernels, fx, reporting, config, env, compat."""
