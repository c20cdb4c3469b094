"""The model side: ``loading`` (Hugging Face model directories, GGUF import), ``policy`` (the policy and the
reference model: AdamW over float32 masters, the update on a given loss), ``logprobs`` (the log-prob pass),
``micro_batch`` (a batch into the forward passes' micro-batches), ``prefix`` (the shared prompt prefix), ``logits``
(what a model's forward does to its LM head's output), ``lora`` (peft adapters), ``kernels`` (train.kernels) and
``tiny`` (the tiny models the demo and the tests build locally). Nothing here decides anything about the
algorithm: the loss arrives as a function."""
