"""Command line: `tieredkv run [CONFIG]`, `tieredkv serve [CONFIG] [--model M]`,
`tieredkv bench CONFIG --base-url URL`, `tieredkv --version`.

Each subcommand has its parser and one handler (`COMMANDS`); a handler imports what it runs, so
that `tieredkv --help` starts without torch.

Every error `tieredkv run` finds before the workload runs (the config, the trace, the results folder, a locked
store, a busy port) is one `tieredkv: error: ...` line and exit status 2; Ctrl-C writes the partial
results and exits with status 130. A run that failed, or whose every request failed (`tieredkv bench`
too), exits with status 1.
"""

from __future__ import annotations

import argparse
import contextlib
import logging
import sys
import traceback
from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING

from tieredkv import __version__, serve

if TYPE_CHECKING:
    from tieredkv.experiment.metrics import Summary

DEFAULT_CONFIG = "configs/demo.yaml"
EXIT_FAILED_RUNS, EXIT_ERROR, EXIT_INTERRUPTED = 1, 2, 130


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="tieredkv",
        description="Tiered KV cache offloading engine for LLM inference (GPU HBM, pinned CPU, NVMe).",
    )
    parser.add_argument("--version", action="version", version=f"%(prog)s {__version__}")
    commands = parser.add_subparsers(dest="command", metavar="COMMAND")
    run = commands.add_parser(
        "run", help="run a YAML experiment and print its summary",
        description="Build the engine from a YAML file, run its workload with a progress bar and print a "
        "summary table (requests, tokens/s, TTFT, TPOT, inter-token and end-to-end latency percentiles, prefix "
        "hits per tier, preemptions, bytes moved); writes OUT/<name>/result.json and PNG plots (the folder is "
        "emptied first). Ctrl-C stops early and keeps what ran.",
    )
    run.add_argument("config", nargs="?", default=DEFAULT_CONFIG,
                     help=f"YAML file, or the name of a config shipped with tieredkv (default: {DEFAULT_CONFIG})")
    run.add_argument("--compare", action="store_true",
                     help="run every entry of the file's `variants:` list, print them side by side and write "
                     "comparison.json and overlaid plots")
    run.add_argument("--variants", metavar="NAME,NAME,...",
                     help="compare only these variants, in this order (serving figures drift with the order: "
                     "run a comparison both ways)")
    run.add_argument("--sweep", metavar="KEY=V1,V2,...",
                     help="run each variant at each load point of a workload key (e.g. rate=0.5,1,2,4; overrides "
                     "the file's sweep: section) and report goodput under the file's slo: section")
    run.add_argument("--out", default="results", help="where result.json and the plots go (default: results/)")
    run.add_argument("--prompt-ids", action="store_true",
                     help="keep every request's prompt token ids in result.json (output ids are always kept)")
    run.add_argument("--no-progress", action="store_true", help="hide the progress bar")
    run.add_argument("--in-process", action="store_true",
                     help="run each engine in a thread of this process, beside the clients (default: in a process "
                     "of its own, as `tieredkv serve` runs it; in-process, the clients' event loop and the engine "
                     "take turns on one GIL, which delays each token's delivery by milliseconds)")
    run.add_argument("--prometheus-port", type=serve.port_number, metavar="PORT",
                     help="serve the engine's stats and the clients' latencies at :PORT/metrics while the run "
                     "lasts (needs prometheus-client)")
    run.add_argument("-v", "--verbose", action="store_true", help="log at DEBUG level (same as --log-level debug)")
    run.add_argument("--log-level", default="info", choices=("debug", "info", "warning", "error"),
                     help="logging level (default: info: a start-up summary of each engine)")
    serve.add_parser(commands)
    _add_bench_parser(commands)
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.command is None:
        parser.print_help()
        return 0
    return COMMANDS[args.command](args)


def _run_command(args: argparse.Namespace) -> int:
    """`tieredkv run`: logs at the chosen level; 2 and one `tieredkv: error:` line on an error
    found before the workload runs, 130 on Ctrl-C, 1 when a run of several failed (the others
    ran; one `tieredkv: failed:` line each)."""
    level = "debug" if args.verbose else args.log_level
    with _logging(level):
        try:
            return _run(args)
        except (ValueError, OSError) as err:
            if level == "debug":
                traceback.print_exc()
            print(f"tieredkv: error: {err}", file=sys.stderr)
            return EXIT_ERROR
        except KeyboardInterrupt:
            print("tieredkv: interrupted", file=sys.stderr)
            return EXIT_INTERRUPTED


