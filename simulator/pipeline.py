"""Pipeline parallelism: a replica's layers split into `pp` stages, several batches in flight.

    servelab simulate --model deepseek-v3 --gpu h100-sxm --tp 8 --pp 2 --weight-dtype fp8 ...

What vLLM does (the facts this module models, with where they are in its source):

- Layers are split by `get_pp_indices` (`vllm/distributed/utils.py`): num_layers // pp
  each, and the remainder one layer each to the stages before the last, from the
  second-to-last backwards (the last stage already holds the final norm and LM head);
  `VLLM_PP_LAYER_PARTITION` can override the split (servelab does not expose it).
  `stage_layer_ranges` is that rule.
- The first stage holds the embedding, the last the final norm, the LM head and the
  sampler (`footprint.FIRST_STAGE_KERNELS`, `LAST_STAGE_KERNELS`); a tied embedding is
  held twice, on the first and the last stage (`footprint.stage_footprint`).
- Between stages the hidden states and the residual travel (`IntermediateTensors`,
  `GroupCoordinator.send_tensor_dict` in `vllm/distributed/parallel_state.py`): tokens x
  hidden x 2 tensors x 2 bytes (BF16). Under TP each rank sends only its 1/tp slice and
  the receiving stage all-gathers the slices ("send-allgather: send only a slice, then do
  allgather", called with `all_gather_group=get_tp_group()` from
  `vllm/v1/worker/gpu_model_runner.py`): tp links carry one transfer side by side, then
  an all-gather over the receiving stage's NVLink (priced as the cost model prices the
  logits gather, half an all-reduce's traffic).
- KV capacity: every worker profiles its own memory and the engine takes the smallest
  number of blocks ("Change the num_blocks of each rank to the smallest among all ranks",
  `vllm/v1/core/kv_cache_utils.py::get_kv_cache_configs`): `stage_kv_blocks`, `min`.
- Batches in flight: V1's EngineCore keeps up to `max_concurrent_batches` = pp batches
  in flight ("PP requires PP-size concurrent batches to fill the pipeline",
  `vllm/config/vllm.py`; `EngineCore.step_with_batch_queue` in `vllm/v1/engine/core.py`
  schedules a new batch while the queue is not full), and its scheduler skips a request
  whose previous step has not returned ("PP>1 and we have already scheduled all prompt
  tokens but they are not finished yet", `vllm/v1/core/sched/scheduler.py`).

How servelab models the batches in flight: as vLLM V0 did, with pp *virtual engines* per
replica. V0 built one scheduler per virtual engine (`LLMEngine.scheduler`, a list of
pipeline_parallel_size `Scheduler`s, `vllm/engine/llm_engine.py`), each over 1/pp of the
KV blocks (`Scheduler.__init__`: `num_gpu_blocks //= pipeline_parallel_size`, CPU blocks
likewise, `vllm/core/scheduler.py`), sent each new request to "the scheduler with least
unfinished seqs", and ran one step loop per virtual engine (`AsyncLLMEngine.
run_engine_loop`, `engine_step(virtual_engine)`). Here each virtual engine is a plain
simulator `Replica` (its own shared `Scheduler`, its own share of the KV cache, the shared
engine loop), whose executor (`StageExecutor`) sends each step through the replica's
stages; a replica's virtual engines share its stages (`StageTimeline`).

How that differs from V1: V1 has one scheduler over one KV pool, and any request may join
any of the pp batches as soon as its previous step is back; here requests and KV are split
statically among pp batches at arrival. Under a skewed mix one virtual engine can be full
(preempting) while another has room, and a request's prefix-cache hits are those of its
own virtual engine. Why: the shared Scheduler assumes that schedule() and update()
alternate, which V1's batch queue breaks (it schedules batch k + 1 before batch k's update)
— changing that belongs to the scheduler, not to the simulator; V0's split needs no change
to it and is what vLLM itself ran for pipeline parallelism before V1.

A step through the stages. A virtual engine's step launched at t with shape S runs stage
0 from max(t, the stage's end of its previous batch) for stage 0's time of S (its layers,
the embedding and the step's engine overhead, paid once, here), then after the transfer
to stage 1, stage 1 from max(arrival, stage 1's previous end), and so on; the step ends
when the last stage (layers, final norm, LM head, sampler) is done. The shared Scheduler
needs a step's end when the step is launched (`update` stamps tokens at launch +
duration), so each stage is a timeline of when it is next free, reserved in launch order
(`StageTimeline.run_step`, O(pp) per step) rather than a SimPy Resource that would answer
only when the batch gets there. That is also vLLM's order: every stage's worker runs the
batches in the order the engine submits them (it waits for its predecessor's send of batch
k before taking batch k + 1), and launch order is FIFO at every stage. A stage's busy
intervals never overlap; a lone batch takes the sum of its stage times plus transfers.
A transfer is a delay between two stages that occupies neither (a simplification: a
blocking send would hold the sending stage that long, well under a millisecond at these
sizes), and two over one link never overlap in practice (a step's activations move far
faster than a stage computes them).

Where the links are: stage s runs on GPUs s·tp .. (s+1)·tp - 1 of the replica, and
`GPUS_PER_NODE` GPUs share a node. Between two stages on one node the activations cross
the GPU's own peer link (NVLink at the catalog's `nvlink_gbps`, else PCIe at `pcie_gbps`;
latencies of the catalog's `nvlink` / `pcie-gen5` link files); between nodes, the network
link `INTER_NODE_LINK` (one NIC per GPU). DeepSeek-V3 at TP8 PP2 on H100: two nodes.

Not modelled: the decode fast-forward (a pipelined replica runs every step; its virtual
engines' steps interleave on the stages); speculative decoding, disaggregated pools and
data-parallel expert parallelism with pp > 1 (refused: `SimulationConfig`); the engine's
host overhead overlapping other batches' compute (it is charged on the first stage, which
it holds); the sampled tokens' trip from the last stage back to the engine.
"""
from __future__ import annotations

