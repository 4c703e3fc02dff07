"""SmallRowLinear (W @ x^T for a few fp32 rows on the CPU) is nn.Linear up to float summation order, speculative
decoding through it is token-identical to plain decoding through nn.Linear, and `python -m specpilot.bench.gemm`'s timing
leaves the model as it found it."""
import torch

from specpilot.bench.gemm import KERNELS, same_tokens, summarize, time_paths
from conftest import plain_greedy, tiny_llama, tiny_target
from specpilot.decoding.drafters import NgramDrafter
from specpilot.decoding.loop import generate
from specpilot.decoding.models import SmallRowLinear, use_small_row_gemm
from specpilot.decoding.policies import StaticK


def test_small_rows_compute_what_linear_computes():
    torch.manual_seed(0)
    for bias in (True, False):
        linear = torch.nn.Linear(48, 80, bias=bias)
        small = SmallRowLinear(48, 80, bias=bias)
        small.load_state_dict(linear.state_dict())
        for shape in [(1, 48), (3, 48), (1, 1, 48), (2, 5, 48), (4, 4, 48), (3, 7, 48)]:  # 1 to 21 rows
            x = torch.randn(shape)
            want, got = linear(x), small(x)
            assert got.shape == want.shape and torch.allclose(got, want, atol=1e-5, rtol=1e-5)
            assert got.is_contiguous()  # a transposed view sends attention down a slow path at long contexts
        # the comparison sees a product taken the wrong way round (W^T @ x^T on a square layer)
        square = SmallRowLinear(48, 48, bias=False)
        x = torch.randn(2, 48)
        wrong = torch.mm(square.weight.t(), x.t()).t()
        assert not torch.allclose(wrong, torch.nn.functional.linear(x, square.weight), atol=1e-3)
        assert torch.allclose(square(x), torch.nn.functional.linear(x, square.weight), atol=1e-5)
    calls = []
    mm = torch.mm
    try:  # W @ x^T is taken for 1-4 rows only (the rows where it measured faster; one row padded to two),
        # nn.Linear's path elsewhere
        torch.mm = lambda *a: calls.append(a[1].shape[1]) or mm(*a)
        for rows in range(1, 8):
            small(torch.randn(rows, 48))
    finally:
        torch.mm = mm
    assert calls == [2, 2, 3, 4]
    double = SmallRowLinear(8, 8).double()  # other dtypes take nn.Linear's path
    x = torch.randn(2, 8, dtype=torch.float64)
    assert torch.equal(double(x), torch.nn.functional.linear(x, double.weight, double.bias))


def test_swapping_the_class_keeps_the_weights_and_goes_back():
    model = tiny_llama(dtype=torch.float32)
    before = {n: p.data_ptr() for n, p in model.named_parameters()}
    use_small_row_gemm(model)
    assert type(model.lm_head) is SmallRowLinear and type(model.model.layers[0].mlp.up_proj) is SmallRowLinear
    assert {n: p.data_ptr() for n, p in model.named_parameters()} == before
    use_small_row_gemm(model, False)
    assert not any(type(m) is SmallRowLinear for m in model.modules())


def test_speculative_decoding_through_small_rows_is_plain_decoding():
    model = tiny_llama(vocab=64, dtype=torch.float32)
    prompt = [5, 9, 13, 2, 7, 5, 9, 13, 2, 7, 5, 9]
    plain = plain_greedy(model, prompt, 40)  # nn.Linear, no cache
    use_small_row_gemm(model)
    try:
        for k in (1, 4, 8):
            got = generate(tiny_target(model), NgramDrafter(max_n=3), StaticK(k), prompt, 40).token_ids
            assert got == plain, k
        rows = generate(tiny_target(model), NgramDrafter(max_n=3), StaticK(4), [prompt, prompt[2:], prompt[:7]], 40)
        assert rows.token_ids[0] == plain
        assert rows.token_ids[1] == plain_greedy(tiny_llama(vocab=64, dtype=torch.float32), prompt[2:], 40)
    finally:
        use_small_row_gemm(model, False)


def test_the_timing_covers_every_cell_and_restores_the_model():
    model = tiny_llama(vocab=64, dtype=torch.float32)
    target = tiny_target(model)
    seconds = time_paths(target, list(range(1, 20)), [1, 2], 3, 24, 2)
    assert set(seconds) == set(KERNELS) and all(len(v) == 2 and len(v[0]) == 2 and len(v[0][0]) == 4 for v in seconds.values())
    rows = summarize(seconds, [1, 2], 3)
    assert [(r["batch_size"], r["k"]) for r in rows] == [(b, k) for b in (1, 2) for k in range(4)]
    assert all(r["speedup"] > 0 and r["interval"] and r["linear_over_plain"] > 0 for r in rows)
    assert all(r["linear_over_plain"] == 1.0 for r in rows if r["k"] == 0)
    assert not any(type(m) is SmallRowLinear for m in model.modules())
    assert same_tokens(target, [5, 9, 13, 2, 7, 5, 9, 13], 16) == {"plain": True, "static:4": True}


def test_an_unknown_gemm_path_is_one_line_error():
    import pytest

    from specpilot.decoding.errors import SpecPilotError
    from specpilot.decoding.models import load_target

    with pytest.raises(SpecPilotError, match="--gemm must be one of auto, linear, small-rows"):
        load_target("embedded", gemm="fast")


def test_auto_takes_small_rows_on_the_cpus_it_was_measured_faster_on(tiny_model_dirs, monkeypatch):
    from specpilot.decoding import models
    from specpilot.decoding.models import load_target, resolve_gemm

    amd, intel = "cpu-amd-epyc-2c", "cpu-intel-xeon-2c"
    assert [resolve_gemm("auto", d, amd) for d in ("cpu", "cuda:0", "cuda")] == ["small-rows", "linear", "linear"]
    assert resolve_gemm("auto", "cpu", intel) == "linear"  # SmallRowLinear took twice nn.Linear's time there
    assert resolve_gemm("linear", "cpu", amd) == "linear" and resolve_gemm("small-rows", "cuda:0") == "small-rows"
    monkeypatch.setattr(models, "cpu_key", lambda: amd)  # the loader asks this machine's key
    default = load_target(tiny_model_dirs["target"], "float32", "cpu")
    assert any(type(m) is SmallRowLinear for m in default.model.modules()) and default.name.endswith("[small-rows gemm]")
    monkeypatch.setattr(models, "cpu_key", lambda: intel)
    assert not any(type(m) is SmallRowLinear for m in load_target(tiny_model_dirs["target"], "float32", "cpu").model.modules())
    torch_path = load_target(tiny_model_dirs["target"], "float32", "cpu", gemm="linear")
    assert not any(type(m) is SmallRowLinear for m in torch_path.model.modules())
    assert "small-rows" not in torch_path.name
