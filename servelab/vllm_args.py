"""Read a `vllm serve` command line as servelab flags.

    translate("vllm serve meta-llama/Llama-3.1-8B --max-num-seqs 256 -tp 2")
    # VllmArgs(values={"model": "llama-3.1-8b", "max_num_seqs": 256, "tp": 2}, notes=[])

`values` is keyed by the `servelab simulate` option each flag sets (its argparse dest).
A flag that changes nothing servelab models (host, port, logging, tokenizer) is accepted
silently; one servelab models only approximately yields a note; one it cannot model yet
(speculative decoding, KV transfer) raises ValueError
naming the flag. Flags are spelled as vLLM accepts them: `--flag value`, `--flag=value`,
with dashes or underscores (`vllm/utils/argparse_utils.py` FlexibleArgumentParser).
The meanings follow vLLM's `vllm/engine/arg_utils.py` (EngineArgs.add_cli_args).
Pure standard library.
"""
from __future__ import annotations

import argparse
import re
import shlex
from dataclasses import dataclass, field
from typing import Any, Callable

from servelab._validate import bounds_text, within
from servelab.options import number

_finite = number(float)
"""Any finite number: `_fraction` reads with it, then words its own range."""


@dataclass
class VllmArgs:
    values: dict[str, Any] = field(default_factory=dict)
    notes: list[str] = field(default_factory=list)


def _read(flag: str, parse: Callable[[str], Any], text: str) -> Any:
    """`parse(text)` (a `servelab.options.number` parser), its error re-raised as a
    ValueError prefixed by the vLLM flag."""
    try:
        return parse(text)
    except argparse.ArgumentTypeError as e:
        raise ValueError(f"--vllm-args {flag}: {e}") from None


def _int(flag: str, text: str, low: int = 1) -> int:
    return _read(flag, number(int, low=low), text)


_HUMAN_INT = re.compile(r"(\d+(?:\.\d+)?)([kmgtKMGT])")


def _human_int(flag: str, text: str, low: int = 1) -> int:
    """An integer as vLLM's `human_readable_int` reads one (`vllm/engine/arg_utils.py`, the
    type of --max-model-len): "32k" is 32,000 (k, m, g, t: powers of 1,000, decimals
    allowed), "32K" is 32,768 (K, M, G, T: powers of 1,024, whole numbers only)."""
    match = _HUMAN_INT.fullmatch(text.strip())
    if match is not None:
        number, suffix = match.groups()
        if suffix.islower():
            text = str(int(float(number) * 1000 ** ("kmgt".index(suffix) + 1)))
        elif "." in number:
            raise ValueError(f"--vllm-args {flag}: decimals go with k, m, g or t (powers of "
                             f"1,000), not {suffix}: got {text!r}")
        else:
            text = str(int(number) * 1024 ** ("KMGT".index(suffix) + 1))
    return _int(flag, text, low)


def _fraction(flag: str, text: str) -> float:
    """A finite number in (0, 1], the range checked and worded by `servelab._validate`."""
    value = _read(flag, _finite, text)
    if not within(value, 0, 1, lo_open=True):
        raise ValueError(f"--vllm-args {flag}: expected a fraction "
                         f"{bounds_text(0, 1, lo_open=True)}, got {text!r}")
    return value


_DTYPES = {"auto": "bf16", "bfloat16": "bf16", "bf16": "bf16", "float16": "fp16", "half": "fp16",
           "fp16": "fp16", "float32": "fp32", "float": "fp32"}
"""--dtype: 'auto' takes the checkpoint's dtype, which for the catalog's models is bf16."""
_KV_DTYPES = {"auto": "auto", "bfloat16": "bf16", "fp8": "fp8", "fp8_e4m3": "fp8", "fp8_e5m2": "fp8"}
"""--kv-cache-dtype: 'auto' is the model's activation dtype (--dtype's, bf16 by default:
an FP8 checkpoint computes in bf16), so a --kv-dtype fp8 beside it disagrees."""


