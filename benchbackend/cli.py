"""Command line: parse, call the library, map its errors to exit codes.

Exit codes: 0 success; 1 a check failed (or a cell crashed, timed out, was unavailable);
2 usage or configuration error (for ``compare``: also files with no measurements); 3 ``compare
--fail-on-regression``: a candidate is significantly slower than the baseline by more than the
factor; 4 ``compare --fail-on-regression``: a candidate is not ok (crashed, NaN loss, ...); 130 Ctrl-C; 143 SIGTERM.
No ML framework is imported here.

Over 400 lines: ``run``'s options are the matrix's every dimension and knob, each with its help
text, and click declares them beside the function; the work itself is the library's.
"""
from __future__ import annotations

import os
import sys
from pathlib import Path
from typing import Optional

import click

from .backends import registry
from .errors import (
    BackendUnavailable,
    BenchError,
    ClusterError,
    DataError,
    EnvError,
    OutputError,
    ResultsError,
    WorkloadError,
)

DEFAULT_BACKENDS = ("torch", "tensorflow")


class UsageFailure(click.UsageError):
    """A usage/configuration error printed as one line (exit 2)."""

    def show(self, file=None) -> None:  # no usage banner: the message says what and where
        click.echo(f"Error: {self.format_message()}", err=True)


def _err(msg: str) -> None:
    click.echo(msg, err=True)


@click.group(context_settings={"help_option_names": ["-h", "--help"]})
@click.version_option(package_name="benchbackend")
def main() -> None:
    """Benchmark ML backends on the same network: timed, and checked for correctness.

    Every backend builds the same network from one YAML spec, starts from the same weights and
    sees the same batches. Each repeat runs in a fresh process; NaN losses, chance-level accuracy
    and disagreement with a NumPy reference fail the run.
    """


@main.command()
@click.argument("workloads", nargs=-1, required=True, metavar="WORKLOAD...")
@click.option("-b", "--backend", "backends_", multiple=True, metavar="NAME",
              help=f"Backend to run (repeatable): {', '.join(registry.BACKENDS)}. Default: torch and tensorflow "
                   "(or the backends --mode names).")
@click.option("--mode", "modes", multiple=True, metavar="[BACKEND:]MODE",
              help="Execution mode (repeatable): BACKEND:MODE, or a bare MODE for every backend that has it. "
                   "Default: each backend's first mode. `benchbackend list` shows them.")
@click.option("--precision", "precisions", multiple=True, metavar="[BACKEND:]PRECISION",
              help="fp32 (default), tf32 (NVIDIA Ampere or newer), bf16, fp16, fp64 (repeatable); a backend "
                   "or device without it gets an `unavailable` row.")
@click.option("--replicas", "replica_counts", multiple=True, type=click.IntRange(1), metavar="N",
              help="Data-parallel replicas (repeatable, default 1): the global batch split over N (docs/clusters.md, "
                   "\"Data parallel\"); a backend without it gets an `unavailable` row. On a CPU the cores are split.")
@click.option("--scale-lr", type=click.Choice(["none", "linear"]), default="none", show_default=True,
              help="linear: the learning rate times N for N replicas (recorded in `scale_lr`); none: the workload's.")
@click.option("--scaling", type=click.Choice(["strong", "weak"]), default="strong", show_default=True,
              help="strong: the workload's batch is the global batch, split over N replicas; weak: it is each "
                   "replica's batch (the global batch grows N times). Recorded in `scaling`.")
@click.option("--device", default="cpu", show_default=True,
              help="cpu, gpu, or a backend's own device id (e.g. a PlaidML device).")
@click.option("-r", "--repeats", default=3, show_default=True, type=click.IntRange(1),
              help="Repeats per cell, each in a fresh process.")
@click.option("--seeds", type=click.IntRange(1), metavar="N",
              help="Initial-weight seeds per cell: every repeat starts from its own initial weights (the workload's "
                   "seed and the repeat, the same on every backend), so N seeds are --repeats N; compare's "
                   "convergence verdict needs 3 or more.")
@click.option("--epochs", type=click.IntRange(1), help="Override the workload's epochs.")
@click.option("--limit", type=click.IntRange(1), help="Cap training samples (validation/test shrink in proportion, "
                                                       "not below 256); with --inference-only, cap the test samples.")
