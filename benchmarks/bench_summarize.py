"""Time summarize() over 1,000,000 requests (and 200,000 step records)."""
import time
import numpy as np
from servelab.records import RequestRecord, StepRecord
from servelab.reports import summarize

rng = np.random.default_rng(0)
N = 1_000_000
arrival = np.cumsum(rng.exponential(0.01, N))
queue = rng.exponential(0.05, N)
ttft = queue + rng.exponential(0.2, N)
out = rng.integers(1, 500, N)
tpot = rng.uniform(0.01, 0.05, N)
rejected = rng.random(N) < 0.05
requests = []
for i in range(N):
    a = float(arrival[i])
    if rejected[i]:
        requests.append(RequestRecord(i, a, 9000, 0, "rejected", finish_s=a, tenant=f"t{i % 4}"))
    else:
        f = a + float(ttft[i])
        requests.append(RequestRecord(i, a, int(out[i]) * 2, int(out[i]), "finished", a + float(queue[i]), f,
                                      f + float(tpot[i]) * (int(out[i]) - 1), tenant=f"t{i % 4}",
                                      slo_ttft_ms=500.0 if i % 3 == 0 else None))
steps = [StepRecord(i * 0.05, 0.05, 0, 64, 0, 64, 3, 0, 500 + i % 400, 1000, num_steps=1 + i % 3)
         for i in range(200_000)]
# a few requests with exact token times, as the real backend records them
for r in requests[:1000]:
    if r.status == "finished":
        r.token_times = list(np.linspace(r.first_token_s, r.finish_s, r.output_tokens))
for label, steps_arg in (("1M requests, no steps", []), ("1M requests + 200k steps", steps)):
    times, cpu = [], []
    for _ in range(5):
        t, c = time.perf_counter(), time.process_time()
        summarize(requests, steps_arg, slo_ttft_ms=400.0, slo_tpot_ms=40.0)
        times.append(time.perf_counter() - t)
        cpu.append(time.process_time() - c)
    print(f"{label}: wall best/median of 5 = {min(times):.2f}/{sorted(times)[2]:.2f} s, "
          f"CPU best/median = {min(cpu):.2f}/{sorted(cpu)[2]:.2f} s")
s = summarize(requests, steps, slo_ttft_ms=400.0, slo_tpot_ms=40.0)
print({k: s[k] for k in ("completed", "rejected", "request_throughput", "request_goodput", "p99_itl_ms", "mean_batch_size", "jain_fairness_index")})