def _choice(flag: str, text: str, table: dict[str, Any]) -> Any:
    if text not in table:
        raise ValueError(f"--vllm-args {flag} {text}: servelab models {', '.join(table)}")
    return table[text]


def _data_parallel(flag: str, text: str) -> dict:
    n = _int(flag, text)
    # vLLM's data-parallel coordinator sends a request to the rank with the fewest waiting
    # and running requests (vllm/v1/engine/coordinator.py): least-outstanding is the
    # closest, as for --dp (`simulator.cli.config_from_args`); a --router given wins
    return {"replicas": n, "router": "least-outstanding"} if n > 1 else {}


def _long_prefill(flag: str, text: str) -> dict:
    n = _int(flag, text, low=0)
    return {"chunked_prefill": n if n else "budget"}


_VALUE_FLAGS: dict[str, Callable[[str, str], dict]] = {
    "--model": lambda f, t: {"model": t},
    "--tensor-parallel-size": lambda f, t: {"tp": _int(f, t)},
    "--data-parallel-size": _data_parallel,
    "--pipeline-parallel-size": lambda f, t: {"pp": _int(f, t)},
    "--max-num-seqs": lambda f, t: {"max_num_seqs": _int(f, t)},
    "--max-num-batched-tokens": lambda f, t: {"max_num_batched_tokens": _int(f, t)},
    "--max-model-len": lambda f, t: {"max_model_len": _human_int(f, t, low=2)},
    "--block-size": lambda f, t: {"block_size": _int(f, t)},
    "--gpu-memory-utilization": lambda f, t: {"gpu_memory_utilization": _fraction(f, t)},
    "--num-gpu-blocks-override": lambda f, t: {"kv_blocks": _int(f, t)},
    "--long-prefill-token-threshold": _long_prefill,
    "--dtype": lambda f, t: {"_dtype": _choice(f, t, _DTYPES)},
    "--kv-cache-dtype": lambda f, t: {"_kv_dtype": _choice(f, t, _KV_DTYPES)},
    "--quantization": lambda f, t: {"_quantization": _choice(f, t, {"fp8": "fp8"})},
    "--scheduling-policy": lambda f, t: {"policy": _choice(f, t, {"fcfs": "fcfs",
                                                                  "priority": "priority"})},
}
_ALIASES = {"-tp": "--tensor-parallel-size", "-dp": "--data-parallel-size",
            "-pp": "--pipeline-parallel-size", "-q": "--quantization"}