@click.option("--seed", type=int, help="Override the workload's seed (weights, data, order).")
@click.option("--data", "data_source", type=click.Choice(["auto", "real", "synthetic"]), default="auto",
              show_default=True, help="real: the canonical files (downloaded if missing); synthetic: "
                                      "generated, learnable, offline; auto: real if present.")
@click.option("--text", "text", type=click.Path(exists=True, path_type=Path), metavar="PATH",
              help="Language models: train on this UTF-8 file or folder instead of the workload's token data "
                   "(bytes at vocab 256, a byte-level BPE otherwise; split by position).")
@click.option("--data-dir", type=click.Path(file_okay=False, path_type=Path), envvar="BENCHBACKEND_DATA",
              help="Where data files live [env: BENCHBACKEND_DATA; default: ~/.cache/benchbackend/data].")
@click.option("--batch-size", "batch_sizes", multiple=True, type=click.IntRange(1), metavar="N",
              help="Training and inference batch size (repeatable: a sweep, each size its own experiment).")
@click.option("--peak-tflops", type=click.FloatRange(min=0, min_open=True),
              help="The device's datasheet peak (TFLOP/s, the run's precision): a second MFU, mfu_datasheet, "
                   "beside the one against the best GEMM probe on the device.")
@click.option("--threads", "thread_counts", multiple=True, type=click.IntRange(1), metavar="N",
              help="Intra-op threads for every backend (OpenMP/MKL too); repeatable: a sweep, each count its own "
                   "experiment, never pooled. Default: all cores. Recorded in the `threads` column.")
@click.option("--inference-only", is_flag=True, help="Skip training: build, shared weights, parity, inference passes.")
@click.option("--generate", is_flag=True,
              help="Decoder language models: instead of training and inference, greedy generation with a key/value "
                   "cache: time to first token, time per output token, tokens that must be the reference's "
                   "(docs/generation.md). Settings: the workload's `generation:` section.")
@click.option("--prompt-tokens", "prompt_tokens", multiple=True, type=click.IntRange(1), metavar="P",
              help="--generate: prompt length (repeatable: a sweep; also the cache depth the decode steps start at).")
@click.option("--new-tokens", type=click.IntRange(2), metavar="G", help="--generate: tokens generated per prompt.")
@click.option("--scenario", "scenarios", multiple=True, metavar="NAME",
              type=click.Choice(["single-stream", "multi-stream", "server", "offline"]),
              help="Inference as an MLPerf scenario on MLPerf's LoadGen (repeatable: a matrix dimension): latency "
                   "percentiles, QPS, LoadGen's verdict, its logs beside the CSV (docs/scenarios.md). Settings: the "
                   "workload's `loadgen:` section, or the five options below.")
@click.option("--min-duration", type=click.FloatRange(min=0, min_open=True), metavar="S",
              help="--scenario: LoadGen's minimum run duration in seconds (MLPerf's is 600).")
@click.option("--min-queries", type=click.IntRange(1), metavar="N", help="--scenario: LoadGen's minimum query count.")
@click.option("--target-qps", type=click.FloatRange(min=0, min_open=True), metavar="QPS",
              help="--scenario server: the offered rate of the Poisson arrivals.")
@click.option("--latency-bound-ms", type=click.FloatRange(min=0, min_open=True), metavar="MS",
              help="--scenario server: the p99 latency bound LoadGen judges the run by.")
@click.option("--multistream-samples", type=click.IntRange(1), metavar="N",
              help="--scenario multi-stream: samples per query.")
@click.option("--slo-ms", type=click.FloatRange(min=0, min_open=True), metavar="MS",
              help="--scenario server: search the highest target QPS whose p99 stays under MS (each probe a "
                   "LoadGen run and a CSV row).")
@click.option("--steps-per-execution", type=click.IntRange(1), default=32, show_default=True,
              help="Training steps per dispatch for modes that batch them (jax:scan).")
@click.option("--tune-trials", type=click.IntRange(1), default=64, show_default=True,
              help="Schedule-search budget for tuning modes (tvm:tuned).")
@click.option("--compile-cache", type=click.Choice(["warm", "cold"]), default="warm", show_default=True,
              help="warm: torch.compile, JAX and tvm:tuned keep compiled programs between runs (a second run reuses "
                   "them); cold: each cell compiles from an empty cache (compile_s and first_result_s as on a new "
                   "machine).")
