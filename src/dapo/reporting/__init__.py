"""What a run reports: ``run_log`` (the console, metrics.jsonl, TensorBoard, samples; reading metrics back; the
run summary), ``metrics`` (what a step logs), ``notes`` (what a run says about itself as it goes), ``trackers``
(Weights & Biases, MLflow) and ``plots`` (figures from metrics.jsonl)."""
