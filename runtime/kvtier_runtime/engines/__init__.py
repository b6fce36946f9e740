"""Engine plug-ins. ``vllm_adapter`` is the only module of the project that imports vllm; import it only where
vLLM is installed (vLLM itself does, through the module paths rendered into its configuration)."""