@click.option("--timeout", type=click.FloatRange(min=0, min_open=True), help="Seconds per worker before it is killed.")
@click.option("--preload/--no-preload", default=True, show_default=True,
              help="CPU cells (here or on a Ray node): fork each repeat's fresh worker from a process that imported "
                   "the backend once (its import is 1-4 s a cell, untimed); --no-preload starts a new interpreter.")
@click.option("--executor", "executor_name", type=click.Choice(["local", "ray"]), default="local", show_default=True,
              help="local: one cell at a time on this machine. ray: cells as Ray tasks on a cluster "
                   "(pip install 'benchbackend[ray]'); a group's repeats run on one node.")
@click.option("--address", metavar="HOST:PORT",
              help="Ray cluster to join (--executor ray), e.g. head:6379 or auto. Default: start a local one.")
@click.option("--cells-per-node", type=click.IntRange(1), metavar="N",
              help="Ray: cells at once per node, each reserving node CPUs / N (and as many threads). "
                   "Default: 1, a cell reserves its whole node.")
@click.option("--allow-mixed-hosts", is_flag=True,
              help="Ray: let a group's repeats run on different nodes (compare warns about mixed hosts).")
@click.option("--wait-for-nodes", type=click.FloatRange(0), default=0, metavar="SECONDS",
              help="Ray: wait this long for a node that can take a cell to join (autoscaling) before calling "
                   "it unavailable.")
@click.option("--retries", type=click.IntRange(0), default=0, metavar="N",
              help="Ray: run a cell again, up to N times, when its node or Ray worker is lost mid-cell.")
@click.option("--parity-steps", default=0, type=click.IntRange(0), show_default=True,
              help="Also compare the first K training steps' losses with the reference (dropout off).")
@click.option("--order", type=click.Choice(["interleaved", "sequential"]), default="interleaved", show_default=True,
              help="interleaved: repeat r of every backend, mode and precision of a workload before repeat r+1 "
                   "of any (A B A B), so that drift of the machine does not read as a difference; sequential: "
                   "all repeats of one before the next (A A B B).")
@click.option("-o", "--output", type=click.Path(dir_okay=False, path_type=Path),
              help="CSV to write. Default: results/<timestamp>-<workloads>.csv. An existing file is kept: "
                   "the run writes beside it (NAME-2.csv, ...) unless --force.")
@click.option("--force", is_flag=True, help="Overwrite an existing -o file (and its plots folder).")
@click.option("--resume", "resume_from", type=click.Path(dir_okay=False, path_type=Path), metavar="CSV",
              help="Finish an interrupted run: give its arguments again; only the cells CSV holds no final status "
                   "for (interrupted, pending, not started) run, and their rows are appended to CSV.")