_SWITCHES: dict[str, dict] = {
    "--enable-prefix-caching": {"prefix_caching": True},
    "--no-enable-prefix-caching": {"prefix_caching": False},
    "--enable-chunked-prefill": {},   # V1 always chunks prefills
    "--no-enable-chunked-prefill": {"chunked_prefill": "off"},
    "--enable-expert-parallel": {"_expert_parallel": True},
    "--async-scheduling": {"async_scheduling": True},
    "--no-async-scheduling": {"async_scheduling": False},
}
_APPROXIMATED = {
    "--enforce-eager": "the kernel profiles price CUDA-graph execution; eager mode's extra "
                       "launch time per step is not modelled",
    "--swap-space": "vLLM V1 has no swap preemption: ignored (servelab's own is "
                    "--preemption swap --cpu-kv-blocks N)",
    "--max-num-partial-prefills": "not modelled: servelab lets every waiting prefill fill the "
                                  "budget in order",
    "--max-long-partial-prefills": "not modelled",
    "--compilation-config": "not modelled: the kernel profiles price the engine's default "
                            "compilation",
    "-O": "not modelled: the kernel profiles price the engine's default compilation",
    "--enable-eplb": "expert load balancing (EPLB) is not modelled: experts stay where they "
                     "are, loaded as --expert-load says",
    "--eplb-config": "expert load balancing (EPLB) is not modelled",
    "--cuda-graph-sizes": "not modelled: the kernel profiles price CUDA-graph execution at "
                          "every batch size",
    "--max-seq-len-to-capture": "not modelled: the kernel profiles price CUDA-graph execution",
}
_NOTE_SWITCHES = frozenset({"--enforce-eager", "--enable-eplb"})
"""Approximated flags that take no value."""
_UNSUPPORTED = {
    "--speculative-config": "its JSON is not read: give servelab's --speculative "
                            "draft:MODEL|ngram|eagle|mtp and --num-speculative-tokens K",
    "--kv-transfer-config": "a KV connector's JSON is not read: a disaggregated deployment is "
                            "servelab's --prefill-replicas N --decode-replicas M (--kv-link L)",
    "--cpu-offload-gb": "weight offload to the CPU is not modelled",
    "--kv-offloading-size": "use servelab's --kv-offload-gb (a CPU tier of the prefix cache)",
    "--decode-context-parallel-size": "context parallelism is not modelled",
    "--enable-lora": "LoRA adapters are not modelled",
}
_NO_EFFECT = frozenset({
    "--host", "--port", "--uds", "--served-model-name", "--api-key", "--tokenizer",
    "--tokenizer-mode", "--revision", "--tokenizer-revision", "--code-revision",
    "--download-dir", "--load-format", "--seed", "--max-logprobs", "--generation-config",
    "--chat-template", "--response-role", "--uvicorn-log-level", "--disable-uvicorn-access-log",
    "--tool-call-parser", "--reasoning-parser", "--config-format", "--hf-config-path",
    "--distributed-executor-backend", "--allowed-origins", "--root-path", "--middleware",
    "--ssl-keyfile", "--ssl-certfile", "--logprobs-mode", "--otlp-traces-endpoint",
    "--max-parallel-loading-workers", "--model-loader-extra-config", "--hf-overrides",
    "--override-generation-config", "--structured-outputs-config", "--prefix-caching-hash-algo",
    "--stream-interval",
    # how the data-parallel ranks are spread over hosts and API servers: the deployment is
    # --data-parallel-size's either way
    "--data-parallel-size-local", "--data-parallel-address", "--data-parallel-rpc-port",
    "--data-parallel-start-rank", "--data-parallel-backend", "--api-server-count",
})
_NO_EFFECT_SWITCHES = frozenset({
    "--trust-remote-code", "--disable-log-requests", "--enable-log-requests",
    "--disable-log-stats", "--enable-auto-tool-choice", "--disable-frontend-multiprocessing",
    "--disable-fastapi-docs", "--enable-prompt-tokens-details", "--enable-server-load-tracking",
    "--enable-force-include-usage", "--disable-custom-all-reduce", "--headless",
    "--calculate-kv-scales",
})


