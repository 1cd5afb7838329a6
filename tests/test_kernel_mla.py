"""The MLA attention model (DeepSeek-V3's latent: 512 + 64 values per token), its fit to
aiconfigurator's vLLM 0.14 `context_mla_perf` / `generation_mla_perf` tables, and
`servelab cost mla`."""
from __future__ import annotations

import json

import numpy as np
import pytest
from _gpu_tables import real_measurements

from servelab.cli import main
from servelab.simulator import kernels as K
from servelab.simulator.calibration import packaged
from servelab.simulator.gpus import get_gpu
from servelab.validation.kernel_fit import FAMILIES, family_table, holdout_mask, judge
from servelab.validation.measurements import load_measurements

H100 = get_gpu("h100-sxm")
KERNELS = packaged("h100-sxm").kernels


def decode(batch, context, heads=16, kv_bytes=2.0, p=KERNELS.mla_decode):
    b = np.asarray(batch, dtype=float)
    return K.mla_decode_time(b, b * np.asarray(context), heads, H100, p, kv_bytes=kv_bytes)


def prefill(batch, tokens, heads=16, context=0, kv_bytes=2.0, p=KERNELS.mla_prefill):
    return K.mla_prefill_time(batch, tokens, heads, H100, p, context=context, kv_bytes=kv_bytes)


# --- the kernels --------------------------------------------------------------------------------


def test_decode_grows_with_context_and_batch_and_is_free_without_sequences():
    contexts = 2.0 ** np.arange(0, 18)
    for batch in (1, 8, 64, 256):
        t = decode(batch, contexts)
        assert (np.diff(t) >= 0).all() and t[-1] > (3 if batch >= 64 else 1.2) * t[0], batch
    batches = np.array([1, 2, 8, 32, 128, 512])
    assert (np.diff(decode(batches, 4096)) > 0).all()
    assert float(decode(0, 4096)) == 0.0


def test_decode_streams_the_latent_at_large_batch_and_context():
    """At large batch and context the time is the latents over the fitted bandwidth:
    576 values per token, whatever the heads (they share one latent)."""
    p = KERNELS.mla_decode
    b, c = 256, 65536
    latents = b * c * 576 * 2 / (H100.hbm_bandwidth_gbps * 1e9 * p.memory_eff)
    assert float(decode(b, c, heads=1)) == pytest.approx(latents, rel=0.1)
    assert float(decode(b, c, heads=16)) < 1.3 * float(decode(b, c, heads=1))


def test_fp8_latents_decode_faster_at_long_context():
    assert float(decode(128, 32768, kv_bytes=1.0)) < 0.7 * float(decode(128, 32768))


def test_tensor_parallel_heads_cost_less_per_gpu():
    for phase in (lambda h: prefill(1, 8192, heads=h), lambda h: decode(64, 8192, heads=h)):
        times = [float(phase(h)) for h in (128, 64, 16)]
        assert times == sorted(times, reverse=True), times


def test_prefill_grows_with_tokens_quadratically_and_pays_for_cached_context():
    tokens = np.array([16, 128, 1024, 4096, 16384, 32768])
    t = prefill(1, tokens, heads=128)
    assert (np.diff(t) > 0).all()
    assert t[-1] / t[-2] > 3.0                               # causal pairs: ~4x per doubling
    assert float(prefill(1, 1024, context=8192)) > 2 * float(prefill(1, 1024))
    assert float(prefill(0, 1024)) == 0.0


def test_the_bare_roofline_prefill_is_its_kernels_flops_and_bytes_in_turn():
    """Up-projection, attention and cache write are separate kernels: their times add."""
    bare = K.MLAPrefillParams()
    s, h = 8192, 128
    flops = s * (s + 1) / 2 * h * 2 * (192 + 128) + 2 * s * 512 * h * 256
    traffic = s * (h * 320 * 2 + 576 * 4) + s * h * 256 * 4      # Q, O, latents; K/V expanded
    expected = flops / H100.peak_flops("bf16") + traffic / (H100.hbm_bandwidth_gbps * 1e9)
    assert float(prefill(1, s, heads=h, p=bare)) == pytest.approx(expected, rel=1e-6)


# --- the fit, judged on held-out rows ---------------------------------------------------------