@click.option("--plots/--no-plots", default=True, show_default=True, help="Write plots next to the CSV.")
@click.option("-q", "--quiet", is_flag=True, help="No progress display (the summary and verdict still print).")
def run(workloads: tuple[str, ...], backends_: tuple[str, ...], modes: tuple[str, ...], precisions: tuple[str, ...],
        replica_counts: tuple[int, ...], scale_lr: str, scaling: str, device: str, repeats: int,
        seeds: Optional[int], epochs: Optional[int],
        limit: Optional[int], seed: Optional[int], data_source: str, text: Optional[Path],
        data_dir: Optional[Path], batch_sizes: tuple[int, ...], peak_tflops: Optional[float],
        thread_counts: tuple[int, ...],
        inference_only: bool, generate: bool, prompt_tokens: tuple[int, ...], new_tokens: Optional[int],
        scenarios: tuple[str, ...], min_duration: Optional[float], min_queries: Optional[int],
        target_qps: Optional[float], latency_bound_ms: Optional[float], multistream_samples: Optional[int],
        slo_ms: Optional[float], steps_per_execution: int, tune_trials: int, compile_cache: str,
        timeout: Optional[float], preload: bool,
        executor_name: str, address: Optional[str], cells_per_node: Optional[int], allow_mixed_hosts: bool,
        wait_for_nodes: float, retries: int, parity_steps: int, order: str, output: Optional[Path], force: bool,
        resume_from: Optional[Path], plots: bool, quiet: bool) -> None:
    """Run WORKLOAD(s) (a name in workloads/ or a .yaml path) on each backend, mode and precision.

    \b
    Examples:
      benchbackend run mnist --backend torch --data synthetic
      benchbackend run cifar10 mnist -b torch -b tensorflow --repeats 3 --epochs 2 --limit 2000 --data synthetic
      benchbackend run cifar10 -b torch --mode torch:eager --precision fp32 --precision bf16
      benchbackend run cifar10 -b torch -b tensorflow --batch-size 32 --batch-size 128
      benchbackend run mnist -b torch -b tensorflow --threads 1 --threads 2 --data synthetic
      benchbackend run cifar10 -b torch --replicas 1 --replicas 2 --parity-steps 10 --data synthetic
      benchbackend run mnist -b torch -b numpy --executor ray --address head:6379 --retries 1
      benchbackend run path/to/my_workload.yaml -b tensorflow
      benchbackend run gpt-nano -b numpy --text my_book.txt --limit 512
      benchbackend run gpt-nano -b torch -b jax --generate --prompt-tokens 64 --new-tokens 32 --data synthetic
      benchbackend run mnist -b torch -b tensorflow --repeats 5 --resume results/interrupted.csv
      benchbackend run resnet8 -b onnxruntime -b torch --inference-only --scenario single-stream --scenario offline
    """
    from . import epilogue, results
    from .run import executors, machine, outputs, progress, runner
    from .run import plan as planning
    from .run import resume as resuming
    from .spec import replicas

    if seeds is not None:
        given = click.get_current_context().get_parameter_source("repeats") != click.core.ParameterSource.DEFAULT
        if given and repeats != seeds:
            raise UsageFailure(f"--seeds {seeds} runs {seeds} repeats (each its own initial weights) and --repeats "
                               f"{repeats} says otherwise: give one of them")
        repeats = seeds
    if (prompt_tokens or new_tokens) and not generate:
        raise UsageFailure("--prompt-tokens and --new-tokens set up --generate: add --generate")
    if generate and max(replica_counts, default=1) > 1:
        raise UsageFailure(f"--replicas {max(replica_counts)} trains data-parallel replicas and --generate trains "
                           "nothing (generation runs on one device): leave out one of them")
    loadgen = {"min_duration_s": min_duration, "min_query_count": min_queries, "server_target_qps": target_qps,
               "server_latency_ms": slo_ms or latency_bound_ms, "multistream_samples": multistream_samples,
               "slo_ms": slo_ms}
    if any(v is not None for v in loadgen.values()) and not scenarios:
        raise UsageFailure("--min-duration, --min-queries, --target-qps, --latency-bound-ms, --multistream-samples "
                           "and --slo-ms set up --scenario: add --scenario")
    if scenarios and generate:
        raise UsageFailure("--scenario times a classifier's inference and --generate a decoder's: leave out one")
    if slo_ms is not None and "server" not in scenarios:
        raise UsageFailure("--slo-ms searches the Server scenario's peak rate: add --scenario server")
    inference_only = inference_only or generate
    if inference_only and max(replica_counts, default=1) > 1:
        raise UsageFailure(f"--replicas {max(replica_counts)} trains data-parallel replicas and --inference-only "
                           "trains nothing (inference runs on one device): leave out one of them")
    try:
        loaded = planning.load_workloads(workloads, batch_sizes, epochs=epochs, limit=limit, seed=seed,
                                         text=None if text is None else str(text), inference_only=inference_only,
                                         generate={"prompt_tokens": prompt_tokens, "new_tokens": new_tokens}
                                         if generate else None, scenarios=scenarios, loadgen=loadgen)
        named = [m.partition(":")[0] for m in modes if m.partition(":")[0] in registry.BACKENDS]
        names = list(dict.fromkeys(backends_ or named or DEFAULT_BACKENDS))
        choices = planning.with_threads(planning.with_replicas(
            planning.resolve(names, list(modes), list(precisions), device), replica_counts), thread_counts)
        replicas.check_batches(loaded, replica_counts, scaling)
        if executor_name == "local":
            registry.require_any(names)  # a cluster's nodes may have what this machine lacks
    except (WorkloadError, BackendUnavailable) as exc:
        raise UsageFailure(str(exc)) from None
    previous = None
    try:
        if resume_from is None:
            where = outputs.choose(output, results.default_path([w.name for w in loaded]), force=force, plots=plots)
        elif output is not None or force:
            raise OutputError("--resume CSV appends to CSV: leave out -o and --force")
        else:
            previous = resuming.read(resume_from)
            resuming.check_definitions(previous, loaded)
            where = outputs.Outputs(resume_from, outputs.plots_folder(resume_from) if plots else None)
        for warning in planning.size_warnings(loaded, limit, inference_only):
            _err(f"warning: {warning}")
        if executor_name == "local":  # a Ray node's cores are not this machine's
            for threads in thread_counts or (None,):
                for warning in replicas.oversubscribed(replica_counts, threads, device, os.cpu_count()):
                    _err(f"warning: {warning}")
    except (OutputError, WorkloadError, ResultsError) as exc:
        raise UsageFailure(str(exc)) from None
    if where.note:
        _err(f"note: {where.note}")
    out = where.csv
    try:
        writer = results.CsvWriter(out)
    except OSError as exc:
        raise UsageFailure(f"{out}: cannot write results: {exc.strerror}") from None
    options = planning.Options(steps_per_execution=steps_per_execution, tune_trials=tune_trials,
                             peak_tflops=peak_tflops, scale_lr=scale_lr, scaling=scaling, compile_cache=compile_cache)
    plan = planning.RunPlan(workloads=loaded, choices=choices, device=device, repeats=repeats,
                            data_source=data_source, data_dir=data_dir, parity_steps=parity_steps,
                            inference_only=inference_only, options=options, order=order, generate=generate)
    try:
        executor = executors.make(executor_name, address, cells_per_node, allow_mixed_hosts, timeout, preload,
                                  wait_for_nodes, retries)
    except ClusterError as exc:
        raise UsageFailure(str(exc)) from None
    def warn_if_busy() -> None:  # once the data is ready: the last word before the first cell, after any error
        busy = machine.busy_warning()
        if busy:
            _err(f"warning: {busy}")

    # a Ray node's load is its own: each cell measures it there
    r = runner.Runner(plan, executor, writer, progress.display(quiet), previous,
                      ready=warn_if_busy if executor_name == "local" else None)
    try:
        with runner.sigterm_interrupts():
            cells = r.run()
    except KeyboardInterrupt as exc:
        _err(f"interrupted: {writer.rows} rows written to {out}; the same command with --resume {out} runs the rest")
        epilogue.summary(r.results, out if writer.rows else None, plots)
        sys.exit(143 if isinstance(exc, runner.Terminated) else 130)
    except DataError as exc:
        _err(f"Error: {exc}")
        if writer.rows:
            _err(f"{writer.rows} rows written to {out}")
        sys.exit(2)
    epilogue.summary(cells, out if writer.rows else None, plots)
    statuses = [c.status for c in cells] + r.resumed  # a resumed run answers for the cells that had finished too
    sys.exit(0 if statuses and all(s == "ok" for s in statuses) else 1)