@contextlib.contextmanager
def _logging(level: str) -> Iterator[None]:
    """Log records of `level` and above to stderr while the command runs."""
    root = logging.getLogger()
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(logging.Formatter("%(levelname)s %(name)s: %(message)s"))
    saved = root.level
    root.addHandler(handler)
    root.setLevel(level.upper())
    try:
        yield
    finally:
        root.removeHandler(handler)
        root.setLevel(saved)


def _run(args: argparse.Namespace) -> int:
    from tieredkv.config import find_config
    from tieredkv.experiment.harness import (
        format_comparison,
        format_summary,
        format_sweep,
        run_experiment,
    )
    from tieredkv.experiment.prometheus import PrometheusExporter

    exporter = None
    try:
        if args.prometheus_port is not None:
            exporter = PrometheusExporter(args.prometheus_port)
            print(f"Prometheus metrics at http://localhost:{exporter.port}/metrics", flush=True)
        outcome = run_experiment(
            find_config(args.config), args.out, args.compare, use_tqdm=not args.no_progress,
            on_summary=lambda s: print(format_summary(s), flush=True), exporter=exporter, sweep=args.sweep,
            keep_prompt_ids=args.prompt_ids, only=args.variants.split(",") if args.variants is not None else None,
            engine_process=not args.in_process,
        )
    finally:
        if exporter is not None:
            exporter.close()
    if outcome.sweep is not None:
        print(format_sweep(outcome.sweep))
    elif len(outcome.summaries) > 1:
        print(format_comparison(outcome.summaries))
    refused = [failure for s in outcome.summaries if (failure := _all_failed(s))]
    for failure in [*outcome.failed, *refused]:
        print(f"tieredkv: failed: {failure}", file=sys.stderr)
    if outcome.interrupted:
        print(f"interrupted: partial results in {outcome.folder}/", file=sys.stderr)
        return EXIT_INTERRUPTED
    print(f"results in {outcome.folder}/")
    return EXIT_FAILED_RUNS if outcome.failed or refused else 0


def _all_failed(summary: Summary) -> str | None:
    """What to say of a run whose every request failed: it ran nothing, as much a failure as a
    run that stopped; None if some request went through."""
    if summary.requests and summary.errors == summary.requests:
        return f"{summary.name}: all {summary.requests} of its requests failed (each one's error is in its result.json)"
    return None


def _add_bench_parser(commands: argparse._SubParsersAction) -> None:
    bench = commands.add_parser(
        "bench", help="replay a YAML experiment's workload against an OpenAI-compatible server",
        description="Send the file's workload (its base config: the same requests and arrival times as `tieredkv "
        "run`, Mooncake traces included) to BASE_URL/v1/completions, streaming, and report what the clients saw: "
        "the summary table, OUT/<name>-bench/result.json (the schema of `tieredkv run`, with the SLO verdict) "
        "and plots. Works against tieredkv serve, vLLM or SGLang alike.",
    )
    bench.add_argument("config", help="YAML file, or the name of a config shipped with tieredkv")
    bench.add_argument("--base-url", required=True, help="the server, e.g. http://127.0.0.1:8000 (before /v1)")
    bench.add_argument("--model", help="the served model name (default: the first at /v1/models)")
    bench.add_argument("--tokenizer", help="send prompts as text through this tokenizer (default: token ids)")
    bench.add_argument("--vocab-size", type=int, help="range of the random token ids (default: the tokenizer's, "
                       "else the config's model's)")
    bench.add_argument("--out", default="results", help="where result.json and the plots go (default: results/)")
    bench.add_argument("--no-progress", action="store_true", help="hide the progress bar")


def _bench(args: argparse.Namespace) -> int:
    """`tieredkv bench`: 2 and one `tieredkv: error:` line on a bad config or an unreachable server;
    1 if every request failed."""
    from tieredkv.config import find_config
    from tieredkv.experiment.client import bench
    from tieredkv.experiment.harness import format_summary

    try:
        done = bench(find_config(args.config), args.base_url, args.out, args.model, args.tokenizer,
                     args.vocab_size, use_tqdm=not args.no_progress)
    except (ValueError, OSError) as err:
        print(f"tieredkv: error: {err}", file=sys.stderr)
        return EXIT_ERROR
    print(format_summary(done.summary))
    if failure := _all_failed(done.summary):
        print(f"tieredkv: failed: {failure}", file=sys.stderr)
    print(f"results in {done.folder}/")
    return EXIT_FAILED_RUNS if failure else 0


COMMANDS: dict[str, Callable[[argparse.Namespace], int]] = {"run": _run_command, "serve": serve.main, "bench": _bench}

if __name__ == "__main__":
    sys.exit(main())
