"""What the passes did and why: ``report`` (``Decline`` / ``Reason``, counters, log lines),
``session`` (this process's events, torch-free), ``summary`` (the exit summary) and
``containment`` (an error inside the pass never breaks a compile).

May import: config, env, compat."""