def translate(command_line: str, catalog: Callable[[str], str] | None = None) -> VllmArgs:
    """The servelab option values a `vllm serve` command line (or its flags alone) sets.
    `catalog` maps the served model (a Hugging Face id or path) to a catalog name."""
    try:
        words = shlex.split(command_line)
    except ValueError as exc:
        raise ValueError(f"--vllm-args: cannot split the command line ({exc})") from None
    if words[:2] == ["vllm", "serve"]:
        words = words[2:]
    out = VllmArgs()
    i = 0
    while i < len(words):
        word = words[i]
        i += 1
        if not word.startswith("-"):
            if "model" in out.values:
                raise ValueError(f"--vllm-args: unexpected word {word!r} (the model is "
                                 f"{out.values['model']!r} already)")
            out.values["model"] = word
            continue
        flag, _, inline = word.partition("=")
        if flag.startswith("-O") and flag != "-O":   # -O3: the level attached
            flag, inline = "-O", flag[2:]
        flag = _ALIASES.get(flag) or ("--" + flag[2:].replace("_", "-") if flag.startswith("--")
                                      else flag)
        if flag in _UNSUPPORTED:
            raise ValueError(f"--vllm-args {flag}: {_UNSUPPORTED[flag]}")
        known = (*_VALUE_FLAGS, *_SWITCHES, *_APPROXIMATED, *_NO_EFFECT, *_NO_EFFECT_SWITCHES)
        if flag not in known:
            raise ValueError(f"--vllm-args {flag}: not a vLLM flag servelab knows; it reads "
                             f"{', '.join(sorted([*_VALUE_FLAGS, *_SWITCHES, *_APPROXIMATED]))} "
                             f"and ignores those that do not change timing (--host, --port, ...)")
        takes_value = flag in _VALUE_FLAGS or flag in _NO_EFFECT \
            or (flag in _APPROXIMATED and flag not in _NOTE_SWITCHES)
        value = inline or None
        if takes_value and value is None:
            if i >= len(words):
                raise ValueError(f"--vllm-args {flag}: expects a value")
            value = words[i]
            i += 1
        if flag in _VALUE_FLAGS:
            out.values.update(_VALUE_FLAGS[flag](flag, value))
        elif flag in _SWITCHES:
            # an explicit true/false after a switch, as vLLM's older boolean flags took it
            # (`--enable-chunked-prefill false`)
            literal = inline or (words[i] if i < len(words) else "")
            if literal.lower() in ("true", "false"):
                i += 0 if inline else 1
                if literal.lower() == "false":
                    flag = flag.replace("--no-", "--", 1) if flag.startswith("--no-") \
                        else "--no-" + flag[2:]
                    if flag not in _SWITCHES:
                        raise ValueError(f"--vllm-args {flag}: not a switch servelab reads")
            out.values.update(_SWITCHES[flag])
        elif flag in _APPROXIMATED:
            out.notes.append(f"--vllm-args {flag}: {_APPROXIMATED[flag]}")
    quantized = out.values.get("_quantization") is not None
    _resolve_dtypes(out.values)
    expert_parallel = out.values.pop("_expert_parallel", False)
    if expert_parallel:
        # EP spans the TP x DP GPUs: the data-parallel ranks form one deployment (--dp)
        out.values["dp"] = out.values.get("replicas", 1)
    if "model" in out.values and catalog is not None:
        served = out.values["model"]
        out.values["model"] = catalog(served)
        fp8 = served_weight_dtype(served) or _checkpoint_fp8(out.values["model"])
        if fp8 and not quantized:   # vLLM's --dtype sets the activations', not an FP8 checkpoint's
            out.values["weight_dtype"] = fp8
        if _is_variant(served, out.values["model"]):
            out.notes.append(f"--vllm-args: {served} is priced as the catalog's "
                             f"{out.values['model']}" + (" with fp8 weights" if fp8 else "")
                             + " (a variant has its base model's shapes)")
        if out.values.get("replicas", 1) > 1 and "dp" not in out.values \
                and _is_moe(out.values["model"]):
            # vLLM runs a MoE model's DP ranks as one deployment, in lock-step, its experts
            # sharded over the DP x TP GPUs (docs.vllm.ai serving/data_parallel_deployment)
            out.values["dp"] = out.values["replicas"]
            out.notes.append(f"--vllm-args --data-parallel-size {out.values['dp']}: a "
                             "mixture-of-experts model's ranks step in lock-step with its experts "
                             "spread over the DP x TP GPUs, as --dp; without "
                             "--enable-expert-parallel vLLM shards each expert over them (tensor "
                             "parallel), priced here as expert parallelism")
        if expert_parallel and not _is_moe(out.values["model"]):
            del out.values["dp"]   # its replicas stay independent, as without the switch
            out.notes.append(f"--vllm-args --enable-expert-parallel: {out.values['model']} has no "
                             "experts to spread; the switch changes nothing (as in vLLM)")
    return out


def _is_moe(model: str) -> bool:
    from servelab.models import load_model_spec

    try:
        return load_model_spec(model).moe is not None
    except ValueError:          # said where the model is loaded
        return False


