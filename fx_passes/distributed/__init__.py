"""Vocab-parallel (tensor-parallel) regions: ``vocab_parallel`` (find and rewrite a loss
written on a vocabulary shard with collectives) and ``one_pass`` (all of a fused region's
stages in one pass over the rows).

May import: rewrite, match, kernels, fx, reporting, config, env, compat."""
