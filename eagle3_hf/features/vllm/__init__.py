"""vLLM's wing on the feature side: how every route that runs vLLM is configured and reads its files
(vllm_spec.py), the FeatureSource both vLLM routes share (vllm_features.py) and `regenerate --engine vllm` with
features (vllm_generation.py). The engine side (the runners in vLLM's venv and how they start) is engines/vllm/."""