import itertools
from array import array
from dataclasses import dataclass
from typing import Any, Iterator, Sequence

import numpy as np
from simpy import Environment

from servelab._validate import check_bounded
from servelab.models import ModelSpec
from servelab.outputs import BatchShape, SchedulerOutput, StepResult
from servelab.record_table import RecordTable
from servelab.records import RequestRecord, StepRecord
from servelab.request import Request
from servelab.simulator import kernels as K
from servelab.simulator.cost_model import CostModel
from servelab.simulator.engine import ArrivalFeed, Replica, arrival_process, simulate_to_end
from servelab.simulator.footprint import ACT_BYTES, stage_footprint, stage_model
from servelab.simulator.gpus import GIB
from servelab.simulator.links import LinkSpec, get_link
from servelab.simulator.router import Router

GPUS_PER_NODE = 8
"""GPUs of one node, for every catalog GPU: the HGX/DGX servers of the data-center GPUs
(A100, H100, H200, B200) hold eight, and so do the usual L40S and RTX PRO 6000 servers.
vLLM's guide lays a multi-node model out as TP within a node and PP across nodes ("16 GPUs
in 2 nodes (8 GPUs per node) ... tensor parallel size to 8 and the pipeline parallel size
to 2", docs.vllm.ai serving/distributed_serving). Stages whose GPUs fall in different
nodes talk over `INTER_NODE_LINK`."""
INTER_NODE_LINK = "ib-400g"
"""The network between nodes: InfiniBand NDR 400 Gb/s, one ConnectX-7 NIC per GPU, as in
a DGX H100/H200 (the link file's source), the fabric of the multi-node servers this
catalog's GPUs come in; the same link servelab's disaggregated pools default to. Not a
flag: a step's activations are small beside its compute, so the network matters little
(docs/parallelism.md gives the transfer times of DeepSeek-V3's)."""
ACTIVATION_TENSORS = 2
"""Tensors sent between stages per token: the hidden states and the residual
(`IntermediateTensors({"hidden_states": ..., "residual": ...})` in vLLM's models)."""


