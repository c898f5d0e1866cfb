"""Reading and checking torch-level FX graphs, shared by every matcher and rewrite:
``graph_ops`` (op names: ``canon`` for the ops the logits matcher knows, ``op_name`` ATen's
name of any call; arguments by name, shapes compared symbolically, side effects,
elementwise ops), ``op_rules`` (what each op of a loss tail or a row-local body means),
``emitter`` (adding nodes with their example values) and ``placement`` (where a fused op
may run: operand versions, grad mode, autocast).

May import: reporting, config, env, compat."""
