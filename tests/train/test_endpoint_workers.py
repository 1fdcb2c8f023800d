"""`--features URL`: the collator applies the verifier's head; with a GPU it runs in the main process, on the GPU."""

from __future__ import annotations

from eagle3_hf.train.training_data import DEFAULT_WORKERS, endpoint_loader_workers


def test_no_loader_workers_on_a_gpu():
    assert endpoint_loader_workers(0, cuda=True) == 0
    assert endpoint_loader_workers(4, cuda=True) == 0
    assert endpoint_loader_workers(0, cuda=False) == DEFAULT_WORKERS
    assert endpoint_loader_workers(3, cuda=False) == 3
