"""What checks the pass, shared by the tests, the benchmarks and users who want the same
checks on their own graphs: ``codegen`` (which FP32 buffers Inductor's generated code
allocates: the deterministic memory check), ``workloads`` (the benchmarks' W1-W5, W4L, WV,
U1-U3: their functions, ``workload_functions``, plus input factories, one training or
scoring step, the FP64 reference mode), ``rl_spellings`` (the RL frameworks' log-prob
spellings), ``models`` (tiny Hugging Face ``*ForCausalLM`` families built from a config, one
compiled step of each, errors against FP64).  Nothing in the pass imports it.

May import: everything in fx_passes (it is the top stage, beside entry)."""
