"""The results CSV's columns, declared once: each one's name, type, unit, meaning and the schema
version that added it. ``results`` derives its column order and numeric columns from here, and
the column reference in ``docs/results.md`` is generated from it (``benchbackend schema --update``;
``tests/test_schema_doc.py`` fails on drift). Imports nothing: a leaf every room may read.
"""
from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Column:
    """One CSV column: ``kind`` is ``text``, ``number`` (read as a float; empty is unknown) or
    ``flag`` (``True``/``False``); ``unit`` is "" where there is none."""

    name: str
    kind: str
    meaning: str
    unit: str = ""
    version: int = 1


def _c(name: str, kind: str, meaning: str, unit: str = "", version: int = 1) -> Column:
    return Column(name, kind, meaning, unit, version)


T, N, F = "text", "number", "flag"
#: Every column, in the file's order. Add columns at the end, with the version that adds them.
DECLARED: tuple[Column, ...] = (
    _c("schema_version", N, "the schema the row was written under; a newer one than this benchbackend reads is "
                            "refused"),
    _c("run_id", T, "one run (`run` command); with `cell_order` and `attempt` it names a cell"),
    _c("timestamp", T, "when the row was written (local time, ISO 8601)"),
    _c("workload", T, "the workload's name"),
    _c("workload_hash", T, "digest of the definition: model, training, sizes after `--limit`, epochs, batch, seed"),
    _c("backend", T, "the backend (`benchbackend list`)"),
    _c("backend_version", T, "the framework's version, as the worker imported it"),
    _c("device", T, "the device the backend really used, one name per device across backends: `cpu`, `gpu:N`, "
                    "anything else lowercased as the backend names it"),
    _c("mode", T, "the backend's execution mode (`eager`, `compile`, `jit`, ...)"),
    _c("repeat", N, "the repeat, 1..R: each a fresh worker process"),
    _c("phase", T, "`build` (construction, shared weights, compilation that needs no data, the copy to the "
                   "device), `tune` (schedule search), `parity` (forward check; with `--parity-steps` a second row "
                   "for the trajectory), `train_epoch`, `inference`, `run` (every cell's last row: its final "
                   "status, and in `message` why it is not `ok`)"),
    _c("epoch", N, "a `train_epoch` row's epoch, 1..E; empty on every other row"),
    _c("samples", N, "samples the row's timed work went through (an epoch's, a pass's, the parity batch)"),
    _c("seconds", N, "the timed region's wall time, the device synced inside the clock (training only: "
                     "validation is measured apart)", "s"),
    _c("samples_per_s", N, "`samples` / `seconds`", "samples/s"),
    _c("loss", N, "the epoch's mean training loss"),
    _c("accuracy", N, "the epoch's training accuracy, or an inference pass's on the test set (a `scenario` "
                      "row: LoadGen's accuracy-mode outputs')"),
    _c("val_loss", N, "the validation loss after the epoch, outside the clock"),
    _c("val_accuracy", N, "the validation accuracy after the epoch, outside the clock"),
    _c("status", T, "the cell's final status on every row (docs/results.md \"Checks and statuses\")"),
    _c("message", T, "a failure's reason, on the `run` row"),
    _c("host", T, "the machine that measured the row (a Ray node's own)"),
    _c("os", T, "its operating system"),
    _c("python", T, "the worker's Python"),
    _c("cpu", T, "its CPU model and logical CPU count"),
    _c("gpu", T, "the GPU's name on a GPU cell"),
    _c("parity_max_abs", N, "largest absolute difference of the forward outputs from the float64 NumPy reference "
                            "(a `parity` row)"),
    _c("parity_max_rel", N, "the same, relative"),
    _c("parity_step", N, "the trajectory row's first step that disagrees; empty when all agree"),
    _c("params", N, "the network's parameters, as built (checked against the spec)"),
    _c("flops_per_sample", N, "the forward FLOPs of one sample, from the spec (a multiply-add counts 2)", "FLOP"),
    _c("peak_rss_mb", N, "the worker's peak resident memory so far", "MiB"),
    _c("steps", N, "optimizer steps of an epoch; on the trajectory row, the steps checked"),
    _c("requested_device", T, "what `--device` asked for; `compare` groups by it"),
    _c("precision", T, "`fp32`, `tf32`, `bf16`, `fp16`, `fp64`", version=2),
    _c("threads", N, "the intra-op threads the cell used (per replica); part of the experiment's definition",
       version=2),
    _c("data_source", T, "`synthetic`, `real` or the user's file", version=2),
    _c("inference_only", F, "the cell trained nothing (`--inference-only`, or an inference runtime)", version=2),
    _c("definition", T, "the definition, readably: `train=1024 val=256 test=256 epochs=2 batch=32 ...`", version=2),
    _c("achieved_flops", N, "FLOP/s of the timed row: `flops_per_sample` x samples/s, a training sample counted "
                            "3x", "FLOP/s", 2),
    _c("mfu", N, "`achieved_flops` over `peak_flops`; never above 1 (then empty, and `mfu_missing` says why)",
       version=2),
    _c("peak_flops", N, "the peak `mfu` is against: the best GEMM probe taken on the device in the precision with "
                        "the threads, whichever framework took it; one per device and precision in a file (its "
                        "final rewrite gives every row the one `compare` uses). Before schema 12, `--peak-tflops` "
                        "where given", "FLOP/s", 2),
    _c("peak_source", T, "where `peak_flops` came from", version=2),
    _c("time_to_accuracy_s", N, "training seconds until the validation accuracy first reached "
                                "`checks.target_accuracy` (`inf`: never)", "s", 2),
    _c("cell_order", N, "the cell's place in the run's order (0 first)", version=3),
    _c("notes", T, "facts about a row that are not a failure's reason (build details, the trajectory's verdict, "
                   "a busy machine)", version=3),
    _c("limit", N, "training samples per epoch (what `--limit` sets)", version=3),
    _c("epochs", N, "epochs of the definition", version=3),
    _c("batch_size", N, "the training batch (the global batch; each replica's under `--scaling weak`)", version=3),
    _c("inference_batch_size", N, "the inference batch", version=3),
    _c("seed", N, "the seed of weights, data and order", version=3),
    _c("pass", N, "an `inference` row's pass (1 carries warm-up)", version=4),
    _c("attempt", N, "1, or 2, 3, ... for a cell `--retries` ran again after its Ray node was lost (the lost "
                     "attempt's rows read `retried`)", version=5),
    _c("data_sha256", T, "checksum of the cell's arrays (every split and the epoch orders)", version=5),
    _c("data_origin", T, "where the worker found them: `local`, `node-cache`, `generated`, `shared-path`, "
                         "`fetched`", version=5),
    _c("math_mode", T, "what the cell set for float32 matmuls: `ieee` or `tf32`", version=5),
    _c("data_on_device", F, "the arrays were on the device before the clock (else each batch was copied inside "
                            "it)", version=6),
    _c("peak_device_mb", N, "the device's peak memory from the framework's own counter; empty on a CPU", "MiB", 6),
    _c("replicas", N, "data-parallel replicas (`--replicas`)", version=7),
    _c("scale_lr", T, "`--scale-lr`: `none` or `linear`", version=7),
    _c("scaling", T, "`--scaling`: `strong` or `weak`; `strong` for one replica", version=8),
    _c("comm_s", N, "a data-parallel epoch's seconds in gradient communication, where the engine exposes them",
       "s", 8),
    _c("foreign_cpu_share", N, "the share of the cell's cores (threads x replicas) that other processes held "
                               "during a timed region, 0 to 1 (docs/results.md \"Trust\")", version=9),
    _c("throttle_events", N, "thermal throttling events during a timed region, where the kernel counts them",
       version=9),
    _c("load_avg", N, "the 1-minute load average as the cell started", version=9),
    _c("cpu_mhz", N, "the cores' mean clock as the cell started", "MHz", 9),
    _c("gpu_other_procs", N, "other processes on the cell's GPU as it started (NVML)", version=9),
    _c("gpu_clock_mhz", N, "the GPU's SM clock as the cell started (NVML)", "MHz", 9),
    _c("tokens_per_s", N, "a language model's `samples_per_s` x its context (the tokens of a sequence); empty for "
                          "other networks; a `prefill` row's B x P over its seconds, a `decode` row's tokens over "
                          "its seconds (`--generate`)", "tokens/s", 10),
    _c("prompt_tokens", N, "`--generate`: the prompt length P of a `prefill`, `decode` or `greedy` row", version=11),
    _c("new_tokens", N, "`--generate`: the tokens G generated after each prompt", version=11),
    _c("step", N, "a `decode` row's step, 1..G-1 (the first token comes from the prefill)", version=11),
    _c("cache_depth", N, "a `decode` row's tokens already in the key/value cache as the step begins (P + step - 1)",
       version=11),
    _c("cache_bytes", N, "a `prefill` row's key/value cache as held after the pass, measured from its arrays", "B",
       11),
    _c("cache_bytes_expected", N, "the same from the spec: 2 x layers x kv_heads x head_dim x positions x batch x "
                                  "bytes of `generation.cache`", "B", 11),
    _c("tokens_matched", N, "a `greedy` row's generated tokens equal to the float64 reference's, before each "
                            "prompt's first tie, over every prompt", version=11),
    _c("tie_step", N, "a `greedy` row's earliest step whose reference top-two outputs are too close for the "
                      "precision to order (the comparison stops there)", version=11),
    _c("audited", N, "an `inference` row's test samples whose timed outputs were checked against an untimed pass "
                     "of them (1%, at least 100, chosen by the seed); a `scenario` row's timed responses checked "
                     "against LoadGen's accuracy-mode outputs (every 100th and a seeded 100: at least 1%, at least "
                     "100)", version=11),
    _c("audit_sample", N, "an `inference` or `scenario` row's first audited test sample whose timed output differs "
                          "(`audit_failed`), or a `scenario` row's first whose accuracy-mode output is beyond the "
                          "precision's tolerance of the reference's; empty when all agree", version=11),
    _c("mismatch_step", N, "a `greedy` row's first step whose token differs from the reference's before a tie "
                           "(`generation_mismatch`)", version=11),
    _c("peak_datasheet_flops", N, "`--peak-tflops`: the device's datasheet peak in the precision, as the user gave "
                                  "it", "FLOP/s", 12),
    _c("mfu_datasheet", N, "`achieved_flops` over `peak_datasheet_flops` (MLPerf's MFU); never above 1", version=12),
    _c("mfu_missing", T, "why a timed row's `mfu` (or `mfu_datasheet`) is empty: no probe on the device, or the "
                         "peak is below the row's achieved FLOP/s, so that peak is too low", version=12),
    _c("cpu_bf16", F, "a CPU cell's CPU has bf16 arithmetic (`avx512_bf16`, `amx_bf16` or Arm's `bf16` in "
                      "/proc/cpuinfo); `False`: bf16 is emulated there, often slower than fp32; empty on a GPU cell "
                      "or where unknown", version=12),
    _c("compile_s", N, "on a cell's second `train_epoch` (`inference`) row: the first epoch's (pass's) seconds "
                       "minus this one's, the same steps: what the first dispatch cost beyond a steady one "
                       "(tracing, compilation, autotuning, first touches); near 0, within noise, where nothing "
                       "compiles", "s", 12),
    _c("first_result_s", N, "on the same row, in the cell's first timed phase: the worker process's start (a "
                            "preloaded worker's fork, its framework already imported) to the end of its first "
                            "step: the wait before the first epoch (pass) began, less the harness's own checks in it "
                            "(GEMM probe, parity), plus that epoch less its other steps at this row's steady speed",
       "s", 12),
    _c("quality_metric", T, "the workload's `quality.metric`: what the quality gate reads (`val_accuracy`: the last "
                            "epoch's)", version=12),
    _c("quality_target", T, "the gate's target: `0.99 of fp32` (the same backend's fp32 cells), `0.99 of reference` "
                            "(the NumPy reference's) or a value (absolute)", version=12),
    _c("quality_samples", N, "the samples the metric is measured on (validation), which bound its noise", version=12),
    _c("quality", N, "the cell's metric, written when the run ends (empty: a cell that trains nothing)", version=12),
    _c("quality_ratio", N, "`quality` over the baseline's median (absolute target: over the target)", version=12),
    _c("gate", T, "`pass`, `fail`, `not_judged` or `baseline_varies` (docs/results.md \"The quality gate\"); "
                  "empty where nothing trained", version=12),
    _c("gate_reason", T, "what the gate compared, or why it could not judge", version=12),
    _c("epochs_to_target", N, "the first epoch whose validation accuracy reached `checks.target_accuracy` (`inf`: "
                              "never), on every row of a cell that trained; compare's convergence verdict reads it",
       version=12),
    _c("scenario", T, "`--scenario`: the MLPerf scenario the cell's inference ran on LoadGen (`single-stream`, "
                      "`multi-stream`, `server`, `offline`); empty without it", version=12),
    _c("latency_p50_ms", N, "a `scenario` row's median latency (LoadGen's; a MultiStream query's, a sample's "
                            "otherwise, from its issue to its completion)", "ms", 12),
    _c("latency_p90_ms", N, "its 90th percentile (SingleStream's metric)", "ms", 12),
    _c("latency_p99_ms", N, "its 99th percentile (MultiStream's metric; Server's bound is on it)", "ms", 12),
    _c("latency_p999_ms", N, "its 99.9th percentile", "ms", 12),
    _c("latency_mean_ms", N, "its mean", "ms", 12),
    _c("early_stopping_ms", N, "LoadGen's early-stopping estimate of the scenario's percentile (p90 SingleStream, "
                               "p99 MultiStream): an upper bound that holds with 99% confidence at this query count; "
                               "empty where LoadGen gives none (too few queries, Server, Offline)", "ms", 12),
    _c("qps", N, "a `scenario` row's completed queries per second (Server, Offline: samples per second)",
       "queries/s", 12),
    _c("target_qps", N, "Server: the offered rate of the Poisson arrivals (a peak search's probe rate)", "queries/s",
       12),
    _c("latency_bound_ms", N, "Server: the p99 bound LoadGen judged the run by (`--latency-bound-ms`, `--slo-ms`)",
       "ms", 12),
    _c("samples_per_query", N, "a `scenario` row's samples per query (MultiStream's N, Offline's whole run)",
       version=12),
    _c("query_count", N, "a `scenario` row's queries LoadGen issued and saw complete", version=12),
    _c("loadgen_valid", T, "LoadGen's own verdict on the run: `valid` or `invalid` (minimum duration and query "
                           "count, early stopping, Server's latency bound)", version=12),
    _c("below_mlperf_minimum", F, "the run was shorter than MLPerf's minimum duration (600 s) or query count: "
                                  "never a compliant result, whatever LoadGen's verdict", version=12),
    _c("loadgen_log", T, "the folder of LoadGen's `mlperf_log_summary.txt` and `mlperf_log_detail.txt` for the "
                         "row, relative to the CSV's folder when beside it", version=12),
    _c("performance_hint", T, "the performance hint the runtime compiled with (OpenVINO's LATENCY or THROUGHPUT, "
                              "following the scenario); empty where there is none", version=12),
    _c("probe", N, "`--slo-ms`: the peak search's probe, 1..K, each a LoadGen run at `target_qps`", version=12),
    _c("top1_agreement", N, "a `scenario` row's share of the test samples whose top class in LoadGen's accuracy-mode "
                            "run (every sample once, its output logged) is the NumPy reference's; empty where the "
                            "adapter cannot give back weights it trained", version=13),
    _c("accuracy_log", T, "the folder of the LoadGen accuracy-mode run a `scenario` row's `top1_agreement`, "
                          "`accuracy` and audit were read from (its `mlperf_log_accuracy.json`)", version=13),
    _c("loss_audited", N, "a `train_epoch` row's steps whose reported loss was recomputed outside the clock (the "
                          "first step of every epoch, epoch 1's first `--parity-steps` too); 0 where steps cannot be "
                          "recomputed (dropout: only the epoch's mean is checked); empty where the adapter hands "
                          "back no step losses (docs/results.md \"The loss audit\")", version=13),
    _c("audit_step", N, "a `train_epoch` row's first step whose reported loss differs from its recomputation, 0 "
                        "when the epoch's loss is not the mean of its step losses (`audit_failed`); empty when all "
                        "agree", version=13),
    _c("compile_cache", T, "`--compile-cache` (`warm` or `cold`) where the cell's framework keeps compiled programs "
                           "between runs (torch.compile's inductor cache, JAX's compilation cache, tvm:tuned's "
                           "tuning database); empty where it keeps none. compare groups `cold` cells apart (mode "
                           "`compile cold`)", version=14),
    _c("compile_cache_hit", F, "that cache held compiled programs of this very cell (its workload, mode and "
                               "precision) as it started: a warm `compile_s`; False for the first run and every "
                               "cold one", version=14),
)

