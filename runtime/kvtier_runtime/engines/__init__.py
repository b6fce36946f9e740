"""Engine plug-ins. The ``vllm`` package (one module per plug-in) and ``vllm_adapter`` (the module path vLLM loads,
a re-export of that package) are the only modules of the project that import vllm; import them only where vLLM is
installed (vLLM itself does, through the module paths rendered into its configuration)."""
