"""Reading and checking torch-level FX graphs, shared by every matcher and rewrite:
``graph_ops`` (one canonical name per op, arguments, side effects, elementwise ops) and
``placement`` (where a fused op may run: operand versions, grad mode, autocast).

May import: reporting, config, env, compat."""
