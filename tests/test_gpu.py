"""The same training step on a CUDA device; skipped where none is visible (CI has none)."""

import pytest
import torch

from conftest import small_config
from dapo.log import read_metrics
from dapo.training import train

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")]


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_two_steps_on_gpu(tiny_model_dir, tmp_path, dtype):
    cfg = small_config(tmp_path, tiny_model_dir, "model.device=cuda", f"model.dtype={dtype}")
    train(cfg)
    rows = read_metrics(cfg.run_dir)
    assert [r["step"] for r in rows] == [1, 2]
    assert all(torch.isfinite(torch.tensor(r["actor/grad_norm"])) for r in rows)