@main.command(name="list")
@click.option("--no-probe", is_flag=True, help="Skip asking each installed backend for its devices (faster).")
@click.option("--refresh", is_flag=True, help="Probe every backend's devices again instead of using the cache "
                                            "(after a driver or device change).")
@click.option("--markdown", is_flag=True, help="Print the backends as the README's Markdown table and exit.")
def list_(no_probe: bool, refresh: bool, markdown: bool) -> None:
    """Show the workloads and the backends: installed or not, version, devices, modes, precisions.

    Devices come from each backend's own process (seconds each, in parallel), cached per installed
    version: later calls answer at once; --refresh probes again."""
    from . import inventory

    if markdown:
        click.echo(inventory.markdown_table())
        return
    click.echo(inventory.render(probe_devices=not no_probe, refresh=refresh, progress=_err))


@main.command()
@click.argument("paths", nargs=-1, required=True, metavar="CSV_OR_DIR...")
@click.option("--baseline", metavar="BACKEND[:MODE]",
              help="Backend the others are compared with. Default, per experiment: the first backend in "
                   "registry order (`benchbackend list`) whose every repeat is ok; the numpy reference only "
                   "when nothing else is.")
@click.option("--candidate", multiple=True, help="Backend(s) checked by --fail-on-regression (repeatable).")
@click.option("--format", "fmt", type=click.Choice(["table", "markdown", "csv", "json"]), default="table",
              show_default=True)
