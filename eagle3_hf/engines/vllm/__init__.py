"""vLLM's wing on the engine side: its venv and the runners there (vllm_runner.py, vllm_extract_runner.py,
vllm_feature_server.py, executed by path inside vLLM's venv, importing only the standard library, vllm and
each other), how they are started and stopped (vllm_env.py, vllm_feature_launcher.py, vllm_openai.py,
warm_launch.py: forked from a warm vLLM process, engines/fork_server.py, when one listens), the engine options
(vllm_args.py) and the typed request (vllm_request.py). The feature side of vLLM (options, the FeatureSource,
regenerate with features) is features/vllm/."""
