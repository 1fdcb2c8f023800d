"""`evaluate` metric modules shipped inside the package (load them by path, e.g.
`evaluate.load(eagle3_hf.speculative.acceptance_metric_path())`)."""