@click.option("--plots", type=click.Path(file_okay=False), help="Write PNG plots and an index.html to this folder.")
@click.option("--skip-bad", is_flag=True,
              help="Skip unreadable or invalid files (with a warning) instead of failing, and leave out the repeats "
                   "timed while other processes held the machine (which otherwise withhold their group's verdicts).")
@click.option("--metric", type=click.Choice(["epoch-time", "time-to-accuracy", "compile-time", "first-result"]),
              default="epoch-time", show_default=True,
              help="What ranks the training table: the steady epoch time, or the time to accuracy (training seconds "
                   "until the validation accuracy first reached the workload's checks.target_accuracy; repeats "
                   "that never reached it are counted apart, and a backend where none did is not ranked); or both "
                   "tables: compile-time (the first epoch or pass less a steady one) or first-result (the worker "
                   "process's start to the end of its first step).")
@click.option("--fail-on-regression", type=click.FloatRange(min=1.0), metavar="FACTOR",
              help="Exit 3 when a --candidate (default: every non-baseline backend) is slower than the baseline "
                   "by more than FACTOR and significantly so (its 95% CI lies below 1); exit 4 when a "
                   "candidate is not ok (crashed, NaN loss, ...).")
def compare(paths: tuple[str, ...], baseline: Optional[str], candidate: tuple[str, ...], fmt: str,
            plots: Optional[str], skip_bad: bool, metric: str, fail_on_regression: Optional[float]) -> None:
    """Compare results: which backend is faster, by how much, whether it is significant, and correct.

    Rows are compared only within one experiment definition (workload hash: model, training, sizes
    after --limit, epochs, batch, seed; data source; threads; mode; precision). Several definitions of
    one workload are separate sections, labelled by what differs, e.g. "mnist (limit 1024)".
    Each "vs BASELINE" cell is the speed-up BASELINE's time / this time (>1: faster) with its 95% CI
    (Welch's t on log per-repeat times); "faster"/"slower" only where the CI leaves 1 out, none where
    it spans 1000x or more ("too few repeats", "unstable"), and none where other processes held the
    machine while either side was timed ("no verdict (machine busy)"). Only ok repeats feed the
    timings. MFU (achieved FLOP/s over the recorded peak) is shown beside throughput; a --batch-size
    sweep gives one section per batch size and a throughput-vs-batch figure with --plots.

    \b
    Examples:
      benchbackend compare results/*.csv
      benchbackend compare results/tta.csv --metric time-to-accuracy
      benchbackend compare results/a.csv results/b.csv --baseline tensorflow --format markdown
      benchbackend compare results/*.csv --plots report/
    """
    from .analysis import compare as cmp

    try:
        outcome = cmp.run_compare(list(paths), baseline=baseline, candidate=candidate, fmt=fmt,
                                  skip_bad=skip_bad, fail_on_regression=fail_on_regression, metric=metric)
        if plots is not None and outcome.frame is not None:
            from .analysis import report

            made = report.write_report(outcome.frame, Path(plots), summary_text=outcome.table_text,
                                       warnings=outcome.warnings, baseline=baseline, metric=metric)
            _err(f"report: {made[-1]}")
    except ResultsError as exc:
        raise UsageFailure(str(exc)) from None
    click.echo(outcome.text)
    for warning in outcome.warnings:
        _err(f"warning: {warning}")
    global _no_teardown
    _no_teardown = True
    sys.exit(outcome.exit_code)


@main.command()
@click.argument("backend", type=click.Choice(sorted(registry.isolated_envs())))
@click.option("--path", type=click.Path(file_okay=False, path_type=Path),
              help="Where to build the environment [default: ~/.local/share/benchbackend/envs/NAME, "
                   "or $BENCHBACKEND_ENVS/NAME]. A folder benchbackend did not create is never touched.")
