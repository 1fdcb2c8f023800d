"""Serving engines in the loop: a drafter measured the way users will serve it.

vLLM lives in its own venv (`make vllm`, scripts/install_vllm.sh): it pins another torch and transformers
than ours. `vllm_runner.py` runs inside that venv (stdlib + vllm only, executed by path), `vllm_env.py`
finds the venv and starts the runner, `eagle3_hf/evaluation/vllm_engine.py` is `eagle3-hf evaluate --engine vllm`.
"""
