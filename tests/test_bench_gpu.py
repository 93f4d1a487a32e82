"""bench/bench_gpu.py's packing of the shipped models for a GPU machine (64 MiB of files): int8
rows with a scale each, back to bf16 within half a quantization step, the small tensors as they are."""

import torch

from bench.bench_gpu import MIN_QUANTIZED_NUMEL, dequantize, quantize


def test_int8_packing_round_trips_within_half_a_step_per_row():
    g = torch.Generator().manual_seed(0)
    big = (torch.randn(256, 512, generator=g) * torch.linspace(0.01, 3, 256)[:, None]).to(torch.bfloat16)
    weights = {"w": big, "norm": torch.rand(512, generator=g).to(torch.bfloat16),
               "small": torch.randn(8, 8, generator=g).to(torch.bfloat16), "ids": torch.arange(5)}
    packed = quantize(weights)
    assert packed["w.q8"].dtype == torch.int8 and "w" not in packed and big.numel() >= MIN_QUANTIZED_NUMEL
    assert torch.equal(packed["norm"], weights["norm"]) and torch.equal(packed["small"], weights["small"])
    back = dequantize(packed, torch.bfloat16)
    assert set(back) == set(weights) and back["w"].dtype == torch.bfloat16
    step = big.float().abs().amax(dim=1, keepdim=True) / 127
    err = (back["w"].float() - big.float()).abs()
    # half a step of rounding, plus bf16's own rounding of the dequantized value
    assert (err <= step / 2 + big.float().abs() / 128 + 1e-6).all()
    assert (err > 0).any()  # it is lossy: the packed target is not bit for bit the shipped one