@pytest.fixture(scope="module")
def h100_tables():
    return load_measurements([real_measurements() / "aiconfigurator-vllm-0.14.0" / "h100_sxm"],
                             "h100-sxm", drop_bad_rows=True)


@pytest.mark.parametrize("family", ["mla_prefill", "mla_decode"])
def test_h100_mla_fit_reproduces_held_out_rows_within_the_target(h100_tables, family):
    profile = packaged("h100-sxm")
    fam = FAMILIES[family]
    table = family_table(h100_tables, fam)
    mask = holdout_mask(table, profile.fit_stats["holdout_fraction"], 0)
    fit = judge(fam, table, H100, getattr(profile.kernels, family), mask)
    assert fit.stats["heldout"]["n"] > 400 and fit.stats["heldout"]["mape_pct"] <= 15.0
    assert fit.stats["heldout"]["mape_pct"] == pytest.approx(
        profile.fit_stats[f"{family}.heldout_mape_pct"], abs=0.01)
    assert set(table["kv_dtype"]) == {"bf16"} and table["heads"].max() == 128
    bare = judge(fam, table, H100, getattr(K.KernelParams.roofline(), family), mask)
    assert bare.stats["heldout"]["mape_pct"] > 2 * fit.stats["heldout"]["mape_pct"]


# --- servelab cost mla ------------------------------------------------------------------------


def cost(capsys, *argv):
    rc = main(["cost", "mla", *map(str, argv)])
    out, err = capsys.readouterr()
    return rc, out, err


def test_cost_mla_divides_the_heads_by_tp_and_prices_the_kernel(capsys):
    rc, out, err = cost(capsys, "--gpu", "h100-sxm", "--phase", "decode", "--batch", 64,
                        "--context", 4096, "--heads", 128, "--tp", 8, "--json")
    assert rc == 0, err
    r = json.loads(out)
    assert r["heads_per_gpu"] == 16 and r["kv_bytes"] == 64 * 4096 * 576 * 2
    assert r["predicted_ms"] == pytest.approx(float(decode(64, 4096, heads=16)) * 1e3, abs=1e-6)
    rc, text, _ = cost(capsys, "--gpu", "h100-sxm", "--phase", "prefill", "--batch", 2,
                       "--tokens", 2048, "--heads", 128, "--tp", 8, "--kv-dtype", "fp8")
    assert rc == 0 and "MLA prefill of 2 x 2048 tokens after 0 cached, 128 heads / TP 8 = 16 per GPU, KV fp8" in text


def test_cost_mla_points(capsys, tmp_path):
    points = tmp_path / "mla.csv"
    points.write_text("phase,batch,context,tokens\ndecode,8,1024,1\nprefill,1,0,512\n")
    rc, out, err = cost(capsys, "--gpu", "h100-sxm", "--heads", 128, "--points", points, "--json")
    assert rc == 0, err
    rows = json.loads(out)
    assert rows[0]["predicted_ms"] == pytest.approx(float(decode(8, 1024, heads=128)) * 1e3, abs=1e-6)
    assert rows[1]["predicted_ms"] == pytest.approx(float(prefill(1, 512, heads=128)) * 1e3, abs=1e-6)


@pytest.mark.parametrize("extra, message", [
    (("--phase", "decode", "--batch", 1, "--context", 10, "--heads", 128, "--tp", 3),
     "--heads (128) must be divisible by --tp (3)"),
    (("--phase", "decode", "--batch", 1, "--heads", 128), "needs --context >= 1"),
    (("--phase", "prefill", "--batch", 1, "--heads", 128), "needs --tokens"),
    (("--batch", 1, "--heads", 128), "cost mla needs --phase"),
])
def test_cost_mla_refuses_impossible_shapes_in_one_line(capsys, extra, message):
    rc, _, err = cost(capsys, "--gpu", "h100-sxm", *extra)
    assert rc != 0 and message in err and len(err.strip().splitlines()) == 1


def test_cost_mla_refuses_a_kv_dtype_it_does_not_model(capsys):
    with pytest.raises(SystemExit):
        cost(capsys, "--gpu", "h100-sxm", "--phase", "decode", "--batch", 1, "--context", 8,
             "--heads", 128, "--kv-dtype", "fp16")
    assert "invalid choice: 'fp16'" in capsys.readouterr().err