def stage_layer_ranges(num_layers: int, pp: int) -> list[tuple[int, int]]:
    """[start, end) of each stage's layers, as vLLM's `get_pp_indices` splits them:
    num_layers // pp each, the remainder one more each for the stages before the last,
    from the second-to-last backwards. ValueError when a stage would get no layer."""
    check_bounded("pp", pp, 1, integer=True, noun="an integer")
    if pp > num_layers:
        raise ValueError(f"pp={pp} exceeds the model's {num_layers} layers: every pipeline stage "
                         "needs one at least")
    counts = [num_layers // pp] * pp
    for i in range(num_layers % pp):
        counts[-2 - i] += 1
    ends = list(itertools.accumulate(counts))
    return list(zip([0, *ends[:-1]], ends))


@dataclass(frozen=True)
class StageLink:
    """The link between stage s and s + 1: `lanes` links of kind `link` side by side
    (one per TP rank), then an all-gather over the receiving stage's TP group."""

    link: LinkSpec
    lanes: int
    crosses_nodes: bool


class PipelineLayout:
    """A pipelined replica's stages as priced and sized: for each stage its layers, its
    `CostModel` (`CostModel(stage_model(...), first_stage=..., last_stage=...)`, the step
    overhead on the first stage only) and its footprint; and the links between stages.

    `cost` is the whole model's cost model (its GPU, tp, dtypes, profile, block size,
    experts are the stages'). Raises ValueError for a layout that cannot run (pp above
    the layers)."""

    def __init__(self, model: ModelSpec, cost: CostModel, pp: int) -> None:
        self.model, self.cost, self.pp = model, cost, pp
        if pp > model.num_layers:
            raise ValueError(f"pp={pp} exceeds {model.name}'s {model.num_layers} layers: every "
                             f"pipeline stage needs one at least (pp <= {model.num_layers})")
        self.layer_ranges = stage_layer_ranges(model.num_layers, pp)
        self.stages = [
            CostModel(stage_model(model, start, end), cost.catalog_gpu, cost.tp, cost.weight_dtype,
                      cost.kv_dtype, cost.profile, cost.block_size,
                      step_overhead_s=cost.step_overhead_s if s == 0 else 0.0, ep=cost.ep,
                      expert_load=cost.expert_load, first_stage=s == 0, last_stage=s == pp - 1)
            for s, (start, end) in enumerate(self.layer_ranges)]
        self.links = [self._link(s) for s in range(pp - 1)]
        self._activation_bytes = ACTIVATION_TENSORS * model.hidden_size * ACT_BYTES
        self._transfer: list[dict[int, float]] = [{} for _ in self.links]

    @property
    def gpus(self) -> int:
        """GPUs of one replica: tp per stage."""
        return self.cost.tp * self.pp

    def _link(self, s: int) -> StageLink:
        tp, gpu = self.cost.tp, self.cost.gpu
        crosses = any((s * tp + i) // GPUS_PER_NODE != ((s + 1) * tp + i) // GPUS_PER_NODE
                      for i in range(tp))
        if crosses:
            return StageLink(get_link(INTER_NODE_LINK), tp, True)
        peer = get_link("nvlink" if gpu.nvlink_gbps is not None else "pcie-gen5")
        local = LinkSpec(f"{gpu.name} {'NVLink' if gpu.nvlink_gbps is not None else 'PCIe'}",
                         gpu.interconnect_gbps, peer.latency_us,
                         source=f"the GPU catalog's {gpu.name} peer bandwidth; latency of links/{peer.name}")
        return StageLink(local, tp, False)

    # --- prices ---------------------------------------------------------------------------

    def stage_times(self, shape: BatchShape) -> list[float]:
        """Seconds each stage computes a step of composition `shape`."""
        return [stage.step_time(shape) for stage in self.stages]

    def transfer_time(self, boundary: int, tokens: int) -> float:
        """Seconds to move a step's activations of `tokens` tokens from stage `boundary`
        to the next: over `lanes` links (1/tp of the bytes each), then the receiving
        stage's all-gather of the slices. Tabulated per token count."""
        table = self._transfer[boundary]
        t = table.get(tokens)
        if t is None:
            cost, link = self.cost, self.links[boundary]
            nbytes = tokens * self._activation_bytes
            t = link.link.seconds(nbytes, link.lanes) + cost.scales["collective"] * float(
                K.allreduce_time(nbytes / 2, cost.tp, cost.gpu, cost.kernels.collective))
            table[tokens] = t
        return t

    # --- capacity -------------------------------------------------------------------------

    def stage_kv_blocks(self, gpu_memory_utilization: float, max_num_batched_tokens: int,
                        max_num_seqs: int) -> list[int]:
        """KV blocks each stage's GPUs can hold, derived as `footprint.kv_capacity_blocks`
        derives a whole model's, from that stage's weights, KV per token and activation
        peak (logits only on the last stage). The replica's capacity is the smallest."""
        from servelab.capacity import VLLM_FUSED_BF16
        from servelab.capacity import kv_capacity_blocks as engine_kv_capacity_blocks

        cost, gpu = self.cost, self.cost.gpu
        budget = gpu.memory_bytes * gpu_memory_utilization
        blocks = []
        for s, f in enumerate(self.footprints()):
            start, end = self.layer_ranges[s]
            where = f"stage {s} (layers {start}-{end - 1})"
            if f.weight_bytes >= budget:
                raise ValueError(
                    f"{self.model.name} weights need {f.weight_bytes / GIB:.1f} GiB per GPU on "
                    f"pipeline {where} at tp={cost.tp}, pp={self.pp} ({cost.weight_dtype}), but "
                    f"{gpu.name} offers {budget / GIB:.1f} GiB at gpu_memory_utilization="
                    f"{gpu_memory_utilization}: raise pp or tp, or use fp8 weights")
            reserve = VLLM_FUSED_BF16.bytes(hidden=f.hidden, qkv=f.qkv, intermediate=f.intermediate,
                                            vocab=f.vocab, max_num_batched_tokens=max_num_batched_tokens,
                                            max_num_seqs=max_num_seqs)
            blocks.append(engine_kv_capacity_blocks(
                memory_bytes=gpu.memory_bytes, gpu_memory_utilization=gpu_memory_utilization,
                weight_bytes=f.weight_bytes, reserve_bytes=reserve,
                block_bytes=cost.block_size * f.kv_bytes_per_token,
                where=f"{self.model.name} {where} on {gpu.name}"))
        return blocks

    def footprints(self) -> list:
        """Each stage's `Footprint` on one of its GPUs."""
        c = self.cost
        return [stage_footprint(self.model, start, end, s, self.pp, c.tp, c.weight_dtype,
                                c.kv_dtype, c.ep) for s, (start, end) in enumerate(self.layer_ranges)]

    def describe(self) -> dict[str, Any]:
        """The layout for config.json's `derived.pipeline`."""
        return {
            "pp": self.pp, "gpus_per_replica": self.gpus, "gpus_per_node": GPUS_PER_NODE,
            "stages": [{"layers": [start, end], "weights_gib": round(f.weight_bytes / GIB, 3),
                        "kv_bytes_per_token": f.kv_bytes_per_token}
                       for (start, end), f in zip(self.layer_ranges, self.footprints())],
            "links": [{"between": [s, s + 1], "link": link.link.name, "lanes": link.lanes,
                       "crosses_nodes": link.crosses_nodes,
                       "bandwidth_gbps": link.link.bandwidth_gbps, "latency_us": link.link.latency_us}
                      for s, link in enumerate(self.links)],
        }


class StageTimeline:
    """When each stage of one replica is next free, and every interval it was busy (as
    arrays of start and end times, 16 bytes a step per stage). Shared by the replica's
    virtual engines: `run_step` reserves a step's pass through every stage, in launch
    order (see the module docstring)."""

    def __init__(self, layout: PipelineLayout) -> None:
        self.layout = layout
        self.free_at = [0.0] * layout.pp
        self.starts = [array("d") for _ in range(layout.pp)]
        self.ends = [array("d") for _ in range(layout.pp)]

    def run_step(self, now: float, shape: BatchShape) -> float:
        """Send a step of composition `shape` launched at `now` through the stages; returns
        when its last stage ends. O(pp)."""
        layout = self.layout
        tokens = shape.num_prefill_tokens + shape.num_decode_seqs
        t = now
        for s, busy in enumerate(layout.stage_times(shape)):
            if s:
                t += layout.transfer_time(s - 1, tokens)
            start = t if t > self.free_at[s] else self.free_at[s]
            t = start + busy
            self.free_at[s] = t
            self.starts[s].append(start)
            self.ends[s].append(t)
        return t

    def busy_s(self) -> list[float]:
        """Seconds each stage computed."""
        return [float(np.sum(np.frombuffer(e) - np.frombuffer(b))) if len(e) else 0.0
                for b, e in zip(self.starts, self.ends)]


class StageExecutor:
    """A virtual engine's executor: its step lasts from launch until its pass through the
    replica's stages ends (`StageTimeline.run_step`), waits for busy stages included."""

    __slots__ = ("env", "timeline")

    def __init__(self, env: Environment, timeline: StageTimeline) -> None:
        self.env, self.timeline = env, timeline

    def execute(self, output: SchedulerOutput) -> StepResult:
        shape = BatchShape.from_output(output)
        now = self.env.now
        return StepResult(self.timeline.run_step(now, shape) - now, shape=shape)


class PipelinedReplica:
    """One pipelined replica: its `pp` virtual engines (`Replica`s without fast-forward)
    over one `StageTimeline`. A request goes to the virtual engine with the fewest
    unfinished requests, ties to the lowest index (vLLM V0's rule)."""

    def __init__(self, env: Environment, index: int, schedulers: Sequence, layout: PipelineLayout) -> None:
        self.index = index
        self.timeline = StageTimeline(layout)
        feed = ArrivalFeed()   # unread: no fast-forward
        self.engines = [Replica(env, index * layout.pp + v, scheduler, layout.cost, feed,
                                fast_forward=False, executor=StageExecutor(env, self.timeline))
                        for v, scheduler in enumerate(schedulers)]

    @property
    def outstanding(self) -> int:
        return sum(engine.outstanding for engine in self.engines)

    def submit(self, req: Request) -> None:
        engines = self.engines
        best = engines[0]
        for engine in engines[1:]:
            if engine.outstanding < best.outstanding:
                best = engine
        best.submit(req)


class PipelinedCluster:
    """Pipelined replicas behind a router, fed by a trace, in one SimPy environment: what
    `engine.Cluster` is for unpipelined replicas, with the same arrival and routing rules
    (the router sees each replica's outstanding requests, its virtual engines' together).
    `schedulers` holds pp per replica, replica by replica."""

    groups: tuple = ()
    """No data-parallel lock-step groups (refused with pp > 1)."""

    def __init__(self, schedulers: Sequence, layout: PipelineLayout, router: Router,
                 requests: Sequence[Request]) -> None:
        pp, n = layout.pp, router.num_replicas
        if len(schedulers) != pp * n:
            raise ValueError(f"{n} replicas of {pp} virtual engines need {pp * n} schedulers, "
                             f"got {len(schedulers)}")
        arrivals = getattr(requests, "arrival_s", None)   # a trace's `TraceRequests` has them
        if arrivals is None:
            arrivals = np.array([r.arrival_s for r in requests], dtype=np.float64)
        if len(arrivals) > 1 and np.any(arrivals[1:] < arrivals[:-1]):
            raise ValueError("requests must be in arrival order")
        self.env = env = Environment()
        self.layout, self.router, self.requests = layout, router, requests
        self.num_requests = len(requests)
        self.last_arrival_s = float(arrivals[-1]) if len(arrivals) else 0.0
        self.replicas = [PipelinedReplica(env, i, schedulers[i * pp:(i + 1) * pp], layout)
                         for i in range(n)]
        feed = ArrivalFeed()
        upfront = None if n == 1 else router.assign_upfront(requests)
        if n == 1:
            env.process(arrival_process(env, requests, self.replicas[0].submit, feed))
        elif upfront is not None:
            for i, replica in enumerate(self.replicas):
                own = [j for j, r in enumerate(upfront) if r == i]
                env.process(arrival_process(env, map(requests.__getitem__, own), replica.submit,
                                            ArrivalFeed()))
        else:
            env.process(arrival_process(env, requests, self._route, feed))
        for replica in self.replicas:
            for engine in replica.engines:
                env.process(engine.run())

    def _route(self, req: Request) -> None:
        replicas = self.replicas
        replicas[self.router.route(req, [r.outstanding for r in replicas])].submit(req)

    @property
    def engines(self) -> Iterator[Replica]:
        """Every virtual engine, replica by replica."""
        for replica in self.replicas:
            yield from replica.engines

    @property
    def num_done(self) -> int:
        return sum(len(e.records) for e in self.engines)

    def run(self, progress=None, num_reports: int = 100) -> None:
        """Simulate until no event is left (`engine.simulate_to_end`)."""
        simulate_to_end(self, progress, num_reports)

    def request_records(self) -> RecordTable:
        records = RecordTable.concat(RequestRecord, [e.records.table() for e in self.engines])
        return records.sorted_by("request_id")

    def step_records(self) -> RecordTable:
        """Every virtual engine's steps by launch time (ties: engine order, then step order)."""
        steps = RecordTable.concat(StepRecord, [e.steps.table() for e in self.engines])
        return steps.sorted_by("start_s")

    def stats(self) -> dict[str, Any]:
        """Per stage, over the replicas: busy seconds and the fraction of the run's span
        (first launch to last end) they make; for config.json's `derived.pipeline`."""
        busy = np.zeros(self.layout.pp)
        span = 0.0
        for replica in self.replicas:
            timeline = replica.timeline
            busy += timeline.busy_s()
            if len(timeline.starts[0]):
                span += max(timeline.free_at) - timeline.starts[0][0]
        return {"stage_busy_s": [round(float(b), 6) for b in busy],
                "stage_busy_fraction": [round(float(b) / span, 4) if span > 0 else 0.0 for b in busy]}