#: The page that holds the column reference, from the checkout's root (``benchbackend schema --update``).
PAGE = "docs/results.md"
BEGIN = f"<!-- BEGIN column reference (generated: benchbackend schema --update {PAGE}) -->"
END = "<!-- END column reference -->"
#: How every version of the begin marker starts (it named README.md before the reference moved to ``PAGE``),
#: so that a stale marker is found and rewritten rather than missed.
_BEGIN_PREFIX = "<!-- BEGIN column reference"


def markdown() -> str:
    """The column reference (``PAGE``): one table row per declared column."""
    rows = ["| column | schema | type | unit | meaning |", "| --- | --- | --- | --- | --- |"]
    for c in DECLARED:
        rows.append(f"| `{c.name}` | {c.version} | {c.kind} | {c.unit} | {c.meaning} |")
    return "\n".join(rows) + "\n"


def block() -> str:
    return f"{BEGIN}\n{markdown()}{END}"


def holds_block(text: str) -> bool:
    """Whether ``text`` has the column reference's begin marker (any version of it)."""
    return _BEGIN_PREFIX in text


def replace_block(text: str) -> str:
    """``text`` with the generated reference between the markers (ValueError when they are missing)."""
    start, end = text.find(_BEGIN_PREFIX), text.find(END)
    if not 0 <= start < end:
        raise ValueError(f"the markers are missing: put {BEGIN!r} and {END!r} where the column reference goes")
    return text[:start] + block() + text[end + len(END):]


def current_block(text: str) -> str:
    """The column reference block that ``text`` holds now ("" when it has none)."""
    start, end = text.find(_BEGIN_PREFIX), text.find(END)
    return text[start:end + len(END)] if 0 <= start < end else ""
