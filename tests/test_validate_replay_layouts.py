"""`validate --simulate` replays a real run with the layout it ran: a disaggregated run as
the simulator's prefill and decode pools, a speculative run at the acceptance it measured.

Runs are the catalog's tiny-llama on the CPU (seeded random weights, fp32), a handful of
requests each (a few seconds in all).
"""
from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from servelab.cli import main
from servelab.simulator.run import load_config
from servelab.speculative import expected_tokens_per_step
from servelab.validation.replay import _acceptance

pytestmark = pytest.mark.usefixtures("torch_one_thread")

RUN = ["run", "--device", "cpu", "--model", "tiny-llama", "--trace", "default",
       "--num-requests", "6"]


def serve(out: Path, *flags: str) -> Path:
    assert main([*RUN, *flags, "--out", str(out)]) == 0
    return out


def validate(*args: str) -> dict:
    out = Path(args[args.index("--out") + 1])
    assert main(["validate", *args, "--no-plots"]) == 0
    return json.loads((out / "validation.json").read_text())


def test_a_disaggregated_run_replays_as_a_prefill_and_a_decode_pool(tmp_path, capsys):
    real = serve(tmp_path / "pd", "--prefill-replicas", "1", "--decode-replicas", "1",
                 "--decode-kv-blocks", "300")
    report = validate("--run", str(real), "--fit", "--simulate", "--out", str(tmp_path / "val"))
    run = report["simulate"]["runs"]["fcfs"]
    replay = Path(run["replay_dir"])
    pools = load_config(replay / "config.json").disaggregation
    derived = json.loads((real / "config.json").read_text())["derived"]["disaggregation"]
    assert pools is not None
    assert (pools.prefill.replicas, pools.decode.replicas) == (1, 1)
    assert pools.prefill.kv_blocks == derived["prefill"]["kv_blocks"]
    assert pools.decode.kv_blocks == derived["decode"]["kv_blocks"] == 300
    assert pools.kv_link == "ideal"
    simulated = json.loads((replay / "disaggregation.json").read_text())["requests"]
    recorded = json.loads((real / "disaggregation.json").read_text())["requests"]
    assert simulated["handed_off"] == recorded["handed_off"] > 0
    assert any(note.startswith("replayed as the simulator's prefill and decode pools")
               for note in run["notes"])
    assert "prefill and decode pools" in capsys.readouterr().out
    # no copy measured (nothing handed off in time): the note leaves the figure out
    quiet = shutil.copytree(real, tmp_path / "quiet")
    stats = json.loads((quiet / "disaggregation.json").read_text())
    stats["handoff_ms"]["transfer"]["mean"] = None
    (quiet / "disaggregation.json").write_text(json.dumps(stats))
    report = validate("--run", str(quiet), "--calibration", str(tmp_path / "val" / "calibration.json"),
                      "--simulate", "--out", str(tmp_path / "val-quiet"))
    assert "KV copies priced free" in " ".join(report["simulate"]["runs"]["fcfs"]["notes"])


def test_a_speculative_run_is_replayed_at_its_acceptance_and_never_fitted(tmp_path, capsys):
    plain = serve(tmp_path / "plain")
    spec = serve(tmp_path / "spec", "--speculative", "draft:tiny-llama",
                 "--num-speculative-tokens", "3")
    assert main(["validate", "--run", str(spec), "--fit", "--out", str(tmp_path / "refused")]) == 2
    assert "is a speculative run" in capsys.readouterr().err
    assert not (tmp_path / "refused" / "validation.json").exists()

    validate("--run", str(plain), "--fit", "--out", str(tmp_path / "fit"))
    report = validate("--run", str(spec), "--calibration", str(tmp_path / "fit" / "calibration.json"),
                      "--simulate", "--out", str(tmp_path / "val"))
    run = report["simulate"]["runs"]["fcfs"]
    speculative = load_config(Path(run["replay_dir"]) / "config.json").scheduler.speculative
    measured = json.loads((spec / "speculation.json").read_text())["acceptance_rate"]
    assert (speculative.method, speculative.num_speculative_tokens) == ("draft", 3)
    assert measured == 1.0   # the draft is the target itself
    assert speculative.acceptance == 1.0   # not the simulator's default of 0.8
    assert any("measured acceptance rate 1.000" in note for note in run["notes"])

    # a run that proposed nothing (acceptance_rate null) replays without speculation
    idle = shutil.copytree(spec, tmp_path / "idle")
    stats = json.loads((idle / "speculation.json").read_text())
    (idle / "speculation.json").write_text(json.dumps(
        {**stats, "proposed_tokens": 0, "accepted_tokens": 0, "acceptance_rate": None}))
    report = validate("--run", str(idle), "--calibration", str(tmp_path / "fit" / "calibration.json"),
                      "--simulate", "--out", str(tmp_path / "val-idle"))
    run = report["simulate"]["runs"]["fcfs"]
    assert not load_config(Path(run["replay_dir"]) / "config.json").scheduler.speculative.enabled
    assert any("proposed no token" in note for note in run["notes"])


@pytest.mark.parametrize("k, measured", [(3, 0.5), (4, 0.1), (1, 0.73), (5, 0.0), (2, 1.0)])
def test_the_acceptance_gives_the_measured_share_of_accepted_proposals(k, measured):
    alpha = _acceptance({"num_speculative_tokens": k, "acceptance_rate": measured})
    assert 0.0 <= alpha <= 1.0
    assert (expected_tokens_per_step(k, alpha) - 1) / k == pytest.approx(measured, abs=1e-9)