def _resolve_dtypes(values: dict) -> None:
    """--dtype, --quantization and --kv-cache-dtype, whatever their order: FP8 quantization
    sets the weights' dtype; the KV cache follows --dtype unless --kv-cache-dtype names one."""
    dtype, quantization = values.pop("_dtype", None), values.pop("_quantization", None)
    kv_dtype = values.pop("_kv_dtype", None)
    if quantization or dtype:
        values["weight_dtype"] = quantization or dtype
    if kv_dtype == "auto":
        kv_dtype = dtype or _DTYPES["auto"]
    if kv_dtype or dtype:
        values["kv_dtype"] = kv_dtype or dtype


_VARIANT_TAIL = re.compile(r"-(instruct|chat|hf|base|it|fp8|v\d+\.\d+|\d{4})$")
"""A trailing part of a Hugging Face model name that names a variant of the same weights'
shapes: a tuned one (-Instruct, -chat, -it), a packaging (-hf, -base), a precision (-FP8:
`served_weight_dtype`), a point release (-v0.3) or a dated re-release (-2507, -0324)."""


def variant_names(name: str) -> list[str]:
    """`name` (the last part of a Hugging Face id), lower-cased, then with its variant tails
    dropped one at a time, and Meta's "Meta-" prefix ("Meta-Llama-3.1-8B-Instruct" ->
    meta-llama-3.1-8b-instruct, meta-llama-3.1-8b, llama-3.1-8b)."""
    out = [name.lower()]
    while (m := _VARIANT_TAIL.search(out[-1])) is not None:
        out.append(out[-1][:m.start()])
    if out[-1].startswith("meta-llama-"):
        out.append(out[-1][len("meta-"):])
    return out


def served_weight_dtype(served: str) -> str | None:
    """"fp8" for a Hugging Face id of an FP8 checkpoint (its name ends in -FP8 before other
    variant tails: "Qwen/Qwen3-235B-A22B-FP8"), else None (the catalog entry's own)."""
    name = served.rstrip("/").rsplit("/", 1)[-1]
    return "fp8" if any(n.endswith("-fp8") for n in variant_names(name)) else None


def _checkpoint_fp8(name: str) -> str | None:
    """"fp8" when the catalog entry (or config.json folder) `name` is an FP8 checkpoint
    (`ModelSpec.checkpoint_weight_dtype`), else None."""
    from servelab.models import load_model_spec

    try:
        return "fp8" if load_model_spec(name).checkpoint_weight_dtype == "fp8" else None
    except ValueError:    # a quantization servelab does not model: said where it is priced
        return None


def _is_variant(served: str, name: str) -> bool:
    """Whether `served` reached the catalog entry `name` only once its variant tails were
    dropped (not a local folder, the entry's own Hugging Face id or its name)."""
    import os

    from servelab.models import load_model_spec

    if os.path.exists(served) or served.lower() == name:
        return False
    return served.lower() != str(load_model_spec(name).hf_config.get("_name_or_path", "")).lower()


def catalog_model(served: str) -> str:
    """The catalog name of a served model: a local path is kept (`--model` reads a
    config.json folder); a Hugging Face id is the catalog entry whose `_name_or_path` it is
    ("meta-llama/Llama-3.1-8B" -> "llama-3.1-8b"), else the entry named like its last part
    less its variant tails (`variant_names`: "mistralai/Mixtral-8x7B-Instruct-v0.1" ->
    mixtral-8x7b, "Qwen/Qwen3-30B-A3B-Instruct-2507" -> qwen3-30b-a3b; a variant has its
    base model's shapes). Raises ValueError naming the catalog for an id it does not hold."""
    import os

    from servelab.models import catalog_name_of, catalog_names

    if os.path.exists(served):
        return served
    names = catalog_names()
    if catalog_name_of(served):
        return catalog_name_of(served)
    for name in variant_names(served.rstrip("/").rsplit("/", 1)[-1]):
        if name in names:
            return name
    raise ValueError(f"--vllm-args: model {served!r} is not in servelab's catalog "
                     f"({', '.join(names)}); give a local folder holding its config.json")
