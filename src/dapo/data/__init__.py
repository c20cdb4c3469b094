"""The data a run trains and evaluates on: ``prompts`` (the ``Example`` record, the prompt templates, the
encoder), ``files`` (JSONL and parquet files and a caller's rows into ``Example``s, one line per bad row) and
``prompt_order`` (the seeded, resumable order in which training prompts are drawn)."""