@click.option("--check", is_flag=True, help="Report the environment's state without changing anything.")
def setup(backend: str, path: Optional[Path], check: bool) -> None:
    """Build (or repair, or reuse) the isolated environment a backend needs.

    A backend whose pins clash with the main environment (PlaidML 0.7 needs Keras 2.2.4; Chainer
    7.8.1 needs numpy<2) runs from a virtual environment of its own, built from
    configs/<name>-requirements.txt; `run -b NAME` then uses it automatically.
    """
    from .backends import envs

    spec = registry.BACKENDS[registry.isolated_envs()[backend]]
    probe = envs.Probe(spec.name, spec.target, spec.env("cpu"))
    try:
        status = envs.setup(backend, probe, path=path, check_only=check, log=_err)
    except EnvError as exc:
        _err(f"Error: {exc}")
        sys.exit(1)
    click.echo(f"{status.name}: {'ready' if status.ready else 'not ready'} at {status.path}")
    for dist, ver in status.versions.items():
        click.echo(f"  {dist} {ver}")
    if status.devices:
        click.echo(f"  devices: {', '.join(status.devices)}")
    if status.message and not status.ready:  # when ready, the message repeats the lines above
        click.echo(f"  {status.message}")
    sys.exit(0 if status.ready else 1)


#: compare sets it: it holds nothing to release, so ``entry`` skips the interpreter's teardown
#: of pandas and NumPy (0.1 s of a 0.5 s command); click.echo has flushed what it printed.
_no_teardown = False


def entry() -> None:
    """Console-script entry point: a library error that slipped through is one line, exit 2."""
    try:
        main()
    except BenchError as exc:
        _err(f"Error: {exc}")
        sys.exit(2)
    except SystemExit as exc:
        if _no_teardown and isinstance(exc.code, int):
            import os

            os._exit(exc.code)
        raise


#: The checkout's root, where ``schema --update`` without a FILE finds the pages that hold the references.
_CHECKOUT = Path(__file__).resolve().parent.parent


@main.command()
@click.option("--update", "files", multiple=True, is_flag=False, flag_value="", metavar="[FILE]",
              help="Rewrite the generated references between FILE's marker comments instead of printing one: "
                   "the workload reference, the CSV column reference, or both, whichever FILE holds; repeatable. "
                   "Without FILE: this checkout's docs/workloads.md and docs/results.md.")
@click.option("--columns", "csv_columns", is_flag=True,
              help="Print the results CSV's column reference instead of the workload's.")
def schema(files: tuple[str, ...], csv_columns: bool) -> None:
    """Print the workload YAML reference as Markdown: every field with its type, default, allowed
    values and meaning, generated from the validation models (docs/workloads.md holds this text); with
    --columns, the results CSV's columns, generated from their one declaration (docs/results.md)."""
    from . import columns
    from .spec import schema as reference

    if not files:
        click.echo((columns if csv_columns else reference).markdown(), nl=False)
        return
    paths: list[Path] = []
    for name in files:
        if name:
            paths.append(Path(name))
            continue
        pages = [_CHECKOUT / reference.PAGE, _CHECKOUT / columns.PAGE]
        missing = [str(p) for p in pages if not p.is_file()]
        if missing:
            raise UsageFailure(f"{', '.join(missing)}: not found (benchbackend is not run from a checkout): "
                               "name the file, `--update FILE`")
        paths += [p for p in pages if p not in paths]
    new: list[tuple[Path, str, list[str]]] = []  # every file is checked before any is written
    for path in paths:
        if not path.is_file():
            raise UsageFailure(f"{path}: no such file")
        try:
            text = path.read_text(encoding="utf-8")
            updated = []
            if reference.BEGIN in text:
                text = reference.replace_block(text)
                updated.append("workload reference")
            if columns.holds_block(text):
                text = columns.replace_block(text)
                updated.append("column reference")
            if not updated:
                raise ValueError(f"the markers are missing: put {reference.BEGIN!r} and {reference.END!r} where the "
                                 f"workload reference goes, or {columns.BEGIN!r} and {columns.END!r} where the column "
                                 "reference goes")
        except ValueError as exc:
            raise UsageFailure(f"{path}: {exc}") from None
        except OSError as exc:
            raise UsageFailure(f"{path}: cannot read: {exc.strerror}") from None
        new.append((path, text, updated))
    for path, text, updated in new:
        try:
            path.write_text(text, encoding="utf-8")
        except OSError as exc:
            raise UsageFailure(f"{path}: cannot write: {exc.strerror}") from None
        _err(f"updated the {' and the '.join(updated)} in {path}")
