"""bf16 only where the hardware multiplies bf16: `--mixed_precision auto` (the training default) and the bf16
autocast of conversion and evaluation fall back to float32 on CPUs that would emulate bf16."""

import logging

import pytest
import torch

from delta_attention.conversion import precision
from delta_attention.conversion.training.loop import TrainingOptions
from test_training import BLOCKS, causal_lm_loss, train


@pytest.fixture
def cpu_bf16(monkeypatch):
    """Fake the CPU: `cpu_bf16(False)` is a CPU without AMX / AVX512-BF16, `cpu_bf16(True)` one with them."""
    precision.warn_emulated_bf16.cache_clear()

    def fake(native: bool):
        monkeypatch.setattr(precision, "cpu_has_native_bf16", lambda: native)

    yield fake
    precision.warn_emulated_bf16.cache_clear()


def test_auto_is_bf16_only_where_bf16_is_native(cpu_bf16, caplog):
    cpu_bf16(False)
    with caplog.at_level(logging.WARNING, logger=precision.logger.name):
        assert precision.resolve_mixed_precision("auto", "cpu") == "no"
        assert precision.resolve_mixed_precision("auto", "cpu") == "no"
    assert [r.getMessage() for r in caplog.records] == [
        "--mixed_precision auto: this CPU has no native bf16 matmuls (AMX, AVX512-BF16), where bf16 runs many times "
        "slower than float32; using float32"]
    for explicit in ("bf16", "no", "fp16"):  # what the user asks for is kept
        assert precision.resolve_mixed_precision(explicit, "cpu") == explicit
    cpu_bf16(True)
    assert precision.resolve_mixed_precision("auto", "cpu") == "bf16"
    assert precision.resolve_mixed_precision("auto", "meta") == "bf16"  # not a CPU: nothing to emulate


@pytest.mark.parametrize("native", [False, True])
def test_bf16_autocast_is_on_only_where_bf16_is_native(cpu_bf16, native):
    cpu_bf16(native)
    with precision.autocast(True):
        assert torch.is_autocast_enabled("cpu") == native
        assert (torch.ones(2, 2) @ torch.ones(2, 2)).dtype == (torch.bfloat16 if native else torch.float32)
    with precision.autocast(False):
        assert not torch.is_autocast_enabled("cpu")


@pytest.mark.parametrize("native", [False, True])
def test_the_default_training_precision_follows_the_cpu(tmp_path, cpu_bf16, native):
    """`TrainingOptions()` trains under bf16 autocast only on a CPU with native bf16; elsewhere in float32."""
    cpu_bf16(native)
    seen = []

    def loss(model, input_ids):
        seen.append(torch.is_autocast_enabled("cpu"))
        return causal_lm_loss(model, input_ids)

    assert TrainingOptions().mixed_precision == "auto"
    assert TrainingOptions().precision() == ("bf16" if native else "no")  # what distill records in its recipe
    train(tmp_path, TrainingOptions(batch_size=4), loss=loss, max_tokens=2 * 4 * BLOCKS.shape[1])
    assert seen == [native, native]


@pytest.mark.parametrize("value", ["auto", "bf16", "no"])
def test_the_cpu_scripts_accept_auto_bf16_and_no(value):
    precision.check_cpu_mixed_precision(value)


def test_the_cpu_scripts_name_what_they_accept():
    with pytest.raises(ValueError, match=r"^--mixed_precision must be auto, bf16 or no, got 'fp16'$"):
        precision.check_cpu_mixed_precision("fp16")
