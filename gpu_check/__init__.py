"""The one-GPU acceptance run (README.md): `gpu_check/gpu_check.sh`."""
